"""Paged KV cache and ragged paged attention: the decode arithmetic of the continuous sampler.

Where it sits: `sampling/continuous.py` keeps every layer's keys/values in one page pool
and calls `prompt_pages` once (the prefilled prompts, written into pages) and
`decode_step_paged` inside its `lax.while_loop`. The step runs the one `decoder.Decoder`
composition, unrolled over layers, with `_PagedAttention` as its attention context (as
kv_cache.py's `_CacheAttention`; nothing here re-states the block).

Layout (that of jax's Pallas kernel `jax.experimental.pallas.ops.tpu.ragged_paged_attention`,
so the TPU path hands the pool to the kernel as it is):

    kv pages   per layer [num_pages, page_size, 2K, C]: keys at combined head 2k, values
               at 2k + 1 (kv head k)
    page table int32 [S, M]: row s's m-th page; context position i of row s lives in page
               table[s, i // page_size] at offset i % page_size
    kv_lens    int32 [S]: context positions 0 .. kv_len − 1 of row s are real

KV dtype (`kv_dtype`, `KV_DTYPES`): pages in a float dtype, or `Int8Pages`: int8 pages
with one f32 scale per token and combined head, absmax quantisation x ≈ q · scale, scale =
max_c |x_c| / 127, so every element is within scale/2 of its value (`quantize_int8`;
tests/sampling/test_sampling_continuous.py derives the bound). An int8 pool is stored head
major, q [num_pages, 2K, page_size, C] and scale [num_pages, 2K, page_size], so that a
page's keys, values and scales of one kv head are whole TPU tiles (its `shape` is still the
float pool's). The XLA path folds the scales into the arithmetic (key scales multiply the
scores, value scales the probabilities) and never materialises dequantised pages; on TPU
the pool goes to our own Pallas kernel (`paged_int8_kernel.int8_paged_attention`), which
reads the int8 pages and their scales from HBM and does the same in VMEM: a decode step
reads about half a bf16 pool's bytes. (jax's kernel of the pinned version takes one
static scale for all keys and one for all values, not per-token scales.) The kernel's
scales fill whole 128-lane rows when page_size is a multiple of 128; smaller pages can make
XLA relay them out (a padded copy, seen with 16 combined heads per chip) on the way in.

A row's context is its prompt's real tokens (left padding dropped, position 0 first) then
its own response tokens; a group's G rows share the pages of their prompt (the table
entries point at the same pages), and only a prompt's partly filled last page is copied
into a page of the row's own (the row writes after it). `paged_prefix.SharedPrefix` reads
those shared pages once per prompt for all its rows (the decode step's `prefix`).

`ragged_paged_attention` (the XLA implementation; CPU / GPU and the tests) gives one query
per row the kernel's result: softmax(q·kᵀ·scale over positions < kv_len) · v with kv head
h // R for query head h. It reads the pages in blocks, in `lax.while_loop`s that stop at
the longest row's kv_len, so a step reads the real context of its rows, not every row's
full capacity (twice: one pass for the softmax statistics, one for the output, to keep the
trainer's arithmetic; see the function). `paged_attention` picks the Pallas kernels when
compiling for a TPU (`paged_attention_impl`): jax's for a float pool, ours for an int8 one.

Shape letters: S decode rows (slots), M page-table width, N prompts, P prompt slots, K kv
heads, C head dim, H query heads, R = H/K, W key positions of one block, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from gspo_jax.models import partition
from gspo_jax.models.attention import target_platform
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.functional import logits_from_hidden
from gspo_jax.models.kv_cache import kind_index
from gspo_jax.models.paged_int8_kernel import int8_paged_attention
from gspo_jax.models.params import merge

F32 = jnp.float32
MASK_VALUE = -0.7 * float(jnp.finfo(F32).max)  # the Pallas kernel's DEFAULT_MASK_VALUE
PAGED_IMPLS = ("xla", "pallas")
KV_DTYPES = ("auto", "bfloat16", "float32", "int8")  # "auto": the model's compute dtype
INT8_MAX = 127.0


@struct.dataclass
class Int8Pages:
    """A page pool stored in int8, head major: element [p, o, h, c] of the float pool it
    stands for ≈ q[p, h, o, c] · scale[p, h, o].

    q      int8 [num_pages, 2K, page_size, C]   a page's tokens of one combined head
                                                contiguous (whole TPU tiles)
    scale  f32 [num_pages, 2K, page_size]       one per token and combined head (keys and
                                                values of a kv head scaled apart)

    `shape` is the float pool's, [num_pages, page_size, 2K, C]."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        P, K2, ps, C = self.q.shape
        return (P, ps, K2, C)

    @property
    def dtype(self):
        return self.q.dtype


