"""`RunState`: everything a run changes as it goes, as one value that is saved, restored and
passed from one RL step to the next.

    train       TrainState: params, optimizer state, optimizer updates applied (with LoRA
                the optimizer state covers the adapters only, and so does the checkpoint)
    rng         uint32 [2] key data of config.seed; RL step k samples with fold_in(rng, k)
    running     RunningMoments of the rewards (reward_norm="running")
    ref_params  π_ref's params (only with a KL term: use_kl_loss / add_token_level_kl)
    step        RL steps completed (host int)
    data        the prompt iterator's position (JSON string): global batches, so the same on
                every process and for any number of processes
    origin      where the params came from ("scratch initialisation", a checkpoint, ...)

The array fields are the checkpoint's `state` item and the host fields its `meta` item
(`checkpoint.py`), read off the dataclass's own fields: the tree is written down once,
here. `new_state` is the one constructor: `init_state` calls it on real params (jitted,
into the state's shardings), `abstract_state` under `jax.eval_shape` for the tree a
checkpoint is restored into.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from gspo_jax import sharding as sharding_lib
from gspo_jax.algorithm import advantages
from gspo_jax.models import lora
from gspo_jax.train_step import TrainState


@flax.struct.dataclass
class RunState:
    train: TrainState
    rng: jax.Array
    running: advantages.RunningMoments
    ref_params: Any  # None without a KL term
    step: int = flax.struct.field(pytree_node=False, default=0)
    data: str = flax.struct.field(pytree_node=False, default="")
    origin: str = flax.struct.field(pytree_node=False, default="")

    def arrays(self) -> dict[str, Any]:
        """The array fields by name (None ones left out): the checkpoint's `state` item.
        With LoRA the train state's params are the adapters alone: the frozen base comes
        from where the run started (hf_path, the saved warm start, the seed)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("pytree_node", True) and getattr(self, f.name) is not None
        }
        out["train"] = self.train.replace(params=lora.trainable(self.train.params))
        return out

    def meta(self) -> dict[str, Any]:
        """The host fields by name: the checkpoint's `meta` item."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.metadata.get("pytree_node", True)
        }

    def restored(self, arrays: dict[str, Any], meta: dict[str, Any]) -> RunState:
        """This (abstract) state with its fields replaced by a checkpoint's items."""
        return self.replace(**arrays, **{k: meta[k] for k in self.meta()})


def new_state(params, tx: optax.GradientTransformation, seed: int, *, with_ref: bool) -> RunState:
    """The state before the first RL step: fresh optimizer, π_ref = the starting policy."""
    return RunState(
        train=TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(lora.trainable(params))
        ),
        rng=jax.random.key_data(jax.random.PRNGKey(seed)),
        running=advantages.init_running_moments(),
        ref_params=params if with_ref else None,
    )


def _shapes(abstract_params, tx, with_ref: bool) -> RunState:
    return jax.eval_shape(lambda p: new_state(p, tx, 0, with_ref=with_ref), abstract_params)


def state_shardings(
    abstract_params, param_shardings, tx: optax.GradientTransformation, mesh, *, with_ref: bool
) -> RunState:
    """Shardings of every array of the state: params (and π_ref) by their logical axes
    (`param_shardings`), the optimizer's moments like their params, the rest replicated."""
    replicated = sharding_lib.replicated(mesh)
    shapes = _shapes(abstract_params, tx, with_ref)
    opt = sharding_lib.optimizer_state_shardings(
        tx, lora.trainable(abstract_params), lora.trainable(param_shardings), mesh
    )
    return shapes.replace(
        train=TrainState(step=replicated, params=param_shardings, opt_state=opt),
        rng=replicated,
        running=jax.tree.map(lambda _: replicated, shapes.running),
        ref_params=param_shardings if with_ref else None,
    )


def abstract_state(abstract_params, tx: optax.GradientTransformation, shardings: RunState):
    """ShapeDtypeStructs of `new_state`, each carrying its sharding: a restore target."""
    shapes = _shapes(abstract_params, tx, shardings.ref_params is not None)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings
    )


def init_state(
    params, tx: optax.GradientTransformation, seed: int, shardings: RunState, *, origin: str
) -> RunState:
    """`new_state` of real params, created in `shardings` (the optimizer state is never
    whole on one device). π_ref, when there is one, is a copy: the train step donates the
    policy's buffers."""
    with_ref = shardings.ref_params is not None
    init = jax.jit(
        lambda p: new_state(p, tx, seed, with_ref=False),
        out_shardings=shardings.replace(ref_params=None),
    )
    state = init(params)
    ref = jax.tree.map(jnp.copy, params) if with_ref else None
    return state.replace(ref_params=ref, origin=origin)
