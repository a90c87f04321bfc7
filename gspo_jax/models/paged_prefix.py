"""Shared-prefix ("cascade") decode attention: a prompt's pages read once for all its rows.

Why: the G responses of a prompt share its KV pages (the continuous engine's
`share_prefix`), but the unsplit attention (`paged.ragged_paged_attention`, the Pallas
kernels) reads them once per row. Here a decode step reads a prompt's shared pages once for
all of its decoding rows — their query heads stacked, G·R query rows per kv head (a better
MXU shape than R) — and each row's own pages (its response, and its copy of the prompt's
partly filled last page) apart, then merges the two partial softmaxes exactly, as
FlashInfer's cascade attention and Hydragen do: with a split of a row's keys into A ∪ B,

    out = (e^(m_A − m) acc_A + e^(m_B − m) acc_B) / (e^(m_A − m) l_A + e^(m_B − m) l_B)

where m = max(m_A, m_B) and acc_X, m_X, l_X are X's unnormalised Σ e^(s − m_X) v, score
maximum and Σ e^(s − m_X). At the paper's geometry (8 prompts x G = 8, prompts of 1,024,
responses of 8,192) a decode step reads 8 x 1,024 + 64 x (4,096 on average) positions per
layer where the unsplit attention reads 64 x 5,120: 0.82x the KV bytes.

`SharedPrefix` says which rows share what (built per step inside the jitted loop by
`SharedPrefix.of_prompts` once and `SharedPrefix.decoding` per step); `SharedPrefix.attend` is what the decode step calls in place of
`paged.paged_attention`:

  - "xla" (`shared_prefix_attention`, CPU / GPU and the tests): the unsplit twin's two
    passes (`paged.score_pass`, `paged.value_pass`), a prompt's rows together over its
    pages and every row over its own; the score maxima and sums of the two parts merged
    between the passes, so the value pass normalises the probabilities as the unsplit twin
    does (the trainer's arithmetic): the same numbers up to the order of the additions.
  - "pallas" (TPU, int8 pages): our kernel (`paged_int8_kernel.int8_partial_attention`)
    twice, over prompts (its query rows: the G·R of the prompt's rows) and over rows
    (from the row's first own page), each giving (acc, m, l), merged as above; every chip
    on its own kv heads (`paged._per_chip_heads`).

Shape letters: S rows (slots), N prompts, G rows per prompt (group size), M page-table
width, Mp a prompt's pages, K kv heads, R = H/K, Q query rows per kv head, C head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from gspo_jax.models import paged, partition
from gspo_jax.models.paged_int8_kernel import int8_partial_attention

F32 = jnp.float32


@struct.dataclass
class SharedPrefix:
    """What the rows of one decode step share.

    table    int32 [N, Mp]  prompt n's shared pages (whole pages only; a partly filled
                            last page is each row's own copy)
    lens     int32 [N]      its shared positions, lens[n] / page_size pages
    members  int32 [N, G]   the rows decoding its g-th sequence (S: none)

    A member row's page table must hold the prompt's pages in its first lens[n] /
    page_size columns (the engine's layout: the prompt's pages first, then the row's own);
    its own part starts at position lens[n], any other row's at 0."""

    table: jax.Array
    lens: jax.Array
    members: jax.Array | None = None  # None until `decoding` says which rows decode what

    @classmethod
    def of_prompts(cls, plen_Q, first_Q, page_size: int, width: int):
        """The continuous engine's prompts (no rows yet: `decoding`): prompt q's pages are
        first_Q[q] + j (j < `width`), of which its plen_Q[q] // page_size whole pages are
        shared (its partly filled last page is each row's own copy). Fixed for a whole
        engine loop: made once before it, whole on every chip (the kernel's shard_map takes
        it so), so that no step gathers it."""
        full_Q = plen_Q.astype(jnp.int32) // page_size
        j = jnp.arange(width, dtype=jnp.int32)[None, :]
        table = jnp.where(j < full_Q[:, None], first_Q[:, None] + j, 0)
        table = partition.constrain(table, (None, None))
        lens = partition.constrain(full_Q * page_size, (None,))
        return cls(table=table, lens=lens, members=None)

    def decoding(self, seq_S, group: int) -> SharedPrefix:
        """This step's rows: row s decodes sequence seq_S[s] (−1: none, the row shares
        nothing), member seq % G of prompt seq // G (the engine's numbering; at most one
        row per sequence): the member table scattered from it."""
        S, N = seq_S.shape[0], self.table.shape[0]
        n_S = jnp.where(seq_S >= 0, seq_S // group, N)  # N: out of range, dropped
        g_S = jnp.maximum(seq_S, 0) % group
        members = jnp.full((N, group), S, jnp.int32)
        members = members.at[n_S, g_S].set(jnp.arange(S, dtype=jnp.int32), mode="drop")
        return self.replace(members=members)

    def rows(self, S: int):
        """(flat [S]: row s's entry n·G + g of the member table, N·G where none; start [S]:
        its first own position, lens[n], 0 where none)."""
        N, G = self.members.shape
        entry = jnp.arange(N * G, dtype=jnp.int32)
        flat = jnp.full((S,), N * G, jnp.int32).at[self.members.reshape(-1)].set(entry, mode="drop")
        start = jnp.where(flat < N * G, self.lens[jnp.minimum(flat, N * G - 1) // G], 0)
        return flat, start

    def attend(self, impl, q_SHC, pool, kv_lens_S, page_table_SM, *, sm_scale, split_S=None):
        """The decode attention of `paged.paged_attention` (same arguments, [S, H, C]) with
        the shared pages read once per prompt: `shared_prefix_attention` ("xla") or the
        Pallas kernel twice ("pallas", every chip on its own kv heads)."""
        if impl == "xla":
            return shared_prefix_attention(
                q_SHC, pool, kv_lens_S, page_table_SM, self, sm_scale=sm_scale, split_S=split_S
            )
        if impl != "pallas" or not isinstance(pool, paged.Int8Pages):
            raise ValueError(
                f"shared-prefix attention: impl {impl!r} on a {type(pool).__name__} pool; "
                f'"xla" for any pool, "pallas" for an int8 one (models.Int8Pages)'
            )

        def kernel(pool, q_SHC, kv_lens_S, page_table_SM, prefix):
            return pallas_shared_prefix_attention(
                q_SHC, pool, kv_lens_S, page_table_SM, prefix, sm_scale=sm_scale
            )

        rest = (kv_lens_S, page_table_SM, self)
        return paged._per_chip_heads(kernel, pool, (q_SHC,), rest, out_is_pool=False)


def _prompt_queries(q_SHC, prefix: SharedPrefix, kv_lens_S, K: int):
    """(q [N, K, G·R, C]: each prompt's member rows' query heads, member-major; lim [N, G·R]:
    a member's limit in the prompt's pages, min(lens[n], its kv_len), 0 where absent)."""
    S, H, C = q_SHC.shape
    N, G = prefix.members.shape
    R = H // K
    slot = jnp.minimum(prefix.members, S - 1)
    q_NGKRC = q_SHC.reshape(S, K, R, C)[slot]
    q_NKQC = q_NGKRC.transpose(0, 2, 1, 3, 4).reshape(N, K, G * R, C)
    lim_NG = jnp.minimum(prefix.lens[:, None], kv_lens_S.astype(jnp.int32)[slot])
    lim_NG = jnp.where(prefix.members < S, lim_NG, 0)
    return q_NKQC, jnp.repeat(lim_NG, R, axis=1)


def _to_rows(x_NKQ, flat_S, G: int, fill):
    """A per-prompt quantity [N, K, G·R, ...] as the rows' [S, K, R, ...] (row s: entry
    flat[s] = n·G + g of the member table; `fill` where the row is no member)."""
    N, K, GR = x_NKQ.shape[:3]
    rest = x_NKQ.shape[3:]
    x = x_NKQ.reshape(N, K, G, GR // G, *rest).swapaxes(1, 2).reshape(N * G, K, GR // G, *rest)
    member = (flat_S < N * G).reshape(-1, *[1] * (x.ndim - 1))
    return jnp.where(member, x[jnp.minimum(flat_S, N * G - 1)], fill)


def _to_prompts(x_SKR, members_NG):
    """The rows' [S, K, R] as each prompt's [N, K, G·R] (absent members: some row's, never
    used: their limits are 0)."""
    N, G = members_NG.shape
    _, K, R = x_SKR.shape
    x = x_SKR[jnp.minimum(members_NG, x_SKR.shape[0] - 1)]  # [N, G, K, R]
    return x.transpose(0, 2, 1, 3).reshape(N, K, G * R)


def merge(m_a, l_a, m_b, l_b):
    """Two disjoint key sets' softmax statistics (score maximum m, Σ e^(s − m)) merged:
    (m, l, e^(m_a − m), e^(m_b − m)), so that acc = e^(m_a − m) acc_a + e^(m_b − m) acc_b
    and out = acc / l. m = max(m_a, m_b), 0 where both are −inf (nothing read: l = 0)."""
    m = jnp.maximum(m_a, m_b)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return m, w_a * l_a + w_b * l_b, w_a, w_b


def _own_part(prefix: SharedPrefix, kv_lens_S, S: int, R: int):
    """(flat [S] (`SharedPrefix.rows`), start [S]: the first own position, the rows'
    limits [S, R]: their kv_lens)."""
    flat, start = prefix.rows(S)
    return flat, start, jnp.broadcast_to(kv_lens_S.astype(jnp.int32)[:, None], (S, R))


def shared_prefix_attention(
    q_SHC, kv_pages, kv_lens_S, page_table_SM, prefix: SharedPrefix, *, sm_scale,
    split_S=None, block_pages=8,
):  # fmt: skip
    """`paged.ragged_paged_attention`'s result ([S, H, C] in q's dtype; `split_S` as there),
    the shared pages read once per prompt: the twin's score pass over each prompt's pages
    for its member rows together and over each row's own pages (its table from its first
    own column), the two parts' statistics merged (`merge`), then the value passes with
    the probabilities normalised by the merged statistics (XLA; any pool)."""
    S, H, C = q_SHC.shape
    K, ps, M = kv_pages.shape[2] // 2, kv_pages.shape[1], page_table_SM.shape[1]
    R, G = H // K, prefix.members.shape[1]
    flat, start, lim_SR = _own_part(prefix, kv_lens_S, S, R)
    q_NKQC, lim_NQ = _prompt_queries(q_SHC, prefix, kv_lens_S, K)
    cols = jnp.minimum(start[:, None] // ps + jnp.arange(M, dtype=jnp.int32), M - 1)
    own_SM = jnp.take_along_axis(page_table_SM, cols, axis=1)
    own_lim = jnp.maximum(lim_SR - start[:, None], 0)
    split = None if split_S is None else jnp.broadcast_to((split_S - start)[:, None], (S, R))
    shared = (kv_pages, prefix.table, lim_NQ, block_pages)
    own = (kv_pages, own_SM, own_lim, block_pages)
    m1, l1, s1 = paged.score_pass(q_NKQC, *shared, sm_scale=sm_scale)
    m2, l2, s2 = paged.score_pass(q_SHC.reshape(S, K, R, C), *own, sm_scale=sm_scale)
    m, l, _, _ = merge(_to_rows(m1, flat, G, -jnp.inf), _to_rows(l1, flat, G, 0.0), m2, l2)
    l = jnp.where(l > 0, l, 1.0)  # nothing read: output 0
    m_N, l_N = _to_prompts(m, prefix.members), _to_prompts(l, prefix.members)
    acc1 = paged.value_pass(s1, m_N, l_N, *shared, None, q_SHC.dtype)
    acc2 = paged.value_pass(s2, m, l, *own, split, q_SHC.dtype)
    acc = _to_rows(acc1, flat, G, 0.0) + acc2
    return acc.reshape(S, H, C).astype(q_SHC.dtype)


def pallas_shared_prefix_attention(
    q_SHC, kv_pages, kv_lens_S, page_table_SM, prefix: SharedPrefix, *, sm_scale,
    interpret=False,
):  # fmt: skip
    """The same on TPU for an `Int8Pages` pool: `int8_partial_attention` over the prompts'
    pages (grid: prompts x kv heads, Q = G·R query rows) and over each row's own pages
    (rows x kv heads, from its first own page), merged in f32 (`merge`); 0 for a row with
    nothing to read. `interpret`: Pallas' TPU interpreter (CPU tests)."""
    S, H, C = q_SHC.shape
    K = kv_pages.q.shape[1] // 2
    R, (N, G) = H // K, prefix.members.shape
    flat, start, lim_SR = _own_part(prefix, kv_lens_S, S, R)
    q_NKQC, lim_NQ = _prompt_queries(q_SHC, prefix, kv_lens_S, K)
    pool = (kv_pages.q, kv_pages.scale)
    kw = {"sm_scale": sm_scale, "interpret": interpret}
    end_N, zero_N = jnp.max(lim_NQ, axis=1), jnp.zeros((N,), jnp.int32)
    acc1, m1, l1 = int8_partial_attention(q_NKQC, *pool, end_N, zero_N, prefix.table, lim_NQ, **kw)
    acc2, m2, l2 = int8_partial_attention(
        q_SHC.reshape(S, K, R, C), *pool, kv_lens_S, start, page_table_SM, lim_SR, **kw
    )
    m1, l1 = _to_rows(m1, flat, G, -jnp.inf), _to_rows(l1, flat, G, 0.0)
    _, l, w1, w2 = merge(m1, l1, m2, l2)
    acc = w1[..., None] * _to_rows(acc1, flat, G, 0.0) + w2[..., None] * acc2
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(S, H, C).astype(q_SHC.dtype)


__all__ = ["SharedPrefix", "merge", "pallas_shared_prefix_attention", "shared_prefix_attention"]
