"""Logical axes -> mesh axes, and every sharding of the run's arrays.

Model code only names logical axes ("vocab", "embed", "heads", "kv_heads", "mlp", "expert");
LOGICAL_RULES maps them to mesh axes. Change the table (or the mesh shape in the config) to
move from pure data parallelism to FSDP, tensor or expert parallelism: no model code changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gspo_jax.sharding.mesh import BATCH_AXES

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


# The rollout's decode layout (`rollout_layout="tensor"`): every weight split over the
# model-parallel axes (fsdp and tensor together: a tensor-parallel group of fsdp x tensor
# chips, e.g. a host's), none gathered whole; rows over data (and expert) only, the KV
# pages' token axes whole; vocabulary split (tokens are drawn from vocabulary-sharded
# logits). A decode step reads 1/(fsdp x tensor) of the weights and of the KV heads per
# chip, at the price of two all-reduces of [rows, hidden] per layer; mesh.data replicas
# (across hosts) each decode their own rows (the continuous engine: one engine per replica).
ROLLOUT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "expert"),
    "layers": None,
    "vocab": ("fsdp", "tensor"),
    "embed": None,
    "heads": ("fsdp", "tensor"),
    "kv_heads": ("fsdp", "tensor"),
    "mlp": ("fsdp", "tensor"),
    "expert": "expert",
}

ROLLOUT_LAYOUTS = ("auto", "tensor", "trainer")


def layout_rules(layout: str) -> dict | None:
    """The logical rules a sampler stage traces with: ROLLOUT_RULES for "tensor", None
    (LOGICAL_RULES) for "trainer"."""
    if layout == "tensor":
        return ROLLOUT_RULES
    if layout == "trainer":
        return None
    raise ValueError(f"rollout layout {layout!r}: expected 'tensor' or 'trainer'")


def resolve_rollout_layout(
    layout: str, axis_sizes, field: str = "sampling.rollout_layout", kv_heads: int | None = None
) -> str:
    """ "auto" -> "tensor" when the mesh has model-parallel chips (M = mesh.fsdp x
    mesh.tensor > 1) that split the model's `kv_heads` evenly, else "trainer". Past the kv
    heads a tensor-parallel group cannot split the keys and values: every chip would hold
    every row's whole context (Qwen3-8B's 8 kv heads on fsdp 64: 1,179 GiB per chip at
    16k, tools.aot), where one replica per chip holds its own rows'. Pure data parallelism
    (M = 1): the two are the same rows-over-data layout. ValueError naming `field` for an
    unknown name. `axis_sizes`: the resolved mesh axis sizes (a dict)."""
    if layout not in ROLLOUT_LAYOUTS:
        raise ValueError(f"{field}={layout!r}: expected one of {ROLLOUT_LAYOUTS}")
    if layout == "auto":
        model_parallel = int(axis_sizes.get("fsdp", 1)) * int(axis_sizes.get("tensor", 1))
        splits_kv = kv_heads is None or kv_heads % model_parallel == 0
        return "tensor" if model_parallel > 1 and splits_kv else "trainer"
    return layout


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
