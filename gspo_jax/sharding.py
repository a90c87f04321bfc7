"""The device mesh and every sharding of the run, derived from the config in one place.

Model code only names logical axes ("vocab", "embed", "heads", "kv_heads", "mlp", "expert");
LOGICAL_RULES maps them to mesh axes. Change the table (or the mesh shape in the config) to
move from pure data parallelism to FSDP, tensor or expert parallelism: no model code changes.

Mesh axes: data (batch only), fsdp (batch + parameters, ZeRO-3 style), tensor (heads, mlp,
vocab), expert (MoE experts; batch too, so expert devices never duplicate dense work).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axis (or axes). Missing names are replicated.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "layers": None,  # the stacked-layer axis the decoder scans over: never sharded
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
}


def make_mesh(axis_sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with MESH_AXES of the given (resolved, positive) sizes over `devices`.

    Axis types are Auto: ordinary tensor-parallel code under Explicit axes fails with
    "Contracting dimensions are sharded" (JAX_NOTES.md).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(int(axis_sizes[a]) for a in MESH_AXES)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape))} needs {np.prod(shape)} devices, got {len(devices)}"
        )
    return jax.make_mesh(
        shape,
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def _mesh_axes_for(name: str | None, rules) -> tuple[str, ...]:
    if name is None:
        return ()
    target = rules.get(name)
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: dict | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry logical `names`.

    A dimension is sharded only over mesh axes of size > 1 that divide it and that no earlier
    dimension already uses; otherwise it is replicated along that axis (e.g. 2 kv heads on a
    tensor axis of 4 stay whole rather than failing).
    """
    rules = LOGICAL_RULES if rules is None else rules
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        axes = []
        size = 1
        for axis in _mesh_axes_for(name, rules):
            n = mesh.shape[axis]
            if n == 1 or axis in used or dim % (size * n):
                continue
            axes.append(axis)
            size *= n
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def _is_axes_leaf(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules: dict | None = None):
    """NamedShardings for a tree of arrays/ShapeDtypeStructs given its logical axis names.

    `logical_tree` has the structure of `abstract_tree` with a tuple of names (or None: fully
    replicated) per array.
    """
    leaves, treedef = jax.tree.flatten(abstract_tree)
    axes_leaves = (
        treedef.flatten_up_to(logical_tree) if logical_tree is not None else [None] * len(leaves)
    )
    out = []
    for leaf, names in zip(leaves, axes_leaves):
        if names is None or not _is_axes_leaf(names):
            out.append(NamedSharding(mesh, PartitionSpec()))
        else:
            out.append(NamedSharding(mesh, logical_to_spec(names, leaf.shape, mesh, rules)))
    return jax.tree.unflatten(treedef, out)


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading (batch) dimension over the data-parallel axes; the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(mesh: Mesh, tree):
    """batch_sharding for every array of `tree` (scalars replicated)."""
    return jax.tree.map(
        lambda x: batch_sharding(mesh, np.ndim(x)) if np.ndim(x) else replicated(mesh), tree
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def optimizer_state_shardings(tx, abstract_params, param_shardings, mesh: Mesh):
    """Shardings of tx.init(params): moments shard like their params, counters replicate.

    Without this, jax.jit(tx.init) put Adam's moments on one device (JAX_NOTES.md).
    """
    import optax

    abstract_state = jax.eval_shape(tx.init, abstract_params)
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated(mesh),
    )


def to_global(mesh: Mesh, local_tree):
    """This process's rows (numpy) -> global arrays sharded over the batch axes.

    With one process this is a device_put; with several, each contributes its rows (in
    process order) via jax.make_array_from_process_local_data. A batch whose rows do not
    split over the data-parallel devices (a few prompts on many devices) is replicated when
    there is one process; with several processes that is an error naming the sizes.
    """
    dp = data_parallel_size(mesh)

    def put(x):
        x = np.asarray(x)
        rows = x.shape[0] * jax.process_count() if x.ndim else 0
        if x.ndim and rows % dp == 0:
            sharding = batch_sharding(mesh, x.ndim)
        elif x.ndim and jax.process_count() > 1:
            raise ValueError(
                f"a batch of {rows} rows ({x.shape[0]} per process) does not split over the "
                f"{dp} data-parallel devices"
            )
        else:
            sharding = replicated(mesh)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(put, local_tree)


def to_local(array) -> np.ndarray:
    """The rows of a batch-sharded global array that belong to this process, as numpy."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    shards = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0
        shards.setdefault(start, np.asarray(shard.data))
    return np.concatenate([shards[k] for k in sorted(shards)], axis=0)
