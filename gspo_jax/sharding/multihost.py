"""The host side of a multi-process run: every host runs the same program.

`to_global` / `to_local` move a batch between this process's numpy rows and global arrays,
`process_rows` says which rows of a global batch are this process's, and `host_max`,
`host_sum`, `gather_rows`, `gather_json`, `lead_first` and `gather_params` are the only
places that talk to the other processes (`jax.experimental.multihost_utils`). With one
process they cost nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from gspo_jax.sharding.rules import batch_sharding, data_parallel_size, replicated


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


def to_replicated(mesh: Mesh, value) -> jax.Array:
    """A value every process holds whole (a fully replicated array, numpy) -> one global
    array replicated over `mesh`, e.g. a key moved from the trainer's mesh to the
    rollout's (device_put cannot target another mesh's devices from several processes)."""
    value = np.asarray(value)
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    return jax.make_array_from_process_local_data(sharding, value)


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


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (nothing with one process)."""
    if jax.process_count() > 1:
        _multihost().sync_global_devices(f"gspo_jax:{name}")


def lead_first(name: str, lead_fn: Callable[[], Any], other_fn: Callable[[], Any]) -> Any:
    """Process 0 runs `lead_fn` (which writes shared files); the others wait, then `other_fn`.

    If `lead_fn` raises, process 0 re-raises its error and the others raise one naming it,
    instead of waiting at the barrier until the coordination timeout.
    """
    if jax.process_count() == 1:
        return lead_fn()
    out, error = None, None
    if jax.process_index() == 0:
        try:
            out = lead_fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            error = e
    barrier(name)
    if host_max(error is not None):
        if error is not None:
            raise error
        raise RuntimeError(f"process 0 failed while preparing the {name} (see its log)")
    return out if jax.process_index() == 0 else other_fn()


def gather_params(tree) -> Any:
    """A (possibly multi-host sharded) tree as whole numpy arrays on every process."""
    if jax.process_count() > 1:
        tree = _multihost().process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, jax.device_get(tree))
