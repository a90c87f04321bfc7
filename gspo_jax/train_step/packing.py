"""Packed sequences: the train step's forward, backward and log-prob chunks over real tokens
only (`config.packing`).

A micro-batch of B rollout rows [B, L] (a left-padded prompt of P columns, then T response
columns, right padded) is laid into R rows of `pack_length` (Lp) tokens. A *segment* is
a prompt's real tokens followed by the real tokens of one or more of its responses (with
`shared_group` > 1 the responses of a group share one copy of their prompt, as
`shared_prompt` does unpacked); rows are placed longest response first (first-fit
decreasing), by one `lax.scan` over the B rows (no loop over tokens):

    row b joins its group's open segment   when its group has one and that segment's
                                           packed row has room for b's response
    else                                   a new segment (prompt + response) goes into the
                                           first packed row with room, and becomes the
                                           group's open segment

A segment's responses need not be adjacent (another segment may lie between two of them):
the mask is by segment and member, not by contiguity.

Each token keeps the position it has unpacked (positions_from_mask), and attention never
leaves a segment (block-diagonal causal, `models.hidden_states_packed`), so every real
token's hidden state, log-prob and entropy equal the unpacked ones up to f32 summation
order. Log-probs come back in the rollout's [B, T] layout (a gather by index), so every
per-sequence quantity (GSPO's ratio, the seq-mean aggregations, rollout correction, OPSM,
KL, entropy, the metrics) is computed by the unchanged objective code.

The hidden state at a response's token t − 1 predicts token t, so the packed log-prob
chunks run over the packed rows with each position's own next token as target; the first
response token is predicted by the prompt's last position, which a shared prompt holds
once for several responses: those B first tokens get a separate [B, 1] log-prob call.

R is static per compile: `rows_needed` (jitted, run before the step) counts the rows the
same placement uses, and `bucket_rows` rounds it up to a geometric bucket (eight per halving
of the row count, each within one row of 9 % above the need): a run compiles once per bucket its
batches reach, a few, since a run's packed-row need moves little between steps.

Shape letters: B rows of a micro-batch, L = P + T, R packed rows, Lp = pack_length (the
`L` of packed arrays is Lp), M MoE layers, X experts per token, D model width.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from gspo_jax import models
from gspo_jax.algorithm import logprobs as logprobs_lib
from gspo_jax.models import partition
from gspo_jax.sharding.split import strided_split

PER_OCTAVE = 8  # packed-row bucket sizes per halving of the row count (`bucket_sizes`)


@flax.struct.dataclass
class Layout:
    """Where a micro-batch's tokens go: `dst_BL` the flat index (row · Lp + column) of each
    real token of row b (`R · Lp`, out of range, for padding), and the packed rows'
    segment ids, members (0 prompt, b + 1 response b), positions and tokens."""

    dst_BL: jax.Array
    segment_RL: jax.Array
    member_RL: jax.Array
    positions_RL: jax.Array
    tokens_RL: jax.Array
    rows_used: jax.Array  # packed rows holding a segment (int32 scalar)
    fits: jax.Array  # every row placed (bool scalar): False only if R was too small


def _lengths(attention_mask_BL, prompt_len: int):
    m = attention_mask_BL.astype(jnp.int32)
    return jnp.sum(m[:, :prompt_len], 1), jnp.sum(m[:, prompt_len:], 1)


def _place(prompt_B, response_B, *, group: int, rows: int, length: int):
    """First-fit decreasing placement of B rows (see the module docstring): per row its
    packed row, the column of its segment's prompt and of its response, its segment id
    (from 1) and whether it was placed; plus the rows used."""
    B = prompt_B.shape[0]
    num_groups = B // group

    def step(carry, b):
        fill_R, row_G, start_G, id_G, seg_id = carry
        p, n, g = prompt_B[b], response_B[b], b // group
        join = (row_G[g] >= 0) & (fill_R[jnp.maximum(row_G[g], 0)] + n <= length)
        fits_R = fill_R + p + n <= length
        new_row = jnp.argmax(fits_R)
        placed = join | jnp.any(fits_R)
        row = jnp.where(join, row_G[g], new_row)
        prompt_at = jnp.where(join, start_G[g], fill_R[new_row])
        response_at = jnp.where(join, fill_R[row], fill_R[new_row] + p)
        seg_id = jnp.where(join, seg_id, seg_id + 1)
        this_id = jnp.where(join, id_G[g], seg_id)
        fill_R = fill_R.at[row].set(jnp.where(placed, response_at + n, fill_R[row]))
        if group > 1:  # the group's open segment is now this one
            row_G, start_G, id_G = (
                row_G.at[g].set(row),
                start_G.at[g].set(prompt_at),
                id_G.at[g].set(this_id),
            )
        carry = (fill_R, row_G, start_G, id_G, seg_id)
        return carry, (row, prompt_at, response_at, this_id, placed)

    # Longest responses first (stable: ties in row order), each into the first row it fits.
    order = jnp.argsort(-response_B, stable=True)
    none = jnp.full(num_groups, -1, jnp.int32)
    init = (jnp.zeros(rows, jnp.int32), none, none, none, jnp.int32(0))
    (fill_R, *_), out = jax.lax.scan(step, init, order.astype(jnp.int32))
    inverse = jnp.argsort(order)
    out = tuple(x[inverse] for x in out)
    return out, jnp.sum(fill_R > 0).astype(jnp.int32)


def layout(tokens_BL, attention_mask_BL, prompt_len: int, *, group: int, rows: int, length: int):
    """The `Layout` of one micro-batch in `rows` packed rows of `length` tokens. Rows'
    real tokens must be contiguous on each side (prompt left padded, response right
    padded: `check_contiguous`); rows n·group … n·group + group − 1 repeat one prompt."""
    B, L = tokens_BL.shape
    prompt_B, response_B = _lengths(attention_mask_BL, prompt_len)
    (row_B, prompt_at_B, response_at_B, seg_B, placed_B), rows_used = _place(
        prompt_B, response_B, group=group, rows=rows, length=length
    )
    col_L = jnp.arange(L, dtype=jnp.int32)[None]
    real_BL = attention_mask_BL.astype(bool) & placed_B[:, None]
    in_prompt_BL = col_L < prompt_len
    column_BL = jnp.where(
        in_prompt_BL,
        prompt_at_B[:, None] + col_L - (prompt_len - prompt_B[:, None]),
        response_at_B[:, None] + col_L - prompt_len,
    )
    dst_BL = jnp.where(real_BL, row_B[:, None] * length + column_BL, rows * length)
    member_BL = jnp.where(in_prompt_BL, 0, jnp.arange(1, B + 1, dtype=jnp.int32)[:, None])
    segment_BL = jnp.broadcast_to(seg_B[:, None], (B, L))
    positions_BL = models.positions_from_mask(attention_mask_BL)

    def scatter(values_BL):
        flat = jnp.zeros(rows * length, values_BL.dtype)
        return flat.at[dst_BL.ravel()].set(values_BL.ravel(), mode="drop").reshape(rows, length)

    return Layout(
        dst_BL=dst_BL,
        segment_RL=scatter(segment_BL),
        member_RL=scatter(member_BL),
        positions_RL=scatter(positions_BL),
        tokens_RL=scatter(tokens_BL.astype(jnp.int32)),
        rows_used=rows_used,
        fits=jnp.all(placed_B),
    )


def pack_length(step_config, row_length: int) -> int:
    """Lp: `step_config.pack_length`, or the rollout's row length P + T when it is 0. A
    packed row must hold any one segment, so Lp < P + T is an error naming the field."""
    length = step_config.pack_length or row_length
    if length < row_length:
        raise ValueError(
            f"pack_length={length} is shorter than a rollout row (prompt + response = "
            f"{row_length} tokens): one response and its prompt must fit a packed row"
        )
    return length


def _take(flat, index, fill=0):
    return jnp.take(flat, index, axis=0, mode="fill", fill_value=fill)


def packed_response_logprobs(
    step_config, params, tokens_BL, attention_mask_BL, response_len: int, *, routing, group
):
    """`step.response_logprobs` on packed rows: (log π [B, T], entropy [B, T], routing
    [M, B, L, X]) in the rollout's layout, 0 at padding (the unpacked pass leaves finite,
    meaningless values there; every consumer masks them)."""
    cfg = step_config.model
    B, L = tokens_BL.shape
    P = L - response_len
    length = pack_length(step_config, L)
    rows = step_config.pack_rows or B
    lay = layout(tokens_BL, attention_mask_BL, P, group=group, rows=rows, length=length)
    flat = rows * length
    routing_in = None
    if routing is not None:
        M, X = routing.shape[0], routing.shape[-1]
        routing_in = jnp.zeros((M, flat, X), routing.dtype)
        routing_in = routing_in.at[:, lay.dst_BL.ravel()].set(
            routing.reshape(M, B * L, X), mode="drop"
        )
        routing_in = routing_in.reshape(M, rows, length, X)
    hidden_RLD, routing_RL = models.hidden_states_packed(
        cfg,
        params,
        lay.tokens_RL,
        lay.positions_RL,
        lay.segment_RL,
        lay.member_RL,
        routing=routing_in,
    )
    M, X = routing_RL.shape[0], routing_RL.shape[-1]
    routing_out = jnp.take(
        routing_RL.reshape(M, flat, X), lay.dst_BL, axis=1, mode="fill", fill_value=0
    )
    # Response token t ≥ 1 is predicted by response token t − 1's packed slot (one target
    # each); token 0 by its prompt's last slot, which shared prompts hold once.
    targets_BT = tokens_BL[:, P:]
    pred_BT = lay.dst_BL[:, P - 1 : L - 1]
    valid_BT = attention_mask_BL[:, P:].astype(bool) & (lay.dst_BL[:, P:] < flat)
    pred_rest = jnp.where(valid_BT[:, 1:], pred_BT[:, 1:], flat)
    targets_RL = (
        jnp.zeros(flat, jnp.int32)
        .at[pred_rest.ravel()]
        .set(targets_BT[:, 1:].astype(jnp.int32).ravel(), mode="drop")
    )
    unembed = models.unembedding(cfg, params)
    kwargs = {"temperature": step_config.temperature, "return_entropy": True}
    logp_RL, ent_RL = logprobs_lib.token_logprobs(
        hidden_RLD,
        unembed,
        targets_RL.reshape(rows, length),
        chunk_size=step_config.logprob_chunk_size * partition.row_shards(rows),
        **kwargs,
    )
    D = hidden_RLD.shape[-1]
    first_BD = _take(hidden_RLD.reshape(flat, D), pred_BT[:, 0])
    logp_B1, ent_B1 = logprobs_lib.token_logprobs(
        first_BD[:, None], unembed, targets_BT[:, :1], chunk_size=B, **kwargs
    )
    logp_BT = jnp.concatenate([logp_B1, _take(logp_RL.reshape(flat), pred_BT[:, 1:])], 1)
    ent_BT = jnp.concatenate([ent_B1, _take(ent_RL.reshape(flat), pred_BT[:, 1:])], 1)
    zero = jnp.zeros((), logp_BT.dtype)
    return jnp.where(valid_BT, logp_BT, zero), jnp.where(valid_BT, ent_BT, zero), routing_out


def check_contiguous(attention_mask_BL, prompt_len: int):
    """True when every row's prompt is left padded and its response right padded."""
    prompt_B, response_B = _lengths(attention_mask_BL, prompt_len)
    L = attention_mask_BL.shape[1]
    col_L = jnp.arange(L)[None]
    want = jnp.where(
        col_L < prompt_len,
        col_L >= prompt_len - prompt_B[:, None],
        col_L - prompt_len < response_B[:, None],
    )
    return jnp.all(want == attention_mask_BL.astype(bool))


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def rows_needed(step_config, attention_mask_BL, response_len: int, splits: int, group: int):
    """(the most packed rows any of the batch's `splits` strided micro-batches uses, whether
    every row's real tokens are contiguous): `layout`'s placement with room for one
    segment per row, so a step given R ≥ this places every row the same way."""
    L = attention_mask_BL.shape[1]
    P = L - response_len
    length = pack_length(step_config, L)
    parts = strided_split(attention_mask_BL, splits)

    def count(mask_BL):
        prompt_B, response_B = _lengths(mask_BL, P)
        _, used = _place(prompt_B, response_B, group=group, rows=mask_BL.shape[0], length=length)
        return used

    return jnp.max(jax.vmap(count)(parts)), check_contiguous(attention_mask_BL, P)


def bucket_sizes(micro_rows: int, shards: int = 1) -> list[int]:
    """The packed-row counts a step may compile for, ascending: micro_rows · 2^(−k/8) rounded
    up (eight per halving: each within one row of 9 % above the next smaller), as multiples of `shards`
    (the devices the rows are split over) when those divide the micro-batch."""
    step = shards if micro_rows % shards == 0 else 1
    sizes, k = set(), 0
    while True:
        size = -(-math.ceil(micro_rows * 2 ** (-k / PER_OCTAVE) - 1e-9) // step) * step
        sizes.add(size)
        if size <= step:
            return sorted(sizes)
        k += 1


def bucket_rows(needed: int, micro_rows: int, shards: int = 1) -> int:
    """The packed-row count a step compiles for: the smallest `bucket_sizes` at least
    `needed` (never above micro_rows: each rollout row fits a packed row alone)."""
    return next(s for s in bucket_sizes(micro_rows, shards) if s >= min(needed, micro_rows))


__all__ = [
    "PER_OCTAVE",
    "Layout",
    "bucket_rows",
    "bucket_sizes",
    "check_contiguous",
    "layout",
    "pack_length",
    "packed_response_logprobs",
    "rows_needed",
]
