"""Partition specs for the model's own `jax.shard_map` regions (splash attention, MoE).

A few model functions run per device inside `jax.shard_map` over the mesh in context
(`jax.set_mesh`). They name their arrays' dimensions with the same logical axes as the
parameters ("batch", "heads", "kv_heads", ...), and this maps them with
`sharding.LOGICAL_RULES`, keeping only the mesh axes the context mesh has and, as
`sharding.logical_to_spec` does, only those that divide the dimension (the rest is
replicated). Model code therefore still names logical axes only (sharding is data).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

# Logical layouts of the model's activations (Shape letters: B rows, L tokens, D width,
# H / K query / kv heads, C head dim, F MLP width, V vocabulary).
RESIDUAL = ("batch", None, None)  # [B, L, D]: rows over the batch axes, D whole
HEADS = ("batch", None, "heads", None)  # [B, L, H, C]
KV_HEADS = ("batch", None, "kv_heads", None)  # [B, L, K, C]
HIDDEN = ("batch", None, "mlp")  # [B, L, F]


def context_mesh():
    """The mesh in context, or None (no `jax.set_mesh`, or a single device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def constrain(x, names: Sequence[str | None]):
    """`x` laid out by its logical dimension `names` on the mesh in context
    (`jax.lax.with_sharding_constraint`); `x` itself without a mesh or on one device.

    The model pins its activations with this where GSPMD would otherwise guess (embedding
    output, every layer's input and output, attention, MLP, the unembedding): rows over
    the batch axes, heads / MLP width / vocabulary over tensor. Left to propagation, the
    parameters' fsdp-sharded `embed` dimension spread into the activations, and every
    chip multiplied all rows by its slice of the weights, then all-reduced activations
    (docs/architecture.md, "Performance rules": Layouts). A constraint changes where
    values live, never their values.
    """
    mesh = context_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec(mesh, names, x.shape))


def row_shards(rows: int) -> int:
    """Devices that `rows` rows of a batch are split over on the mesh in context (the
    batch axes that divide `rows`, as `constrain` lays them out); 1 without a mesh."""
    mesh = context_mesh()
    if mesh is None:
        return 1
    axes = spec(mesh, ("batch",), (rows,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return size


def spec(mesh, names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    """PartitionSpec of an array of `shape` with logical dimension `names` on `mesh`."""
    from gspo_jax import sharding

    def present(target):
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        return tuple(a for a in axes if a in mesh.shape)

    rules = {n: present(sharding.LOGICAL_RULES.get(n)) for n in names if n is not None}
    return sharding.logical_to_spec(names, shape, mesh, rules)
