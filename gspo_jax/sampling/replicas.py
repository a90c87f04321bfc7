"""The continuous engine on a mesh: one replica per data-parallel chip group
(`replica_axes`: which mesh axes, and each replica's share of the page plan), each in a
`shard_map` with its own prompts, slots, pages and queue (`per_replica`), and the outputs
put back on the prompts' row layout (`row_sharding`, `place`). Sequence b is still drawn
with its global index, so the replica split changes no token.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from gspo_jax import sharding
from gspo_jax.models import partition
from gspo_jax.sampling.pages import PagePlan


def _candidate_axes(mesh, layout: str) -> list:
    """The layout's row axes but expert, of size > 1 (`replica_axes`' candidates)."""
    target = (sharding.layout_rules(layout) or sharding.LOGICAL_RULES)["batch"]
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    return [a for a in axes if a != "expert" and mesh.shape.get(a, 1) > 1]


def replica_count(mesh, layout: str) -> int:
    """How many engine replicas `mesh` can run in `layout` at most (1 without a mesh): the
    default slot count is per replica (`pages.default_num_slots`)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in _candidate_axes(mesh, layout))


def replica_axes(mesh, layout: str, num_prompts: int, p: PagePlan) -> tuple[tuple, PagePlan]:
    """(mesh axes the engine runs one replica per, each replica's page plan).

    The candidates are the layout's row axes but expert ("trainer": data, fsdp; "tensor":
    data) of size > 1: each replica decodes its own prompts' sequences on its own slots and
    pages, and the other axes split the model inside it. The longest leading run of them
    whose product D divides the prompts and the slots, and leaves each replica the pages of
    one full-length sequence; with none (or no mesh), one engine over GSPMD's layout.
    Each replica's plan: num_slots / D slots, num_pages / D response pages."""
    if mesh is None:
        return (), p
    axes = _candidate_axes(mesh, layout)
    while axes:
        D = 1
        for axis in axes:
            D *= mesh.shape[axis]
        if num_prompts % D == 0 and p.num_slots % D == 0 and p.num_pages // D >= p.seq_pages:
            local = dataclasses.replace(p, num_slots=p.num_slots // D, num_pages=p.num_pages // D)
            return tuple(axes), local
        axes.pop()
    return (), p


def per_replica(body, args, num_sequences, static, rules, replicas):
    """`body` (the engine's `_engine_body`) in a shard_map over the `replicas` mesh axes:
    each replica decodes its own prompts' sequences, numbered from its offset."""
    cfg, params, prompt_pages, plen_Q, logits_QV, rng, eos_ids_E, pad_id = args
    mesh = partition.context_mesh()
    D = 1
    for axis in replicas:
        D *= mesh.shape[axis]
    local_B = num_sequences // D
    inner = partition.without_axes(rules, replicas)
    P = jax.sharding.PartitionSpec
    rows = P(replicas)

    def one(params, prompt_pages, plen_Q, logits_QV, rng, eos_ids_E, pad_id):
        offset = jax.lax.axis_index(replicas) * local_B
        with partition.layout(inner):
            out = body(
                cfg, params, prompt_pages, plen_Q, logits_QV, rng, eos_ids_E, pad_id,
                local_B, *static, seq_offset=offset,
            )  # fmt: skip
        *per_row, steps, row_steps, preempted = out
        return (
            *per_row,
            jax.lax.pmax(steps, replicas),
            jax.lax.psum(row_steps, replicas),
            jax.lax.psum(preempted, replicas),
        )

    return jax.shard_map(
        one,
        mesh=mesh,
        in_specs=(P(), rows, rows, rows, P(), P(), P()),
        out_specs=(rows,) * 5 + (P(),) * 3,
        axis_names=frozenset(replicas),
        check_vma=False,
    )(params, prompt_pages, plen_Q, logits_QV, rng, eos_ids_E, pad_id)


def row_sharding(tokens_NP):
    """The prompts' row sharding (a NamedSharding splitting their first axis), else None.
    Without replicas the engine's outputs come out replicated (rows are written by
    sequence index from any slot), with them split over the replica axes; the static
    engine's follow the prompts' rows, and a multi-process loop reads only its own rows
    (`sharding.to_local`), so the outputs are put back on that layout."""
    s = getattr(tokens_NP, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or not s.spec or s.spec[0] is None:
        return None
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(s.spec[0]))


@functools.partial(jax.jit, static_argnums=0)
def place(sharding, arrays):
    return jax.lax.with_sharding_constraint(arrays, sharding)
