"""Decode attention over int8 KV pages with per-token scales: a Pallas TPU kernel of our own.

Why: jax's Pallas `ragged_paged_attention` (the pinned version) takes one static float
scale for all keys and one for all values, so an `Int8Pages` pool had to be dequantised to
bf16 before it: the pool's memory halved, the bytes a decode step reads did not. This
kernel reads the int8 pages and their f32 scales straight from HBM and dequantises in VMEM
(by folding the scales into the arithmetic, as `paged.ragged_paged_attention`, its XLA twin,
does): per context position it reads 2 x C bytes of int8 key and value per kv head and two
f32 scales, against 4 x C bytes of a bf16 pool.

Layout it reads (`Int8Pages`, stored so: every per-page, per-head slice is whole TPU tiles):

    q      int8 [num_pages, 2K, page_size, C]   keys of kv head k at combined head 2k,
                                                values at 2k + 1
    scale  f32  [num_pages, 2K, page_size]      one per token and combined head

Grid (S rows, K kv heads), run in order; step (s, k) takes the R = H/K query heads of kv
head k of row s together ([R, C]) and loops over its context in blocks of
`pages_per_block` pages up to kv_lens[s] (scalar-prefetched with the page table), each
block's pages copied from HBM by async DMA into a double buffer: block b + 1's copies start
before block b is computed, and a step's last block starts the next step's first (when
that row has a context: an idle row, kv_len 0, breaks the chain for the step after it).
Per page, in f32: scores = (q · k_q) · k_scale · sm_scale, masked past kv_len; an online
softmax (running max m, sum l); acc += (p · v_scale) · v_q; out = acc / l (0 for a row
with kv_len 0). Keys/values are converted int8 -> f32 exactly; q·k_q runs in q's dtype
(int8 is exact in bf16) with f32 accumulation; the p·v product in f32.

The same kernel, `int8_partial_attention`, serves the shared-prefix attention
(`paged_prefix`): a grid step's page list may start at a later page (a row's first own
page), its Q query rows may stop at limits of their own (a prompt's G·R member rows, each
at its kv_len), and it returns the unnormalised (acc, m, l) for the caller to merge.

Shape letters: S rows, H query heads, K kv heads, R = H/K, C head dim, M page-table width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
MASK_VALUE = -0.7 * float(jnp.finfo(F32).max)  # as paged.MASK_VALUE (the Pallas kernels')
KEYS_PER_BLOCK = 512  # default block: 512 context positions per DMA batch
LANES = 128  # per-row limits and partial statistics fill whole 128-lane rows


def default_pages_per_block(page_size: int, table_width: int) -> int:
    """Pages per block: about `KEYS_PER_BLOCK` positions, at most the page table's width."""
    return max(1, min(table_width, KEYS_PER_BLOCK // page_size))


def _copies(table_ref, q_hbm, s_hbm, q_buf, s_buf, sem, row, head, block, slot, bp, cols):
    """The async copies of block `block` of row `row`, kv head `head`, into buffer `slot`:
    per page its keys and values [2, ps, C] and their scales [2, ps]. `cols`: the row's
    (first, end) page-table columns; pages past the end read page 0: in the buffer, never
    used (masked)."""
    M = table_ref.shape[1]
    first, end = cols
    out = []
    for i in range(bp):
        j = first + block * bp + i
        page = table_ref[row, jnp.minimum(j, M - 1)]
        page = jnp.where(j < end, page, 0)
        heads = pl.ds(2 * head, 2)
        out.append(pltpu.make_async_copy(q_hbm.at[page, heads], q_buf.at[slot, i], sem.at[slot]))
        out.append(pltpu.make_async_copy(s_hbm.at[page, heads], s_buf.at[slot, i], sem.at[slot]))
    return out


def _page_update(carry, q_RC, kv_q, kv_s, start, kv_len, sm_scale):
    """One page's online-softmax update of (m [R, 1], l [R, 1], acc [R, C]): keys and
    values kv_q [2, ps, C] int8, their scales kv_s [2, ps] f32, context positions from
    `start`, live below `kv_len` (a scalar, or [R, 1]: one limit per query row)."""
    m, l, acc = carry
    k = kv_q[0].astype(F32).astype(q_RC.dtype)
    scores = jnp.einsum("rc,pc->rp", q_RC, k, preferred_element_type=F32)
    scores = scores * kv_s[0:1, :] * sm_scale
    pos = start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    live = pos < kv_len
    scores = jnp.where(live, scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(live, jnp.exp(scores - m_new), 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    v = kv_q[1].astype(F32)
    acc = alpha * acc + jnp.dot(p * kv_s[1:2, :], v, preferred_element_type=F32)
    return m_new, l, acc


def _blocks(lens_ref, start_ref, row, ps: int, bp: int):
    """(blocks, (first, end)) of row `row`'s context: page-table columns start / ps to
    ⌈kv_len / ps⌉, in ⌈(end − first) / bp⌉ blocks. lax.div, not //: floor division lowers
    through sign(), which asks the runtime's device kind (not the target's when compiling
    ahead of time); both operands are >= 0."""
    first = jax.lax.div(start_ref[row], ps)
    end = jax.lax.div(lens_ref[row] + ps - 1, ps)
    return jax.lax.div(jnp.maximum(end - first, 0) + bp - 1, bp), (first, end)


def _kernel(
    lens_ref, start_ref, table_ref, q_ref, lim_ref, q_hbm, s_hbm, *refs, sm_scale, bp, partial,
):  # fmt: skip
    """Grid step (row s, kv head k): the Q query rows of kv head k over row s's context
    from position start[s] to lens[s] (query row r to its own limit lim[s, r] <= lens[s]).
    The grid runs in order; the last block of a step starts the copies of the next step's
    first block (when that row has a context), so a step's first copy is hidden too.
    `slot_ref` (SMEM) carries the buffer slot of the next step's first block. `partial`:
    the outputs are (acc, m, l), not acc / l."""
    outs, (q_buf, s_buf, sem, slot_ref) = refs[: 3 if partial else 1], refs[-4:]
    row, head = pl.program_id(0), pl.program_id(1)
    num_heads = pl.num_programs(1)
    step = row * num_heads + head
    ps = q_buf.shape[3]
    blocks, cols = _blocks(lens_ref, start_ref, row, ps, bp)
    refs = (table_ref, q_hbm, s_hbm, q_buf, s_buf, sem)
    # The next grid step's row and head, and whether its first block is ours to prefetch.
    next_head = jax.lax.rem(head + 1, num_heads)
    next_row = jnp.where(next_head == 0, row + 1, row)
    has_next = next_row < pl.num_programs(0)
    last_row = pl.num_programs(0) - 1
    next_blocks, next_cols = _blocks(lens_ref, start_ref, jnp.minimum(next_row, last_row), ps, bp)
    prefetch_next = jnp.logical_and(has_next, next_blocks > 0)
    prev_row = jnp.where(head == 0, row - 1, row)
    prev_blocks = _blocks(lens_ref, start_ref, jnp.maximum(prev_row, 0), ps, bp)[0]
    prefetched = jnp.logical_and(step > 0, prev_blocks > 0)

    @pl.when(step == 0)
    def _init():
        slot_ref[0] = 0

    @pl.when(blocks == 0)
    def _empty():
        for ref, value in zip(outs, (0.0, MASK_VALUE, 0.0)):
            ref[...] = jnp.full(ref.shape, value, ref.dtype)

    @pl.when(blocks > 0)
    def _attend():
        first = slot_ref[0]

        @pl.when(jnp.logical_not(prefetched))
        def _start():
            for c in _copies(*refs, row, head, 0, first, bp, cols):
                c.start()

        q_RC = q_ref[...]
        lim_R1 = lim_ref[...][:, :1]
        R, C = q_RC.shape

        def block(b, carry):
            slot = jax.lax.rem(first + b, 2)

            @pl.when(b + 1 < blocks)
            def _prefetch():
                for c in _copies(*refs, row, head, b + 1, 1 - slot, bp, cols):
                    c.start()

            @pl.when(jnp.logical_and(b + 1 == blocks, prefetch_next))
            def _prefetch_next_step():
                for c in _copies(*refs, next_row, next_head, 0, 1 - slot, bp, next_cols):
                    c.start()

            for c in _copies(*refs, row, head, b, slot, bp, cols):
                c.wait()
            for i in range(bp):
                start = (cols[0] + b * bp + i) * ps
                args = (q_RC, q_buf[slot, i], s_buf[slot, i], start, lim_R1, sm_scale)
                carry = _page_update(carry, *args)
            return carry

        init = (jnp.full((R, 1), -jnp.inf, F32), jnp.zeros((R, 1), F32), jnp.zeros((R, C), F32))
        m, l, acc = jax.lax.fori_loop(0, blocks, block, init)
        if partial:
            outs[0][...] = acc
            outs[1][...] = jnp.broadcast_to(m, outs[1].shape)
            outs[2][...] = jnp.broadcast_to(l, outs[2].shape)
        else:
            outs[0][...] = (acc / l).astype(outs[0].dtype)
        slot_ref[0] = jax.lax.rem(first + blocks, 2)


def int8_paged_attention(
    q_SHC, q_pages, scale_pages, kv_lens_S, page_table_SM, *, sm_scale,
    pages_per_block=None, interpret=False,
):  # fmt: skip
    """One query per row over its int8 paged context: out[s, h] = Σ_i softmax_i(q[s,h] ·
    k_i · sm_scale) v_i over positions i < kv_lens[s], k_i = k_q,i · k_scale_i (kv head
    h // R), likewise v. `q_pages` int8 [num_pages, 2K, page_size, C], `scale_pages` f32
    [num_pages, 2K, page_size] (`paged.Int8Pages`' fields). Returns [S, H, C] in q's
    dtype. `interpret`: run the kernel in Pallas' TPU interpreter (CPU tests)."""
    S, H, C = q_SHC.shape
    K = _check(H, q_pages, scale_pages)
    lens_S = kv_lens_S.astype(jnp.int32)
    lim_SR = jnp.broadcast_to(lens_S[:, None], (S, H // K))
    args = (q_SHC.reshape(S, K, H // K, C), q_pages, scale_pages, lens_S, jnp.zeros_like(lens_S))
    opts = {"sm_scale": sm_scale, "pages_per_block": pages_per_block, "interpret": interpret}
    out = _call(*args, page_table_SM, lim_SR, partial=False, **opts)
    return out.reshape(S, H, C)


def int8_partial_attention(
    q_XKQC, q_pages, scale_pages, lens_X, start_X, table_XM, lim_XQ, *, sm_scale,
    pages_per_block=None, interpret=False,
):  # fmt: skip
    """The unnormalised softmax of X page lists, Q query rows per kv head each: query row
    (x, k, r) over positions start[x] <= i < lim[x, r] of list x (position i in page
    table[x, i // page_size]; start a multiple of page_size, lim <= lens[x], the list's
    end), keys and values of kv head k. Returns (acc [X, K, Q, C] f32 = Σ_i e^(s_i − m) v_i,
    m [X, K, Q] = max_i s_i, l [X, K, Q] = Σ_i e^(s_i − m)) with s_i = q · k_i · sm_scale:
    the pieces `paged_prefix` merges (acc 0, m MASK_VALUE, l 0 where nothing is read)."""
    K = _check(q_XKQC.shape[1] * q_XKQC.shape[2], q_pages, scale_pages)
    if q_XKQC.shape[1] != K:
        raise ValueError(
            f"int8 partial attention: queries of {q_XKQC.shape[1]} kv heads, {K} in the pages"
        )
    opts = {"sm_scale": sm_scale, "pages_per_block": pages_per_block, "interpret": interpret}
    args = (q_XKQC, q_pages, scale_pages, lens_X.astype(jnp.int32), start_X.astype(jnp.int32))
    acc, m, l = _call(*args, table_XM, lim_XQ.astype(jnp.int32), partial=True, **opts)
    return acc, m[..., 0], l[..., 0]


def _check(H, q_pages, scale_pages) -> int:
    """The pool's kv heads K, checked against H query heads and the scales' shape."""
    K2 = q_pages.shape[1]
    K = K2 // 2
    if H % K or K2 % 2:
        raise ValueError(f"int8 paged attention: {H} query heads over {K2 // 2} kv heads")
    if scale_pages.shape != q_pages.shape[:3]:
        raise ValueError(
            f"int8 paged attention: scales {scale_pages.shape} for pages {q_pages.shape}"
        )
    return K


def _call(
    q_XKQC, q_pages, scale_pages, lens_X, start_X, table_XM, lim_XQ, *, sm_scale,
    pages_per_block, interpret, partial,
):  # fmt: skip
    """The kernel over grid (X, K): scalar-prefetched lens, starts and page table; the
    queries and per-row limits (lanes: 128 copies) as blocks; the pool in HBM."""
    X, K, Q, C = q_XKQC.shape
    ps = q_pages.shape[2]
    bp = int(pages_per_block or default_pages_per_block(ps, table_XM.shape[1]))
    spec = pl.BlockSpec((None, None, Q, C), lambda x, k, *_: (x, k, 0, 0))
    lanes = pl.BlockSpec((None, None, Q, LANES), lambda x, k, *_: (x, k, 0, 0))
    lim_spec = pl.BlockSpec((None, Q, LANES), lambda x, k, *_: (x, 0, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    acc = jax.ShapeDtypeStruct((X, K, Q, C), F32 if partial else q_XKQC.dtype)
    stat = jax.ShapeDtypeStruct((X, K, Q, LANES), F32)
    call = pl.pallas_call(
        functools.partial(_kernel, sm_scale=float(sm_scale), bp=bp, partial=partial),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(X, K),
            in_specs=[spec, lim_spec, any_space, any_space],
            out_specs=[spec, lanes, lanes] if partial else spec,
            scratch_shapes=[
                pltpu.VMEM((2, bp, 2, ps, C), q_pages.dtype),
                pltpu.VMEM((2, bp, 2, ps), scale_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),  # the buffer slot of the next step's first block
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        out_shape=[acc, stat, stat] if partial else acc,
        interpret=pltpu.InterpretParams() if interpret else False,
        name="int8_paged_attention_partial" if partial else "int8_paged_attention",
    )
    lim = jnp.broadcast_to(lim_XQ[..., None], (*lim_XQ.shape, LANES))
    return call(lens_X, start_X, table_XM.astype(jnp.int32), q_XKQC, lim, q_pages, scale_pages)


__all__ = [
    "KEYS_PER_BLOCK",
    "default_pages_per_block",
    "int8_paged_attention",
    "int8_partial_attention",
]
