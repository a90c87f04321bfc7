"""KV cache specification: cached prefill + decode equals the full forward.

Checked with left padding, with chunked prefill, and after repeat_cache broadcasting
each prompt's cache to G rows that then continue differently.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models

FIXTURES = Path(__file__).parent / "fixtures" / "models"


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def model(request):
    return models.load_pretrained(FIXTURES / request.param)


def _batch(seed, b, length, pads, vocab):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, length)).astype(np.int32)
    mask = np.ones((b, length), np.int32)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
    return tokens, mask


def test_prefill_then_decode_equals_full_forward(model):
    cfg, params = model
    tokens, mask = _batch(0, 3, 10, (0, 2, 5), cfg.vocab_size)
    full = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    prompt_len = 6
    cache = models.init_cache(cfg, 3, 12)
    logits, cache = models.prefill(
        cfg, params, jnp.asarray(tokens[:, :prompt_len]), jnp.asarray(mask[:, :prompt_len]), cache
    )
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=2e-5)
    for t in range(prompt_len, 10):
        logits, cache = models.decode_step(cfg, params, jnp.asarray(tokens[:, t]), cache)
        np.testing.assert_allclose(logits, full[:, t], atol=2e-5, err_msg=f"position {t}")
    # Cache bookkeeping: slots filled where real, positions = real tokens so far.
    np.testing.assert_array_equal(cache.mask[:, :10], mask.astype(bool))
    assert not cache.mask[:, 10:].any()
    np.testing.assert_array_equal(cache.pos, mask.sum(1))
    assert int(cache.index) == 10


def test_chunked_prefill_equals_single_prefill(model):
    cfg, params = model
    tokens, mask = _batch(1, 3, 10, (0, 2, 5), cfg.vocab_size)
    full = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    cache = models.init_cache(cfg, 3, 12)
    _, cache = models.prefill(
        cfg, params, jnp.asarray(tokens[:, :6]), jnp.asarray(mask[:, :6]), cache
    )
    logits, cache = models.prefill(
        cfg, params, jnp.asarray(tokens[:, 6:]), jnp.asarray(mask[:, 6:]), cache
    )
    np.testing.assert_allclose(logits, full[:, -1], atol=2e-5)


def test_repeat_cache_then_decode_equals_full_forward(model):
    """Prefill 2 prompts once, repeat each 2x (rows 0,0,1,1), decode different tokens."""
    cfg, params = model
    n = 2
    prompt, prompt_mask = _batch(2, 2, 6, (3, 0), cfg.vocab_size)
    cont = np.random.default_rng(3).integers(0, cfg.vocab_size, (4, 4)).astype(np.int32)
    cache = models.init_cache(cfg, 2, 10)
    first, cache = models.prefill(cfg, params, jnp.asarray(prompt), jnp.asarray(prompt_mask), cache)
    cache = models.repeat_cache(cache, n)
    assert cache.k.shape[1] == 4 and cache.mask.shape[0] == 4
    np.testing.assert_array_equal(cache.pos, [3, 3, 6, 6])

    rep_tokens = np.concatenate([np.repeat(prompt, n, 0), cont], 1)
    rep_mask = np.concatenate([np.repeat(prompt_mask, n, 0), np.ones_like(cont)], 1)
    full = np.asarray(models.forward(cfg, params, jnp.asarray(rep_tokens), jnp.asarray(rep_mask)))
    np.testing.assert_allclose(np.repeat(np.asarray(first), n, 0), full[:, 5], atol=2e-5)
    for t in range(4):
        logits, cache = models.decode_step(cfg, params, jnp.asarray(cont[:, t]), cache)
        np.testing.assert_allclose(logits, full[:, 6 + t], atol=2e-5, err_msg=f"step {t}")
    # Rows sharing a prompt diverged only through their own continuation.
    assert np.abs(np.asarray(logits)[0] - np.asarray(logits)[1]).max() > 1e-3


def test_cache_dtype_and_jit_with_donation(model):
    """The cache is a pytree that survives jit with donation; bf16 cache on request."""
    cfg, params = model
    cache = models.init_cache(cfg, 3, 12, dtype=jnp.bfloat16)
    assert cache.k.dtype == jnp.bfloat16 and cache.k.shape == (
        cfg.num_layers,
        3,
        12,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    step = jax.jit(models.decode_step, static_argnums=0, donate_argnames=("cache",))
    logits, new_cache = step(cfg, params, jnp.zeros((3,), jnp.int32), cache=cache)
    assert logits.shape == (3, cfg.vocab_size) and new_cache.k.dtype == jnp.bfloat16
    assert int(new_cache.index) == 1 and np.all(np.asarray(new_cache.pos) == 1)
