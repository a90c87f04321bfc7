"""The parameter tree: creation (random, abstract), logical axes, counts, and merging a
plain nested dict of arrays into the NNX `Decoder`.

Params are a plain nested dict of arrays (the tree is drawn in models/__init__.py);
`logical_axes` names each dimension for sharding/rules.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import partition
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.decoder import Decoder


@functools.cache
def _graph(cfg: ModelConfig):
    """(graphdef, abstract State) of the Decoder for this config, built once."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)), graph_updates=False)
    return nnx.split(abstract)  # (graph_updates=False: see _block_graph)


def merge(cfg: ModelConfig, params) -> Decoder:
    """Decoder module holding `params` (a nested dict as returned by init_params)."""
    graphdef, abstract_state = _graph(cfg)
    _check_params(cfg, params)
    state = jax.tree.map(lambda v: v, abstract_state)  # fresh Variables, cached ones untouched
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _check_params(cfg: ModelConfig, params) -> None:
    """Clear error (at trace time) when params do not fit the config's tree and shapes."""

    def paths(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(str(getattr(k, "key", k)) for k in p): tuple(x.shape) for p, x in flat}

    want, got = paths(abstract_params(cfg)), paths(params)
    if want == got:
        return
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    details = [
        f"missing {missing[:4]}" if missing else "",
        f"unexpected {extra[:4]}" if extra else "",
    ]
    details += [f"{k} has shape {got[k]}, expected {want[k]}" for k in wrong[:4]]
    raise ValueError(
        f"params do not fit this {cfg.arch} ModelConfig: " + "; ".join(d for d in details if d)
    )


def _state_to_dict(state, leaf_fn):
    """nnx.State -> nested dict, applying leaf_fn to each Variable."""
    out = {}
    for key, value in state.items():
        if isinstance(value, nnx.Variable):
            out[key] = leaf_fn(value)
        else:
            out[key] = _state_to_dict(value, leaf_fn)
    return out


def init_params(model_config: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters, normal(0, 0.02) for matrices, ones for norms, zeros for biases.

    Jittable with model_config static (give out_shardings to create them sharded).
    """
    model = Decoder(model_config, nnx.Rngs(params=rng))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def abstract_params(model_config: ModelConfig) -> dict:
    """ShapeDtypeStructs of the parameters (no allocation)."""
    return _state_to_dict(_graph(model_config)[1], lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype))


def logical_axes(model_config: ModelConfig) -> dict:
    """Same tree as the params; each leaf a tuple of logical axis names (or None per dim).

    Names: "layers" (the leading axis of every per-layer parameter), "vocab", "embed",
    "heads", "kv_heads", "mlp", "expert"; None for head_dim, norm scales and the router's
    expert dim (kept replicated). Map with
    `jax.tree.map(fn, params, logical_axes(cfg))` (params first, so tuples stay whole).
    """
    return _state_to_dict(
        _graph(model_config)[1], lambda v: tuple(v.get_metadata()["out_sharding"])
    )


def param_count(model_config: ModelConfig, *, active: bool = False) -> int:
    """Number of parameters; `active=True` counts only top-k of the experts per MoE layer."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(model_config))[0]:
        n = 1
        for s in leaf.shape:
            n *= s
        names = [getattr(p, "key", None) for p in path]
        is_expert = names[-2:-1] == ["moe"] and names[-1] in ("gate_proj", "up_proj", "down_proj")
        if active and is_expert:  # expert tensor [M, E, ., .]: only top-k of E are used
            n = n // model_config.num_experts * model_config.num_experts_per_tok
        total += n
    return total


def for_decoding(model_config: ModelConfig, params: dict) -> dict:
    """`params` in the rollout's layout: no weight split over `embed` (under the trainer's
    rules each weight is whole on every chip of the fsdp axis, its tensor / expert sharding
    kept; under `sharding.ROLLOUT_RULES` (`partition.layout`) heads, MLP and vocabulary are
    split over fsdp x tensor), so a decode loop gathers the weights once, here, instead of
    once per token (FSDP's per-use gather inside a loop of response_length iterations moves
    the whole model every token). Call it inside the sampler's jitted function, before its
    loop; a no-op without a mesh in context, and on weights already in that layout
    (`rollout_params` makes them so once per RL step). Values are unchanged.

    Memory (trainer's rules): the model at `param_dtype` on every chip of an fsdp group, next
    to the trainer's sharded copy, while the rollout runs (Qwen3-0.6B f32: 2.4 GB; Qwen3-8B:
    33 GB). Under the rollout rules: 1/(fsdp x tensor) of it per chip.
    """
    mesh = partition.context_mesh()
    if mesh is None:
        return params

    def unsplit_embed(x, names):
        names = tuple(None if n == "embed" else n for n in names)
        return jax.lax.with_sharding_constraint(x, partition.spec(mesh, names, x.shape))

    return jax.tree.map(unsplit_embed, params, logical_axes(model_config))


def _kept_in_float32(path) -> bool:
    """Weights the model uses in float32 whatever its compute dtype: the MoE router (its
    matmul runs in float32, layers.MoE)."""
    return any(getattr(p, "key", None) == "router" for p in path)


def rollout_params(model_config: ModelConfig, params: dict) -> dict:
    """The policy as the sampler reads it: every weight cast to the compute dtype
    (`model_config.dtype`; the MoE router stays as it is: it runs in float32), then
    `for_decoding`'s layout. The model casts each weight to the compute dtype where it uses
    it, so samples and log-probs are unchanged; the rollout's copy is half the size of f32
    master weights with a bf16 model. Jit it with out_shardings (`sampling.RolloutLayout`)
    to make the copy once per RL step."""
    dtype = jnp.dtype(model_config.dtype)

    def cast(path, x):
        if _kept_in_float32(path) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    return for_decoding(model_config, jax.tree_util.tree_map_with_path(cast, params))
