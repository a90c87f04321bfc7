"""Partition specs for the model's own `jax.shard_map` regions (splash attention, MoE), and
the logical-axis rules in force (`layout`: the trainer's, or the rollout's).

A few model functions run per device inside `jax.shard_map` over the mesh in context
(`jax.set_mesh`). They name their arrays' dimensions with the same logical axes as the
parameters ("batch", "heads", "kv_heads", ...), and this maps them with
`sharding.LOGICAL_RULES`, keeping only the mesh axes the context mesh has and, as
`sharding.logical_to_spec` does, only those that divide the dimension (the rest is
replicated). Model code therefore still names logical axes only (sharding is data).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

# Logical layouts of the model's activations (Shape letters: B rows, L tokens, D width,
# H / K query / kv heads, C head dim, F MLP width, V vocabulary).
RESIDUAL = ("batch", None, None)  # [B, L, D]: rows over the batch axes, D whole
HEADS = ("batch", None, "heads", None)  # [B, L, H, C]
KV_HEADS = ("batch", None, "kv_heads", None)  # [B, L, K, C]
HIDDEN = ("batch", None, "mlp")  # [B, L, F]


_RULES: contextvars.ContextVar = contextvars.ContextVar("gspo_jax_layout_rules", default=None)


@contextlib.contextmanager
def layout(rules: dict | None):
    """Model code traced inside this context maps logical axes with `rules` instead of
    `sharding.LOGICAL_RULES` (None: those). The sampler traces its jitted stages under the
    rollout's rules (`sharding.ROLLOUT_RULES`: tensor-parallel over fsdp x tensor, rows over
    data), the continuous engine's replicas under `without_axes` of them. Enter it
    inside a jitted function whose static arguments decide the rules: jit's cache does not
    see this context."""
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def active_rules() -> dict:
    """The logical-axis rules in force (`layout`), by default `sharding.LOGICAL_RULES`."""
    from gspo_jax import sharding

    rules = _RULES.get()
    return sharding.LOGICAL_RULES if rules is None else rules


def without_axes(rules: dict, axes) -> dict:
    """`rules` for code running per replica inside a shard_map manual over `axes`: those
    axes dropped from every rule (they index replicas, not a dimension's shards), rows
    ("batch") whole."""
    manual = set(axes)

    def keep(target):
        kept = tuple(a for a in ((target,) if isinstance(target, str) else target or ()))
        kept = tuple(a for a in kept if a not in manual)
        return kept or None

    return {name: keep(target) for name, target in rules.items()} | {"batch": None}


def rows_whole() -> bool:
    """Whether the rules in force keep rows ("batch") whole on the mesh in context (the
    rollout's tensor layout, or a replica of the continuous engine); True without a mesh."""
    mesh = context_mesh()
    if mesh is None:
        return True
    target = active_rules().get("batch")
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    return all(mesh.shape.get(a, 1) == 1 for a in axes)


def auto_axes(mesh) -> tuple[str, ...]:
    """The mesh's axes GSPMD partitions (not manual: inside a shard_map over some axes,
    the others), whatever their size."""
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return tuple(a for a in mesh.axis_names if types[a] != jax.sharding.AxisType.Manual)


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
    return shards("batch", rows)


def shards(name: str, size: int) -> int:
    """Devices a dimension of `size` named `name` is split over on the mesh in context
    under the rules in force (1 without a mesh)."""
    mesh = context_mesh()
    if mesh is None:
        return 1
    axes = spec(mesh, (name,), (size,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    n = 1
    for axis in axes:
        n *= mesh.shape[axis]
    return n


def spec(mesh, names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    """PartitionSpec of an array of `shape` with logical dimension `names` on `mesh`, under
    the rules in force (`layout`)."""
    from gspo_jax import sharding

    def present(target):
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        return tuple(a for a in axes if a in mesh.shape)

    table = active_rules()
    rules = {n: present(table.get(n)) for n in names if n is not None}
    return sharding.logical_to_spec(names, shape, mesh, rules)
