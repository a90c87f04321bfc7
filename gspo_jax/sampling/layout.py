"""The rollout's copy of the policy: made from the trainer's parameters once per RL step.

The trainer keeps float32 master weights split for training (FSDP: each chip holds a slice
of every weight's `embed` dimension). Decoding reads every weight once per token, so the
rollout reads its own copy instead:

  - in the compute dtype (`model_config.dtype`; the MoE router stays float32, as the model
    uses it): the model casts each weight where it uses it, so samples and log-probs do not
    change, and a bf16 model's copy is half the bytes of its f32 master weights;
  - in the decode layout: "tensor" (`sharding.ROLLOUT_RULES`) splits heads, MLP, KV heads and
    vocabulary over fsdp x tensor and keeps rows whole (each chip reads 1/(fsdp x tensor)
    of the weights per token); "trainer" keeps the trainer's rules with every weight whole
    over fsdp (`models.for_decoding`).

`RolloutLayout(model_config, mesh, layout)(params)` is one jitted reshard with explicit
out_shardings (what moves: `tools.aot`'s "rollout reshard" row). The RL loop calls it once per
step before sampling (`rollout/stage.py`, logged as time/rollout_reshard_s) and hands the
copy to `sample(..., layout=...)`.

A mesh of its own (`rollout_mesh`, config `sampling.rollout_mesh.tensor`): the same chips
regrouped for decoding, independent of the trainer's mesh: tensor-parallel groups of T chips
(mesh.tensor) × replicas (mesh.data), the "tensor" layout on it. `RolloutLayout` over that
mesh reshards the trainer's params onto it (one jit whose inputs are on the trainer's mesh
and outputs on the rollout's: the same devices), once per RL step; the prompts go onto it
and the samples come back to the trainer's mesh (rollout/stage.py).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import mesh_utils

from gspo_jax import models, sharding
from gspo_jax.models import partition


def traced_under_layout(fn):
    """`fn(..., layout="trainer" | "tensor")` traced with that layout's rules
    (`partition.layout`); keeps fn's signature, so jit's static_argnames sees `layout`."""

    @functools.wraps(fn)
    def wrapped(*args, layout="trainer", **kwargs):
        with partition.layout(sharding.layout_rules(layout)):
            return fn(*args, layout=layout, **kwargs)

    return wrapped


def rollout_mesh(devices, tensor: int) -> jax.sharding.Mesh:
    """The rollout's own mesh over `devices` (`sharding.MESH_AXES`): groups of `tensor`
    chips that split the model (mesh.tensor) × len(devices) / tensor replicas (mesh.data).
    `mesh_utils.create_device_mesh` puts a group on neighbouring chips;
    allow_split_physical_axes lets a group take part of a physical axis (4 chips of a
    4x4 slice's row), where the trainer's mesh may use the whole axis otherwise.

    With several processes each group stays within one process (`tensor` must divide each
    process's device count) and the replicas are in process order: process p's prompts
    (`sharding.to_global`: rows in process order) land on process p's own replicas, so
    the samples that come back to it are those of its own prompts."""
    devices = list(devices)
    n = len(devices)
    if isinstance(tensor, bool) or int(tensor) != tensor or tensor < 1 or n % tensor:
        raise ValueError(
            f"sampling.rollout_mesh.tensor={tensor!r} must be a positive int dividing the "
            f"{n} devices"
        )
    tensor = int(tensor)
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    local = {len(v) for v in by_process.values()}
    if len(local) != 1 or next(iter(local)) % tensor:
        raise ValueError(
            f"sampling.rollout_mesh.tensor={tensor} must divide every process's devices "
            f"({sorted(local)} per process): a tensor-parallel group stays within a process"
        )
    grid = np.concatenate([_group_grid(by_process[p], tensor) for p in sorted(by_process)], axis=0)
    auto = (jax.sharding.AxisType.Auto,) * len(sharding.MESH_AXES)
    return jax.sharding.Mesh(grid, sharding.MESH_AXES, axis_types=auto)


def _group_grid(devices: list, tensor: int) -> np.ndarray:
    """[len/tensor, 1, tensor, 1] devices of one process, neighbours in a group where the
    physical layout is known (TPU); in the given order elsewhere."""
    shape = (len(devices) // tensor, 1, tensor, 1)
    try:
        return np.asarray(
            mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        )
    except (ValueError, NotImplementedError, AssertionError):
        # a subset of a slice whose physical shape mesh_utils cannot tile (one host's chips)
        return np.asarray(devices).reshape(shape)


def rollout_shardings(model_config, abstract_params, mesh, layout: str):
    """NamedShardings of the rollout copy of `abstract_params` for `layout` ("tensor" or
    "trainer"): the layout's rules, no weight split over `embed`."""
    rules = sharding.layout_rules(layout)

    def whole_embed(names):
        return None if names is None else tuple(None if n == "embed" else n for n in names)

    axes = jax.tree.map(
        whole_embed,
        models.logical_axes(model_config),
        is_leaf=lambda x: x is None or isinstance(x, tuple),
    )
    return sharding.tree_shardings(abstract_params, axes, mesh, rules)


class RolloutLayout:
    """params -> the rollout's copy (compute dtype, decode layout), one jitted reshard.

    `layout`: "auto" | "tensor" | "trainer" (`sharding.resolve_rollout_layout` against the
    mesh; the resolved name is `.layout`, what `sample(layout=...)` takes). Built lazily on
    the first call from the params' own tree (LoRA adapters included)."""

    def __init__(self, model_config, mesh, layout: str = "auto"):
        self.model_config = model_config
        self.mesh = mesh
        self.layout = sharding.resolve_rollout_layout(
            layout, dict(mesh.shape), kv_heads=model_config.num_kv_heads
        )
        self._fn = None
        self._target = None  # the shardings on `mesh` when the jit lands on its twin

    def jitted(self, params):
        """The jitted cast + reshard for params shaped like `params` (arrays or
        ShapeDtypeStructs) onto `self.mesh`; or, where `params` live on the same devices in
        another order (a rollout mesh of its own on a TPU slice: one jit cannot take inputs
        and outputs in two device orders), onto its twin in the params' order, whose shards
        `__call__` then moves onto `self.mesh` (jax.device_put: a permutation of shards)."""
        if self._fn is None:
            cfg, rules = self.model_config, sharding.layout_rules(self.layout)

            def make(p):
                with partition.layout(rules):
                    return models.rollout_params(cfg, p)

            abstract = jax.eval_shape(lambda p: models.rollout_params(cfg, p), params)
            mesh = _twin(self.mesh, params)
            out = rollout_shardings(cfg, abstract, mesh, self.layout)
            self._fn = jax.jit(make, out_shardings=out)
            if mesh is not self.mesh:
                self._target = rollout_shardings(cfg, abstract, self.mesh, self.layout)
        return self._fn

    def __call__(self, params):
        out = self.jitted(params)(params)
        if self._target is not None:
            out = jax.device_put(out, self._target, donate=True)
        return out


def _twin(mesh, params):
    """`mesh`, or the same shape and axes over the devices of `params` in their order when
    those are `mesh`'s devices in another order."""
    leaf = jax.tree.leaves(params)[0]
    source = getattr(getattr(leaf, "sharding", None), "mesh", None)
    if source is None:
        return mesh
    ours, theirs = list(mesh.devices.flat), list(source.devices.flat)
    if ours == theirs or set(ours) != set(theirs):
        return mesh
    devices = np.asarray(theirs).reshape(mesh.devices.shape)
    return jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
