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


def default_pages_per_block(page_size: int, table_width: int) -> int:
    """Pages per block: about `KEYS_PER_BLOCK` positions, at most the page table's width."""
    return max(1, min(table_width, KEYS_PER_BLOCK // page_size))


def _copies(table_ref, q_hbm, s_hbm, q_buf, s_buf, sem, row, head, block, slot, bp, end):
    """The async copies of block `block` of row `row`, kv head `head`, into buffer `slot`:
    per page its keys and values [2, ps, C] and their scales [2, ps]. Pages past the
    row's last (`end`) read page 0: in the buffer, never used (masked)."""
    M = table_ref.shape[1]
    out = []
    for i in range(bp):
        j = block * bp + i
        page = table_ref[row, jnp.minimum(j, M - 1)]
        page = jnp.where(j < end, page, 0)
        heads = pl.ds(2 * head, 2)
        out.append(pltpu.make_async_copy(q_hbm.at[page, heads], q_buf.at[slot, i], sem.at[slot]))
        out.append(pltpu.make_async_copy(s_hbm.at[page, heads], s_buf.at[slot, i], sem.at[slot]))
    return out


def _page_update(carry, q_RC, kv_q, kv_s, start, kv_len, sm_scale):
    """One page's online-softmax update of (m [R, 1], l [R, 1], acc [R, C]): keys and
    values kv_q [2, ps, C] int8, their scales kv_s [2, ps] f32, context positions from
    `start`."""
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


def _blocks(lens_ref, row, ps: int, bp: int):
    """(blocks, pages) of row `row`'s context: ⌈kv_len / (bp · ps)⌉ and ⌈kv_len / ps⌉.
    lax.div, not //: floor division lowers through sign(), which asks the runtime's device
    kind (not the target's when compiling ahead of time); both operands are >= 0."""
    kv_len = lens_ref[row]
    return jax.lax.div(kv_len + bp * ps - 1, bp * ps), jax.lax.div(kv_len + ps - 1, ps)


def _kernel(
    lens_ref, table_ref, q_ref, q_hbm, s_hbm, o_ref, q_buf, s_buf, sem, slot_ref, *,
    sm_scale, bp,
):  # fmt: skip
    """Grid step (row s, kv head k): the R query heads of kv head k over row s's context.
    The grid runs in order; the last block of a step starts the copies of the next step's
    first block (when that row has a context), so a step's first copy is hidden too.
    `slot_ref` (SMEM) carries the buffer slot of the next step's first block."""
    row, head = pl.program_id(0), pl.program_id(1)
    num_heads = pl.num_programs(1)
    step = row * num_heads + head
    ps = q_buf.shape[3]
    kv_len = lens_ref[row]
    blocks, end = _blocks(lens_ref, row, ps, bp)
    refs = (table_ref, q_hbm, s_hbm, q_buf, s_buf, sem)
    # The next grid step's row and head, and whether its first block is ours to prefetch.
    next_head = jax.lax.rem(head + 1, num_heads)
    next_row = jnp.where(next_head == 0, row + 1, row)
    has_next = next_row < pl.num_programs(0)
    next_blocks, next_end = _blocks(lens_ref, jnp.minimum(next_row, pl.num_programs(0) - 1), ps, bp)
    prefetch_next = jnp.logical_and(has_next, next_blocks > 0)
    prev_row = jnp.where(head == 0, row - 1, row)
    prefetched = jnp.logical_and(
        step > 0, _blocks(lens_ref, jnp.maximum(prev_row, 0), ps, bp)[0] > 0
    )

    @pl.when(step == 0)
    def _init():
        slot_ref[0] = 0

    @pl.when(blocks == 0)
    def _empty():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(blocks > 0)
    def _attend():
        first = slot_ref[0]

        @pl.when(jnp.logical_not(prefetched))
        def _start():
            for c in _copies(*refs, row, head, 0, first, bp, end):
                c.start()

        q_RC = q_ref[...]
        R, C = q_RC.shape

        def block(b, carry):
            slot = jax.lax.rem(first + b, 2)

            @pl.when(b + 1 < blocks)
            def _prefetch():
                for c in _copies(*refs, row, head, b + 1, 1 - slot, bp, end):
                    c.start()

            @pl.when(jnp.logical_and(b + 1 == blocks, prefetch_next))
            def _prefetch_next_step():
                for c in _copies(*refs, next_row, next_head, 0, 1 - slot, bp, next_end):
                    c.start()

            for c in _copies(*refs, row, head, b, slot, bp, end):
                c.wait()
            for i in range(bp):
                start = (b * bp + i) * ps
                args = (q_RC, q_buf[slot, i], s_buf[slot, i], start, kv_len, sm_scale)
                carry = _page_update(carry, *args)
            return carry

        init = (jnp.full((R, 1), -jnp.inf, F32), jnp.zeros((R, 1), F32), jnp.zeros((R, C), F32))
        _, l, acc = jax.lax.fori_loop(0, blocks, block, init)
        o_ref[...] = (acc / l).astype(o_ref.dtype)
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
    _, K2, ps, _ = q_pages.shape
    K = K2 // 2
    if H % K or K2 % 2:
        raise ValueError(f"int8 paged attention: {H} query heads over {K2 // 2} kv heads")
    if scale_pages.shape != q_pages.shape[:3]:
        raise ValueError(
            f"int8 paged attention: scales {scale_pages.shape} for pages {q_pages.shape}"
        )
    R = H // K
    M = page_table_SM.shape[1]
    bp = int(pages_per_block or default_pages_per_block(ps, M))
    spec = pl.BlockSpec((None, None, R, C), lambda s, k, *_: (s, k, 0, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(_kernel, sm_scale=float(sm_scale), bp=bp),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(S, K),
            in_specs=[spec, any_space, any_space],
            out_specs=spec,
            scratch_shapes=[
                pltpu.VMEM((2, bp, 2, ps, C), q_pages.dtype),
                pltpu.VMEM((2, bp, 2, ps), scale_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),  # the buffer slot of the next step's first block
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct((S, K, R, C), q_SHC.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="int8_paged_attention",
    )
    out = call(
        kv_lens_S.astype(jnp.int32),
        page_table_SM.astype(jnp.int32),
        q_SHC.reshape(S, K, R, C),
        q_pages,
        scale_pages,
    )
    return out.reshape(S, H, C)


__all__ = ["KEYS_PER_BLOCK", "default_pages_per_block", "int8_paged_attention"]
