"""Our Pallas TPU kernel for int8 KV pages (`models.paged_int8_kernel`), run in Pallas' TPU
interpreter on CPU, against its XLA twin (`models.ragged_paged_attention` on the same
`Int8Pages`): the same products reassociated (the twin: two passes, the softmax normalised
before the value product; the kernel: one online pass per page), so in f32 they agree to
f32 rounding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models
from gspo_jax.models import paged_int8_kernel

# 5 rows over 14 pages of 4 tokens (page-table width 6): rows 0, 2 and 4 share a prompt's
# pages 3 and 7 (row 4 only the first); ragged kv_lens, one of 1 (a single live key), one
# of 0 between two others (output 0; the kernel's chain of prefetches across grid steps
# breaks there), one filling its table; 2 query heads per kv head (GQA).
S, H, K, C, PS, PAGES = 5, 4, 2, 16, 4, 14
TABLE = [[3, 7, 1, 0, 0, 0], [12, 13, 0, 0, 0, 0], [3, 7, 2, 9, 4, 11], [5, 0, 0, 0, 0, 0],
         [3, 8, 6, 10, 0, 0]]  # fmt: skip
LENS = [9, 0, 24, 1, 14]
LIVE = [0, 2, 3, 4]


@pytest.mark.parametrize("pages_per_block", [1, 4])
def test_int8_kernel_equals_its_xla_twin(pages_per_block):
    """Blocks of 1 page and of 4 (the width 6 is no multiple of 4: the last block reads
    past the table, masked), f32 queries: the kernel's output is the twin's to f32
    rounding; the kv_len-0 row (an idle slot, its output never used) is 0, where the twin
    averages the masked block's values."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((S, H, C)), jnp.float32)
    kv = rng.standard_normal((PAGES, PS, 2 * K, C)) * rng.uniform(0.1, 3.0, (PAGES, PS, 2 * K, 1))
    pool = models.to_kv_dtype(jnp.asarray(kv, jnp.float32), "int8")
    table, lens = jnp.asarray(TABLE, jnp.int32), jnp.asarray(LENS, jnp.int32)
    scale = C**-0.5
    got = paged_int8_kernel.int8_paged_attention(
        q, pool.q, pool.scale, lens, table, sm_scale=scale,
        pages_per_block=pages_per_block, interpret=True,
    )  # fmt: skip
    want = models.ragged_paged_attention(q, pool, lens, table, sm_scale=scale, block_pages=2)
    assert got.shape == (S, H, C) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got)[LIVE], np.asarray(want)[LIVE], atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(got)[1] == 0)
    # Row 3 reads its one key: the output is that token's dequantised value, per head.
    v0 = np.asarray(pool.q[5, 1::2, 0], np.float32) * np.asarray(pool.scale[5, 1::2, 0])[:, None]
    np.testing.assert_allclose(np.asarray(got)[3], np.repeat(v0, H // K, 0), rtol=1e-6)


def test_int8_kernel_refuses_mismatched_scales():
    """Scales not of the pages' [num_pages, 2K, page_size]: one error naming both."""
    q = np.zeros((3, 2 * K, PS, C), np.int8)
    with pytest.raises(ValueError, match=r"scales \(3, 4\) for pages \(3, 4, 4, 16\)"):
        paged_int8_kernel.int8_paged_attention(
            jnp.zeros((1, H, C)), q, np.zeros((3, PS), np.float32), jnp.ones(1, jnp.int32),
            jnp.zeros((1, 1), jnp.int32), sm_scale=1.0, interpret=True,
        )  # fmt: skip


def test_int8_writes_stay_on_each_chips_kv_heads():
    """A decode step's int8 writes (`write_entry`) and page copies (`copy_pages`) are rows
    of the head-major layout, a view that merges the head axis with others: on a pool split
    over kv heads (the tensor rollout layout, here fsdp 2) each chip writes its own heads
    (no collective in the compiled program) and the result is the one-device one."""
    from gspo_jax import sharding
    from gspo_jax.models import paged, partition

    rng = np.random.default_rng(4)
    pool = models.to_kv_dtype(
        jnp.asarray(rng.standard_normal((6, PS, 2 * K, C)), jnp.float32), "int8"
    )
    k, v = (jnp.asarray(rng.standard_normal((2, K, C)), jnp.float32) for _ in range(2))
    where = (jnp.array([3, 1]), jnp.array([2, 0]))
    copy = (jnp.array([3, 0]), jnp.array([4, 0]))

    def step(pool, k, v):
        with partition.layout(sharding.ROLLOUT_RULES):
            new = paged.write_entry(pool, *where, k, v)
            return models.copy_pages(new, *copy)

    want = step(pool, k, v)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 1, "expert": 1}, jax.devices()[:2])
    P = jax.sharding.PartitionSpec
    with jax.set_mesh(mesh):
        specs = models.Int8Pages(P(None, "fsdp"), P(None, "fsdp"))
        placed = jax.device_put(pool, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
        compiled = jax.jit(step).lower(placed, k, v).compile()
        got = compiled(placed, k, v)
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", compiled.as_text())
    np.testing.assert_array_equal(np.asarray(got.q), np.asarray(want.q))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
    assert got.q.sharding.spec[:2] == (None, "fsdp")
