"""Parallelism: the device mesh (mesh.py), every sharding of the run (rules.py), the
multi-process host side (multihost.py) and the strided mini-/micro-batch split (split.py),
all importable from `gspo_jax.sharding`. docs/architecture.md is the map.
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
