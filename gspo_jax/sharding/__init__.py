"""Parallelism: the device mesh, every sharding of the run, and the multi-process host side.

    mesh.py        the mesh axes (data, fsdp, tensor, expert), their sizes, the mesh
    rules.py       logical axis names -> mesh axes (LOGICAL_RULES), parameter, optimizer-state
                   and batch shardings
    multihost.py   this process's rows <-> global arrays, and the few host collectives
                   (host_max, host_sum, gather_*, lead_first)
    hlo_stats.py   the collectives of a compiled program, read from its HLO text, with how
                   often each runs (tools/aot.py's roofline estimate, the layout tests)

Everything but hlo_stats (`from gspo_jax.sharding import hlo_stats`) is importable from
`gspo_jax.sharding` itself.
"""

from gspo_jax.sharding.mesh import (
    BATCH_AXES,
    MESH_AXES,
    data_parallel_size_of,
    make_mesh,
    mesh_shape,
)
from gspo_jax.sharding.multihost import (
    barrier,
    gather_json,
    gather_params,
    gather_rows,
    host_max,
    host_sum,
    lead_first,
    process_rows,
    to_global,
    to_local,
)
from gspo_jax.sharding.rules import (
    LOGICAL_RULES,
    ROLLOUT_LAYOUTS,
    ROLLOUT_RULES,
    batch_sharding,
    batch_shardings,
    data_parallel_size,
    layout_rules,
    logical_to_spec,
    optimizer_state_shardings,
    replicated,
    resolve_rollout_layout,
    tree_shardings,
)

__all__ = [
    "BATCH_AXES",
    "LOGICAL_RULES",
    "MESH_AXES",
    "ROLLOUT_LAYOUTS",
    "ROLLOUT_RULES",
    "barrier",
    "batch_sharding",
    "batch_shardings",
    "data_parallel_size",
    "data_parallel_size_of",
    "gather_json",
    "gather_params",
    "gather_rows",
    "host_max",
    "host_sum",
    "layout_rules",
    "lead_first",
    "logical_to_spec",
    "make_mesh",
    "mesh_shape",
    "optimizer_state_shardings",
    "process_rows",
    "replicated",
    "resolve_rollout_layout",
    "to_global",
    "to_local",
    "tree_shardings",
]
