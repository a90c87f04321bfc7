"""Shared-prefix ("cascade") decode attention (`models.paged_prefix`): a prompt's pages read
once for all its rows, each row's own pages apart, the two softmaxes merged. The XLA form
against the unsplit twin (`models.ragged_paged_attention`), the Pallas kernel (in Pallas'
TPU interpreter) against the XLA form, on ragged rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models
from gspo_jax.models import paged, paged_prefix

# 3 prompts of G = 3 over pages of 4 tokens: prompt 0 shares pages 1, 2 (8 positions),
# prompt 1 none (shorter than a page: all in its rows' own copies), prompt 2 pages 4, 5, 6.
# Slots decode sequences (prompt = seq // G, member = seq % G): member 1 of prompt 0 and
# members 0, 2 of prompt 1 are not decoding (finished or not admitted); slot 1 belongs to
# no prompt; slot 3's kv_len ends inside its prompt; slot 6 is idle (kv_len 0).
S, H, K, C, PS, PAGES, G = 7, 4, 2, 16, 4, 16, 3
SEQ = [0, -1, 2, 7, 6, 4, -1]
PROMPT_TABLE = [[1, 2, 0], [0, 0, 0], [4, 5, 6]]
PROMPT_LENS = [8, 0, 12]
TABLE = [[1, 2, 7, 8, 0], [9, 0, 0, 0, 0], [1, 2, 10, 0, 0], [4, 5, 6, 0, 0],
         [4, 5, 6, 11, 12], [13, 0, 0, 0, 0], [0, 0, 0, 0, 0]]  # fmt: skip
LENS = [14, 3, 9, 6, 20, 3, 0]
SPLIT = [10, 0, 9, 13, 13, 3, 0]  # the rows' prompt lengths (slot 1: none)
LIVE = [0, 1, 2, 3, 4, 5]


def _inputs(dtype=jnp.float32):
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((S, H, C)), dtype)
    kv = rng.standard_normal((PAGES, PS, 2 * K, C)) * rng.uniform(0.1, 3.0, (PAGES, PS, 2 * K, 1))
    pool = models.to_kv_dtype(jnp.asarray(kv, jnp.float32), "int8")
    table, lens = jnp.asarray(PROMPT_TABLE), jnp.asarray(PROMPT_LENS)
    prefix = paged_prefix.SharedPrefix(table, lens).decoding(jnp.asarray(SEQ, jnp.int32), G)
    return q, pool, jnp.asarray(LENS, jnp.int32), jnp.asarray(TABLE, jnp.int32), prefix


def test_the_member_table_and_each_rows_own_start():
    """Slot s sits at (prompt, member) = divmod(seq, G) of the member table (S where no
    slot decodes it); a member's own part starts at its prompt's shared length."""
    *_, prefix = _inputs()
    np.testing.assert_array_equal(prefix.members, [[0, 7, 2], [7, 5, 7], [4, 3, 7]])
    flat, start = prefix.rows(S)
    np.testing.assert_array_equal(flat, [0, 9, 2, 7, 6, 4, 9])
    np.testing.assert_array_equal(start, [8, 0, 8, 12, 12, 0, 0])


@pytest.mark.parametrize("split", [False, True])
def test_the_xla_form_equals_the_unsplit_twin(split):
    """f32: the unsplit twin's output to f32 rounding (the same normalised probabilities,
    summed in another order), also with the prompt / response split of the value product;
    bf16 queries: within bf16 rounding of the twin's. Blocks of 2 pages: the prompts' and
    the rows' own loops take 1-2 trips."""
    q, pool, lens, table, prefix = _inputs()
    kw = {"sm_scale": C**-0.5, "block_pages": 2}
    kw["split_S"] = jnp.asarray(SPLIT, jnp.int32) if split else None
    got = paged_prefix.shared_prefix_attention(q, pool, lens, table, prefix, **kw)
    want = models.ragged_paged_attention(q, pool, lens, table, **kw)
    np.testing.assert_allclose(np.asarray(got)[LIVE], np.asarray(want)[LIVE], atol=2e-6, rtol=1e-5)
    assert not np.any(np.isnan(np.asarray(got)))
    qb = q.astype(jnp.bfloat16)
    got = paged_prefix.shared_prefix_attention(qb, pool, lens, table, prefix, **kw)
    want = models.ragged_paged_attention(qb, pool, lens, table, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32)[LIVE], np.asarray(want, np.float32)[LIVE], atol=0.05
    )


def test_the_pallas_kernel_equals_the_xla_form():
    """The kernel twice (over the prompts' pages, Q = G·R = 6 query rows per kv head, and
    over each row's own pages from its first own page), merged: the XLA form's output to
    f32 rounding; the idle slot (kv_len 0) gets 0. And the merge of the unnormalised
    parts is exact: the kernel's prompt part alone, merged with nothing, is the
    attention over the prompt's positions only."""
    q, pool, lens, table, prefix = _inputs()
    got = paged_prefix.pallas_shared_prefix_attention(
        q, pool, lens, table, prefix, sm_scale=C**-0.5, interpret=True
    )
    want = paged_prefix.shared_prefix_attention(q, pool, lens, table, prefix, sm_scale=C**-0.5)
    print("kernel vs twin max abs error:", float(jnp.max(jnp.abs(got - want)[jnp.array(LIVE)])))
    np.testing.assert_allclose(np.asarray(got)[LIVE], np.asarray(want)[LIVE], atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(got)[6] == 0)
    # Slot 4's prompt part: its 12 shared positions, as the unsplit twin over them.
    q_NKQC, lim_NQ = paged_prefix._prompt_queries(q, prefix, lens, K)
    acc, m, l = paged_prefix.int8_partial_attention(
        q_NKQC, pool.q, pool.scale, jnp.max(lim_NQ, 1), jnp.zeros(3, jnp.int32),
        prefix.table, lim_NQ, sm_scale=C**-0.5, pages_per_block=2, interpret=True,
    )  # fmt: skip
    part = (acc / l[..., None])[2, :, 0:2].reshape(H, C)  # prompt 2, member 0 (slot 4)
    alone = models.ragged_paged_attention(
        q[4:5], pool, jnp.array([12]), table[4:5], sm_scale=C**-0.5
    )
    np.testing.assert_allclose(part, alone[0], atol=2e-6, rtol=1e-5)
    assert (
        float(m[1].max()) == np.float32(paged.MASK_VALUE) and float(jnp.abs(l[1]).max()) == 0
    )  # no reads


def test_shared_prefix_refuses_the_pallas_path_on_a_float_pool():
    """Our kernel reads int8 pages only: a float pool on "pallas" is one error naming both
    paths; on "xla" the shared-prefix form takes any pool (here f32: the unsplit twin's)."""
    q, pool, lens, table, prefix = _inputs()
    float_pool = paged.dequantize(pool, jnp.float32)
    with pytest.raises(ValueError, match=r'impl .pallas. on a ArrayImpl pool; "xla" for any'):
        prefix.attend("pallas", q, float_pool, lens, table, sm_scale=1.0)
    out = prefix.attend("xla", q, float_pool, lens, table, sm_scale=C**-0.5)
    want = models.ragged_paged_attention(q, float_pool, lens, table, sm_scale=C**-0.5)
    np.testing.assert_allclose(np.asarray(out)[LIVE], np.asarray(want)[LIVE], atol=2e-6)
    assert jax.tree.leaves(prefix)  # a pytree: it crosses jit and shard_map boundaries
