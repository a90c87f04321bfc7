"""The device mesh, every sharding of the run, and the few multi-process collectives the
host side needs, in one place.

Model code only names logical axes ("vocab", "embed", "heads", "kv_heads", "mlp", "expert");
LOGICAL_RULES maps them to mesh axes. Change the table (or the mesh shape in the config) to
move from pure data parallelism to FSDP, tensor or expert parallelism: no model code changes.

Mesh axes: data (batch only), fsdp (batch + parameters, ZeRO-3 style), tensor (heads, mlp,
vocab), expert (MoE experts; batch too, so expert devices never duplicate dense work).

Host side of a multi-process run (every host runs the same program): `to_global` /
`to_local` move a batch between this process's numpy rows and global arrays,
`process_rows` says which rows of a global batch are this process's, and `host_max`,
`host_sum`, `gather_rows`, `gather_json`, `lead_first` and `gather_params` are the only
places that talk to the other processes (`jax.experimental.multihost_utils`). With one
process they cost nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axis (or axes); None: replicated. A name missing here is an error
# (a misspelt axis must not silently replicate a weight on every device).
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


def mesh_shape(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Resolve the mesh axes (`config.mesh`: one may be -1) to sizes whose product is
    num_devices. Raises ValueError naming the field."""
    sizes = {axis: axis_sizes[axis] for axis in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {free}")
    for axis, size in sizes.items():
        if size != -1 and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"config.mesh.{axis}={size!r} must be a positive int or -1")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh axes {sizes} leave {num_devices} devices / {fixed} = "
                f"{num_devices / fixed} for mesh.{free[0]}"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh {sizes} has {fixed} devices, but {num_devices} are present")
    return sizes


def data_parallel_size_of(axis_sizes: Mapping[str, int]) -> int:
    """Devices a batch is split over (mesh.data x fsdp x expert) for resolved axis sizes."""
    return int(np.prod([axis_sizes[a] for a in BATCH_AXES]))


def make_mesh(axis_sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with MESH_AXES of the given (resolved, positive) sizes over `devices`.

    Axis types are Auto: ordinary tensor-parallel code under Explicit axes fails with
    "Contracting dimensions are sharded" (docs/jax_notes.md).
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
    if name not in rules:
        raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
    target = rules[name]
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
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules: dict | None = None):
    """NamedShardings for a tree of arrays/ShapeDtypeStructs given its logical axis names.

    `logical_tree` has the structure of `abstract_tree` with, per array, a tuple of names
    (one per dimension, None for a replicated one) or None (fully replicated). Anything else
    (a string, a list, a name without a rule, a tuple of the wrong length) raises naming the
    leaf: a malformed annotation must not quietly replicate a weight on every device.
    """
    leaves, treedef = jax.tree.flatten_with_path(abstract_tree)
    axes_leaves = (
        treedef.flatten_up_to(logical_tree) if logical_tree is not None else [None] * len(leaves)
    )
    out = []
    for (path, leaf), names in zip(leaves, axes_leaves):
        if names is None:
            out.append(NamedSharding(mesh, PartitionSpec()))
            continue
        where = jax.tree_util.keystr(path)
        if not _is_axes_leaf(names):
            raise ValueError(f"logical axes of {where} must be a tuple of names, got {names!r}")
        try:
            spec = logical_to_spec(names, leaf.shape, mesh, rules)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out.append(NamedSharding(mesh, spec))
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

    Without this, jax.jit(tx.init) put Adam's moments on one device (docs/jax_notes.md).
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


def process_rows(mesh: Mesh, num_rows: int) -> np.ndarray:
    """The rows of a global batch of `num_rows` that this process holds under the batch
    sharding, in the order `to_global` takes them and `to_local` returns them (all rows with
    one process). A data iterator that serves each process exactly these rows of one global
    batch makes that batch, and the step, independent of the number of processes."""
    if jax.process_count() == 1:
        return np.arange(num_rows)
    dp = data_parallel_size(mesh)
    if num_rows % dp:
        raise ValueError(
            f"a batch of {num_rows} rows does not split over the {dp} data-parallel devices"
        )
    index_map = batch_sharding(mesh, 1).addressable_devices_indices_map((num_rows,))
    spans = {
        (s[0].start or 0, num_rows if s[0].stop is None else s[0].stop) for s in index_map.values()
    }
    return np.concatenate([np.arange(start, stop) for start, stop in sorted(spans)])


def to_local(array) -> np.ndarray:
    """The rows of a batch-sharded global array that belong to this process, as numpy."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    shards = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0
        shards.setdefault(start, np.asarray(shard.data))
    return np.concatenate([shards[k] for k in sorted(shards)], axis=0)


# ----------------------------------------------------------------------- multi-process host side


def _multihost():
    from jax.experimental import multihost_utils

    return multihost_utils


def host_max(value: int) -> int:
    """The largest `value` over all processes (the same answer on every process)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(_multihost().process_allgather(np.int32(value))))


def host_sum(values: np.ndarray) -> np.ndarray:
    """Elementwise sum over all processes of a small host array."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    return np.sum(_multihost().process_allgather(values), axis=0)


def gather_rows(local_tree):
    """Every process's rows of a small host batch (numpy), concatenated in process order, on
    every process; with one process, `local_tree` itself. For metrics of the global batch."""
    if jax.process_count() == 1:
        return local_tree
    return jax.tree.map(np.asarray, _multihost().process_allgather(local_tree, tiled=True))


def gather_json(obj: Any) -> list:
    """[obj of process 0, obj of process 1, ...] for a JSON-able obj, on every process."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    padded = np.zeros(host_max(raw.size), np.uint8)
    padded[: raw.size] = raw
    rows = _multihost().process_allgather(padded)
    return [json.loads(bytes(r).rstrip(b"\x00").decode()) for r in np.asarray(rows)]


def lead_first(name: str, lead_fn: Callable[[], Any], other_fn: Callable[[], Any]) -> Any:
    """Process 0 runs `lead_fn` (which writes shared files); the others wait, then `other_fn`."""
    if jax.process_count() == 1:
        return lead_fn()
    if jax.process_index() == 0:
        out = lead_fn()
        _multihost().sync_global_devices(f"gspo_jax:{name}")
        return out
    _multihost().sync_global_devices(f"gspo_jax:{name}")
    return other_fn()


def gather_params(tree) -> Any:
    """A (possibly multi-host sharded) tree as whole numpy arrays on every process."""
    if jax.process_count() > 1:
        tree = _multihost().process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, jax.device_get(tree))
