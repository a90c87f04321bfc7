"""Which paged attention a decode runs (`models.paged_attention_impl`), and our int8
kernel at Qwen3.5's head dim 256 (Pallas' TPU interpreter on CPU) against its XLA twin."""

import jax.numpy as jnp
import numpy as np

from gspo_jax import models
from gspo_jax.models import paged_int8_kernel


def test_the_kernels_take_the_head_dims_they_compile_for():
    pick = models.paged_attention_impl
    assert pick("auto", "tpu", 128) == "pallas"  # jax's kernel, a float pool
    assert pick("auto", "tpu", 256) == "xla"  # jax's kernel refuses 256 (Mosaic)
    assert pick("auto", "tpu", 256, "int8") == "pallas"  # ours takes it
    assert pick("auto", "tpu", 64, "int8") == "xla"
    assert pick("auto", "cpu", 256, "int8") == "xla"
    assert pick("xla", "tpu", 128, "int8") == "xla"


def test_int8_kernel_at_head_dim_256_equals_its_xla_twin():
    S, H, K, C, PS, PAGES = 3, 4, 2, 256, 16, 6
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((S, H, C)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((PAGES, PS, 2 * K, C)), jnp.float32)
    pool = models.to_kv_dtype(kv, "int8")
    table = jnp.asarray([[0, 1], [2, 3], [4, 5]], jnp.int32)
    lens = jnp.asarray([20, 5, 32], jnp.int32)
    scale = C**-0.5
    got = paged_int8_kernel.int8_paged_attention(
        q, pool.q, pool.scale, lens, table, sm_scale=scale, pages_per_block=1, interpret=True
    )
    want = models.ragged_paged_attention(q, pool, lens, table, sm_scale=scale, block_pages=2)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