def quantize_int8(x_xC):
    """(q int8 [..., C], scale f32 [...]): absmax over the last axis, scale = absmax / 127,
    q = round(x / scale) (0 where the vector is 0). |q·scale − x| ≤ scale/2 up to f32
    rounding: with u = 2⁻²⁴, y = fl(x/scale) = (x/scale)(1 + δ₁), q = round(y), fl(q·scale)
    = q·scale(1 + δ₂) give |error| ≤ scale/2 + u(|x| + 127·scale) ≤ scale·(1/2 + 254u)."""
    x = x_xC.astype(F32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize(pool, dtype):
    """The pool's values in `dtype` (a float pool is cast; `Int8Pages` multiplied out)."""
    if isinstance(pool, Int8Pages):
        x = pool.q.astype(F32) * pool.scale[..., None]
        return x.transpose(0, 2, 1, 3).astype(dtype)
    return pool.astype(dtype)


def to_kv_dtype(pages, kv_dtype: str):
    """Float pages [..., 2K, C] in the pool's storage: `Int8Pages` for "int8", else the float
    dtype (`KV_DTYPES`; "auto" keeps the pages' own)."""
    if kv_dtype == "int8":
        q, scale = quantize_int8(pages)
        return Int8Pages(q.transpose(0, 2, 1, 3), scale.transpose(0, 2, 1))
    if kv_dtype == "auto":
        return pages
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected one of {KV_DTYPES}")
    return pages.astype(kv_dtype)


def paged_attention_impl(
    attention_impl: str,
    platform: str | None = None,
    head_dim: int | None = None,
    kv_dtype: str | None = None,
) -> str:
    """ "pallas" when compiling for a TPU and `attention_impl` is "auto" or "splash" (the
    Pallas kernels), "xla" otherwise, and also for a `head_dim` the kernel cannot take:
    jax's (a float pool) loads keys and values in 128-lane rows, so 128 only (the tiny
    test models' 16 is not; Qwen3.5's 256 fails in Mosaic, "The last dim size is not
    128", compiled for v5e with the pinned jax); ours (`kv_dtype` "int8",
    `int8_paged_attention`) takes whole 128-lane rows, so 128 and 256 (both compiled for
    v5e)."""
    platform = platform or target_platform()
    kernel_dims = (128, 256) if kv_dtype == "int8" else (128,)
    if head_dim is not None and head_dim not in kernel_dims:
        return "xla"
    if platform == "tpu" and attention_impl in ("auto", "splash"):
        return "pallas"
    return "xla"


def _block_half(table, pool_5, scale_4, start, bp: int, which: int, shape):
    """Keys (which 0) or values (1) [S, W, K, C] of the block of `bp` pages from page-table
    column `start`, and for an int8 pool their scales transposed to [S, K, 1, W] (else None).
    A float pool comes as [pages, page_size, K, 2, C]; an int8 one head major, q [pages,
    K, 2, page_size, C] and scales [pages, K, 2, page_size]."""
    S, W, K, C = shape
    pages_Sb = jax.lax.dynamic_slice_in_dim(table, start, bp, axis=1)
    if scale_4 is None:
        return pool_5[pages_Sb, :, :, which].reshape(S, W, K, C), None
    x_SbKpC = pool_5[pages_Sb, :, which]
    x_SWKC = x_SbKpC.transpose(0, 1, 3, 2, 4).reshape(S, W, K, C)
    scale_SKW = scale_4[pages_Sb, :, which].transpose(0, 2, 1, 3).reshape(S, K, W)
    return x_SWKC, scale_SKW[:, :, None, :]


def _split_kv(pool):
    """(pool [pages, page_size, K, 2, C], None), or for an `Int8Pages` pool (q [pages, K, 2,
    page_size, C], scales [pages, K, 2, page_size]): kv head k's keys / values at index 0 / 1
    of their own axis."""
    P, ps, K2, C = pool.shape
    if isinstance(pool, Int8Pages):
        return pool.q.reshape(P, K2 // 2, 2, ps, C), pool.scale.reshape(P, K2 // 2, 2, ps)
    return pool.reshape(P, ps, K2 // 2, 2, C), None


def ragged_paged_attention(
    q_SHC, kv_pages, kv_lens_S, page_table_SM, *, sm_scale, block_pages=8, split_S=None
):
    """One query per row over its paged context (XLA; the Pallas kernel's semantics for
    decode, cu_q_lens = 0, 1, …, S): out[s, h] = Σ_i softmax_i(q[s,h]·k_i·sm_scale) v_i over
    the row's positions i < kv_lens[s], k_i / v_i of kv head h // R. Returns [S, H, C] in
    q's dtype.

    Two while_loops over blocks of `block_pages` pages, up to the longest row only (rows
    shorter than a block mask the rest): the first (`score_pass`) reads each block's keys,
    keeps its scores and finds each row's score maximum and softmax denominator (f32); the
    second (`value_pass`) reads the values and multiplies them by the normalised
    probabilities cast to the compute (q's) dtype — the arithmetic of `attention.attend`
    (what the trainer recomputes log-probs with) and of the static engine's `attend_cached`,
    also when the pool is stored in another float dtype; an `Int8Pages` pool: its scales
    multiply the scores and the probabilities, the int8 keys and values converted exactly —
    so that in bf16 the sampler's log-probs stay as close to the trainer's as the dense
    cache's; a context within one block gives `attend`'s numbers exactly up to the order of
    the additions. Each page's keys and values are read once (the scores of the context,
    [S, H, M · page_size] f32, are kept between the loops). `split_S` (int32 [S],
    optional): positions before it (the prompt) and from it (the response) are multiplied
    by the values separately and the two outputs added in the value dtype, as the trainer's
    shared-prompt attention (`attention.attend_shared_prompt`) does."""
    S, H, C = q_SHC.shape
    K = kv_pages.shape[2] // 2
    q_SKRC = q_SHC.reshape(S, K, H // K, C)
    lim_SR = jnp.broadcast_to(kv_lens_S.astype(jnp.int32)[:, None], (S, H // K))
    split_SR = None if split_S is None else jnp.broadcast_to(split_S[:, None], lim_SR.shape)
    passes = (kv_pages, page_table_SM, lim_SR, block_pages)
    m_SKR, l_SKR, s_all = score_pass(q_SKRC, *passes, sm_scale=sm_scale)
    l_SKR = jnp.where(l_SKR > 0, l_SKR, 1.0)  # no block read (every kv_len 0): output 0
    acc_SKRC = value_pass(s_all, m_SKR, l_SKR, *passes, split_SR, q_SHC.dtype)
    return acc_SKRC.reshape(S, H, C).astype(q_SHC.dtype)


def _blocks_of(kv_pages, table_XM, lim_XQ, block_pages: int):
    """(pool halves (`_split_kv`), the table padded to whole blocks, pages per block, keys
    per block W, blocks to read: up to the longest query row's limit)."""
    page_size = kv_pages.shape[1]
    M = table_XM.shape[1]
    bp = max(1, min(int(block_pages), M))
    nb = -(-M // bp)
    table = jnp.pad(table_XM, ((0, 0), (0, nb * bp - M)))
    W = bp * page_size
    blocks = (jnp.max(lim_XQ) + W - 1) // W
    return _split_kv(kv_pages), table, bp, W, blocks


def score_pass(q_XKQC, kv_pages, table_XM, lim_XQ, block_pages: int, *, sm_scale):
    """The first of `ragged_paged_attention`'s loops, for X page lists of Q query rows per
    kv head (one row: Q = R; a prompt's rows together: Q = G·R): query row (x, q) attends
    to positions i < lim[x, q] of list x (position i in page table[x, i // page_size]).
    Returns (score maximum m [X, K, Q], softmax denominator l [X, K, Q], the scores
    [X, K, Q, nb · W] f32, MASK_VALUE where masked)."""
    X, K, Q, C = q_XKQC.shape
    (pool_5, scale_4), table, bp, W, blocks = _blocks_of(kv_pages, table_XM, lim_XQ, block_pages)
    lim_XQ = lim_XQ.astype(jnp.int32)

    def stats(carry):
        j, m_XKQ, l_XKQ, s_all = carry
        k_XWKC, k_scale = _block_half(table, pool_5, scale_4, j * bp, bp, 0, (X, W, K, C))
        s_XKQW = jnp.einsum(
            "xkqc,xwkc->xkqw", q_XKQC, k_XWKC.astype(q_XKQC.dtype), preferred_element_type=F32
        )
        if k_scale is not None:  # q·(k_q·scale) = (q·k_q)·scale: the scale after the product
            s_XKQW = s_XKQW * k_scale
        s_XKQW = s_XKQW * sm_scale
        live_XQW = (j * W + jnp.arange(W, dtype=jnp.int32))[None, None, :] < lim_XQ[..., None]
        s_XKQW = jnp.where(live_XQW[:, None], s_XKQW, MASK_VALUE)
        m_new = jnp.maximum(m_XKQ, jnp.max(s_XKQW, axis=-1))
        l_XKQ = l_XKQ * jnp.exp(m_XKQ - m_new) + jnp.sum(jnp.exp(s_XKQW - m_new[..., None]), -1)
        s_all = jax.lax.dynamic_update_slice_in_dim(s_all, s_XKQW, j * W, axis=3)
        return j + 1, m_new, l_XKQ, s_all

    shape = (X, K, Q)
    init = (
        jnp.zeros((), jnp.int32),
        jnp.full(shape, -jnp.inf, F32),
        jnp.zeros(shape, F32),
        jnp.zeros((*shape, table.shape[1] * kv_pages.shape[1]), F32),
    )
    _, m_XKQ, l_XKQ, s_all = jax.lax.while_loop(lambda c: c[0] < blocks, stats, init)
    return m_XKQ, l_XKQ, s_all


def value_pass(s_all, m_XKQ, l_XKQ, kv_pages, table_XM, lim_XQ, block_pages, split_XQ, dtype):
    """The second loop: Σ_i p_i v_i [X, K, Q, C] f32 over `score_pass`'s blocks, p =
    exp(s − m) / l cast to `dtype` (an int8 pool's value scales folded in first), each
    block's product in `dtype` then added in f32; `split_XQ` (optional): positions before
    it and from it multiplied apart and added in `dtype` (see `ragged_paged_attention`)."""
    X, K, Q, _ = s_all.shape
    C = kv_pages.shape[-1]
    (pool_5, scale_4), table, bp, W, blocks = _blocks_of(kv_pages, table_XM, lim_XQ, block_pages)

    def output(carry):
        j, acc_XKQC = carry
        s_XKQW = jax.lax.dynamic_slice_in_dim(s_all, j * W, W, axis=3)
        v_XWKC, v_scale = _block_half(table, pool_5, scale_4, j * bp, bp, 1, (X, W, K, C))
        p_XKQW = jnp.exp(s_XKQW - m_XKQ[..., None]) / l_XKQ[..., None]
        if v_scale is not None:  # Σ p·(v_q·scale) = Σ (p·scale)·v_q
            p_XKQW = p_XKQW * v_scale
        p_XKQW = p_XKQW.astype(dtype)
        v_XWKC = v_XWKC.astype(dtype)
        if split_XQ is None:
            o_XKQC = jnp.einsum("xkqw,xwkc->xkqc", p_XKQW, v_XWKC)
        else:
            pos_W = j * W + jnp.arange(W, dtype=jnp.int32)
            before = (pos_W[None, None, :] < split_XQ[..., None])[:, None]
            o_XKQC = jnp.einsum("xkqw,xwkc->xkqc", jnp.where(before, p_XKQW, 0), v_XWKC)
            o_XKQC = o_XKQC + jnp.einsum("xkqw,xwkc->xkqc", jnp.where(before, 0, p_XKQW), v_XWKC)
        return j + 1, acc_XKQC + o_XKQC.astype(F32)

    init = (jnp.zeros((), jnp.int32), jnp.zeros((X, K, Q, C), F32))
    return jax.lax.while_loop(lambda c: c[0] < blocks, output, init)[1]


def _pallas_paged_attention(q_SHC, kv_pages, kv_lens_S, page_table_SM, *, sm_scale):
    """jax's Pallas TPU kernel with one query per row (decode) for a float pool; an
    `Int8Pages` pool goes to ours (`int8_paged_attention`: the pinned kernel's k_scale /
    v_scale are one static float each, not per-token scales)."""
    if isinstance(kv_pages, Int8Pages):
        return int8_paged_attention(
            q_SHC, kv_pages.q, kv_pages.scale, kv_lens_S, page_table_SM, sm_scale=sm_scale
        )
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    S = q_SHC.shape[0]
    page_size, M = kv_pages.shape[1], page_table_SM.shape[1]
    # Block sizes given (the kernel's own lookup reads the runtime's devices, which are not
    # the target's when compiling ahead of time): ~512 keys per block, 32 queries.
    return ragged_paged_attention(
        q_SHC,
        kv_pages.astype(q_SHC.dtype),
        kv_lens_S.astype(jnp.int32),
        page_table_SM.astype(jnp.int32),
        jnp.arange(S + 1, dtype=jnp.int32),
        jnp.array([S], jnp.int32),
        sm_scale=sm_scale,
        num_kv_pages_per_block=max(1, min(M, 512 // page_size)),
        num_queries_per_block=min(32, S),
    )


def _per_chip_heads(fn, pool, heads_args, rest_args, out_is_pool: bool):
    """`fn(pool, *heads_args, *rest_args)` run by every chip on its own kv heads: the pool
    and `heads_args` (arrays with a head axis 1: query heads, or combined heads [S, 2K, ...])
    split over the heads as the rules split "kv_heads", `rest_args` whole; the result is a
    pool (`out_is_pool`) or [S, H, ...] split likewise. Manual over every axis GSPMD still
    partitions, size-1 ones too: XLA cannot partition a Mosaic kernel ("Mosaic kernels
    cannot be automatically partitioned"), and an int8 pool's row view (`_int8_rows_set`)
    merges its head axis with others, which GSPMD would all-gather. Without such axes (one
    chip, or a replica of the engine, every axis already manual) `fn` runs as it is."""
    mesh = partition.context_mesh()
    axes = () if mesh is None else partition.auto_axes(mesh)
    if not axes:
        return fn(pool, *heads_args, *rest_args)
    heads = partition.spec(mesh, ("kv_heads",), (pool.shape[2] // 2,))[0]
    P = jax.sharding.PartitionSpec
    if isinstance(pool, Int8Pages):  # head major
        pool_spec = Int8Pages(P(None, heads, None, None), P(None, heads, None))
    else:
        pool_spec = P(None, None, heads, None)
    specs = [P(None, heads, *[None] * (x.ndim - 2)) for x in heads_args]
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(pool_spec, *specs, *[P()] * len(rest_args)),
        out_specs=pool_spec if out_is_pool else specs[0],
        axis_names=frozenset(axes),
        check_vma=False,
    )(pool, *heads_args, *rest_args)


def paged_attention(
    impl: str, q_SHC, kv_pages, kv_lens_S, page_table_SM, *, sm_scale, split_S=None
):
    """`ragged_paged_attention` ("xla", with `split_S`) or a Pallas kernel ("pallas", one
    product over the whole context: jax's for a float pool, `int8_paged_attention` for an
    `Int8Pages` one), every chip on its own kv heads (and the query heads that read them),
    rows whole."""
    if impl == "pallas":

        def kernel(pool, q_SHC, kv_lens_S, page_table_SM):
            return _pallas_paged_attention(q_SHC, pool, kv_lens_S, page_table_SM, sm_scale=sm_scale)

        return _per_chip_heads(
            kernel, kv_pages, (q_SHC,), (kv_lens_S, page_table_SM), out_is_pool=False
        )
    if impl == "xla":
        return ragged_paged_attention(
            q_SHC, kv_pages, kv_lens_S, page_table_SM, sm_scale=sm_scale, split_S=split_S
        )
    raise ValueError(f"paged attention impl {impl!r}: expected one of {PAGED_IMPLS}")


def copy_pages(pool, src_S, dst_S):
    """`pool` [pages, page_size, 2K, C] with page dst_S[s] overwritten by page src_S[s].

    Written as token rows of [pages · page_size, 2K, C] (a bitcast), not as whole pages:
    with few kv heads per chip (the tensor rollout layout, 2K = 2) XLA:TPU lays a
    page-indexed scatter's pool out page-offset-minor, unlike the Pallas kernel's layout,
    and copied every pool out of and back into the kernel's layout on every decode step:
    two pool copies per layer in the engine's temporaries (v5e, Qwen3-0.6B widths; row
    writes leave the temporaries at the pools alone). An `Int8Pages` pool: as rows of its
    head-major layout, [pages · 2K · page_size, C] and its scales flat (a page is 2K ·
    page_size consecutive rows)."""
    if isinstance(pool, Int8Pages):

        def copy(pool, src_S, dst_S):
            _, K2, ps, _ = pool.q.shape
            per_page = jnp.arange(K2 * ps, dtype=jnp.int32)
            src = (src_S[:, None] * (K2 * ps) + per_page).reshape(-1)
            dst = (dst_S[:, None] * (K2 * ps) + per_page).reshape(-1)
            return _int8_rows_set(pool, dst, lambda arrays: tuple(x[src] for x in arrays))

        return _per_chip_heads(copy, pool, (), (src_S, dst_S), out_is_pool=True)
    R, ps = pool.shape[:2]
    offsets = jnp.arange(ps, dtype=jnp.int32)
    rows = pool.reshape(R * ps, *pool.shape[2:])
    src = (src_S[:, None] * ps + offsets).reshape(-1)
    dst = (dst_S[:, None] * ps + offsets).reshape(-1)
    return rows.at[dst].set(rows[src]).reshape(pool.shape)


def _int8_rows_set(pool, rows, values):
    """`pool` (`Int8Pages`) with its token rows `rows` (of [pages · 2K · page_size, C], and
    the scales flat in the same order) set to `values((q_rows, flat_scales))`: a bitcast of
    the head-major layout, so the pool keeps the kernel's layout."""
    C = pool.q.shape[-1]
    q_rows, s_flat = pool.q.reshape(-1, C), pool.scale.reshape(-1)
    new_q, new_s = values((q_rows, s_flat))
    return Int8Pages(
        q_rows.at[rows].set(new_q).reshape(pool.q.shape),
        s_flat.at[rows].set(new_s).reshape(pool.scale.shape),
    )


def kv_entry(k_SKC, v_SKC, dtype):
    """Keys and values of one token per row interleaved as the pool's [S, 2K, C]."""
    S, K, C = k_SKC.shape
    return jnp.stack([k_SKC, v_SKC], axis=2).reshape(S, 2 * K, C).astype(dtype)


def write_entry(pool, page_S, offset_S, k_SKC, v_SKC):
    """`pool` with one token per row written at (page_S[s], offset_S[s]) (quantised first
    for an `Int8Pages` pool, and written as rows of its head-major layout, as `copy_pages`
    does: an indexed write of [S, 2K, C] across the page_size axis made XLA:TPU lay the
    pool out page-offset major for the scatter and copy every layer's pool into the
    kernel's layout and back on every decode step, 2 x 28 copies of 138 MB per step on
    Qwen3-0.6B, v5e, 64 slots)."""
    if isinstance(pool, Int8Pages):

        def write(pool, q_SHC, scale_SH, page_S, offset_S):
            _, K2, ps, C = pool.q.shape
            heads = jnp.arange(K2, dtype=jnp.int32)
            rows_SH = (page_S[:, None] * K2 + heads) * ps + offset_S[:, None]
            new = (q_SHC.reshape(-1, C), scale_SH.reshape(-1))
            return _int8_rows_set(pool, rows_SH.reshape(-1), lambda _: new)

        q_SHC, scale_SH = quantize_int8(kv_entry(k_SKC, v_SKC, F32))
        args = ((q_SHC, scale_SH), (page_S, offset_S))
        return _per_chip_heads(write, pool, *args, out_is_pool=True)
    return pool.at[page_S, offset_S].set(kv_entry(k_SKC, v_SKC, pool.dtype))


def prompt_pages(prompt, page_size: int):
    """The prompts of a `kv_cache.PromptCache` (left padded, cache layout) as pages: per
    layer [N · ⌈P/page_size⌉, page_size, 2K, C], prompt n's real tokens from position 0 in
    its pages n·⌈P/ps⌉ …; positions past its length hold copies of other slots (never read:
    kv_lens stops before them)."""
    N, K, C, P = prompt.k[0].shape
    per = -(-P // page_size)
    width = per * page_size
    # Real tokens first: slot (P − length + i) becomes position i.
    src_NW = jnp.clip(jnp.arange(width)[None, :] + (P - prompt.length)[:, None], 0, P - 1)
    out = []
    for k_NKCP, v_NKPC in zip(prompt.k, prompt.v):
        k_NPKC = k_NKCP.transpose(0, 3, 1, 2)
        v_NPKC = v_NKPC.transpose(0, 2, 1, 3)
        k_NWKC = jnp.take_along_axis(k_NPKC, src_NW[:, :, None, None], axis=1)
        v_NWKC = jnp.take_along_axis(v_NPKC, src_NW[:, :, None, None], axis=1)
        kv = jnp.stack([k_NWKC, v_NWKC], axis=3).reshape(N * per, page_size, 2 * K, C)
        out.append(kv)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _PagedAttention:
    """Decode attention context: every layer writes its token's k/v at (write_page,
    write_offset) of its pool, then attends over the row's pages (`paged_attention`).
    The cache entry a layer returns is its updated pool."""

    kv: tuple
    write_page: jax.Array
    write_offset: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    impl: str
    split: jax.Array | None = None  # per row: the prompt's length (see ragged_paged_attention)
    prefix: object = None  # a `paged_prefix.SharedPrefix`: its `attend` reads shared pages once
    index: tuple = ()  # layer -> its index among its kind's layers (hybrid models)
    states: tuple = ()  # per DeltaNet layer, the rows' (conv window, state) before the step
    layer_data = None  # per-layer pools are indexed by layer (unrolled decoder)

    def linear(self, layer: int):
        """A DeltaNet layer's context: no mask, its rows' state, kept, the recurrent form."""
        return None, self.states[self.index[layer]], True, True

    def __call__(self, layer: int, q_BLHC, k_BLKC, v_BLKC):
        pool = self.kv[self.index[layer] if self.index else layer]
        pool = write_entry(pool, self.write_page, self.write_offset, k_BLKC[:, 0], v_BLKC[:, 0])
        C = q_BLHC.shape[-1]
        attend = paged_attention if self.prefix is None else self.prefix.attend
        out = attend(
            self.impl,
            q_BLHC[:, 0],
            pool,
            self.kv_lens,
            self.page_table,
            sm_scale=C**-0.5,
            split_S=self.split,
        )
        return out[:, None], pool


@functools.partial(jax.jit, static_argnums=0, static_argnames=("impl",))
def decode_step_paged(
    model_config: ModelConfig,
    params,
    kv: tuple,
    tokens_S,
    positions_S,
    write_page_S,
    write_offset_S,
    kv_lens_S,
    page_table_SM,
    *,
    impl: str = "xla",
    layer_params=None,
    prompt_lens_S=None,
    prefix=None,
):
    """One token per row: row s feeds tokens_S[s] at position positions_S[s], writes its
    k/v at (write_page_S[s], write_offset_S[s]) of every layer's pool and attends over its
    first kv_lens_S[s] context positions (the new one included) through page_table_SM[s].
    Returns (next-token logits [S, V] f32, the pools updated). Carry `kv` through a loop (or
    donate it) so the writes happen in place; pass `layer_params=split_layers(cfg, params)`
    computed once before the loop. `prompt_lens_S`: the rows' prompt lengths, for the
    trainer's prompt / response split of the value product (XLA path). `prefix`: a
    `paged_prefix.SharedPrefix` (the rows' shared prompt pages, read once per prompt), or
    None (every row reads its whole context).

    A hybrid model (Qwen3.5): `kv` is (the full-attention layers' pools, per Gated DeltaNet
    layer the rows' (conv window [S, K−1, channels], recurrent state [S, heads, d_k, d_v]
    f32)), and so is what comes back: pages only for the full-attention layers, the
    DeltaNet layers' recurrent form advancing each row's state by its token."""
    cfg = model_config
    pools, states, index = kv, (), ()
    if cfg.is_hybrid:
        (pools, states), index = kv, kind_index(cfg)
    context = _PagedAttention(
        kv=tuple(pools),
        write_page=write_page_S,
        write_offset=write_offset_S,
        kv_lens=kv_lens_S,
        page_table=page_table_SM,
        impl=impl,
        split=prompt_lens_S,
        prefix=prefix,
        index=index,
        states=tuple(states),
    )
    model = merge(cfg, params)
    hidden_S1D, entries, _ = model(
        tokens_S[:, None],
        positions_S[:, None],
        context,
        None,
        unroll=True,
        layer_params=layer_params,
    )
    logits = logits_from_hidden(cfg, params, hidden_S1D[:, 0])
    if cfg.is_hybrid:
        linear = [cfg.is_linear_layer(i) for i in range(cfg.num_layers)]
        full = tuple(e for e, lin in zip(entries, linear) if not lin)
        return logits, (full, tuple(e for e, lin in zip(entries, linear) if lin))
    return logits, tuple(entries)


__all__ = [
    "INT8_MAX",
    "KV_DTYPES",
    "MASK_VALUE",
    "PAGED_IMPLS",
    "Int8Pages",
    "copy_pages",
    "decode_step_paged",
    "dequantize",
    "kv_entry",
    "paged_attention",
    "paged_attention_impl",
    "prompt_pages",
    "quantize_int8",
    "ragged_paged_attention",
    "to_kv_dtype",
    "write_entry",
]
