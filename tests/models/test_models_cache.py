"""Cached decoding specification: every cached path equals the full forward.

- `attention.attend_cached` (cache layout, parts, groups sharing a part) equals
  `attention.attend` over the same keys laid out as projected, masks and fully masked rows
  included.
- one row per prompt (G = 1): prefill_shared + decode_step_shared with left padding equal
  `forward` at every position, and the cache holds what was fed (valid slots, lengths,
  every response slot written); consuming tokens by decode steps equals prefilling them.
- shared prefix: prefill_shared once per prompt + decode_step_shared for G rows per
  prompt across several response-cache time segments equals `forward` on the repeated
  sequences, and rows sharing a prompt diverge only through their own tokens.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models
from gspo_jax.models.attention import attend, attend_cached

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"

# Shape letters: B rows, Q prompts, G = B/Q, L query tokens, H/K query/kv heads, C head dim.


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


# ----------------------------------------------------------------- attention kernel


def test_attend_cached_equals_attend():
    """A shared part (Q = 2 rows for B = 6 queries) plus two own parts, keys in cache
    layout, equals `attend` on the concatenated keys in projected layout with the G-fold
    repeated shared keys and the combined mask. Query row 0, token 1 has no allowed key:
    both give the same uniform average."""
    rng = np.random.default_rng(0)
    B, Q, L, H, K, C, P, W1, W2 = 6, 2, 2, 4, 2, 8, 5, 3, 4
    G = B // Q
    q = rng.normal(size=(B, L, H, C)).astype(np.float32)
    kp, vp = rng.normal(size=(2, Q, P, K, C)).astype(np.float32)
    k1, v1 = rng.normal(size=(2, B, W1, K, C)).astype(np.float32)
    k2, v2 = rng.normal(size=(2, B, W2, K, C)).astype(np.float32)
    valid_QLP = rng.random((Q, L, P)) < 0.7
    allowed2_BLW = rng.random((B, L, W2)) < 0.5
    valid_QLP[0, 1] = False
    allowed2_BLW[0, 1] = False
    parts = [
        (kp.transpose(0, 2, 3, 1), vp.transpose(0, 2, 1, 3), valid_QLP),
        (k1.transpose(0, 2, 3, 1), v1.transpose(0, 2, 1, 3), None),
        (k2.transpose(0, 2, 3, 1), v2.transpose(0, 2, 1, 3), allowed2_BLW),
    ]
    allowed1 = np.ones((B, L, W1), bool)
    allowed1[0, 1] = False  # row 0, token 1: nothing allowed anywhere
    parts[1] = (*parts[1][:2], allowed1)
    got = np.asarray(jax.jit(attend_cached)(jnp.asarray(q), parts))

    k_all = np.concatenate([np.repeat(kp, G, 0), k1, k2], axis=1)
    v_all = np.concatenate([np.repeat(vp, G, 0), v1, v2], axis=1)
    allowed = np.concatenate([np.repeat(valid_QLP, G, 0), allowed1, allowed2_BLW], axis=-1)
    want = np.asarray(attend(jnp.asarray(q), k_all, v_all, jnp.asarray(allowed)))
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got[0, 1], v_all[0].mean(0).repeat(H // K, 0), atol=1e-5)
    with pytest.raises(ValueError, match="4 rows, which do not divide the 6 query rows"):
        attend_cached(jnp.asarray(q), [(kp[:1].repeat(4, 0).transpose(0, 2, 3, 1), None, None)])


def test_response_segments():
    assert models.response_segments(12, 3) == ((0, 4), (4, 4), (8, 4))
    assert models.response_segments(10, 4) == ((0, 3), (3, 3), (6, 3), (9, 1))
    assert models.response_segments(3, 9) == ((0, 1), (1, 1), (2, 1))
    assert models.response_segments(7, 1) == ((0, 7),)
    with pytest.raises(ValueError, match="segments >= 1"):
        models.response_segments(7, 0)


# ------------------------------------------------------------------- shared prefix


def test_shared_prefix_decode_equals_full_forward(model):
    """2 left-padded prompts, G = 3 rows each continuing differently for 4 tokens through
    a response cache of 2 segments (slots 0-1, 2-3): logits equal `forward` on the
    repeated prompt + continuation at every step."""
    cfg, params = model
    G, T = 3, 4
    prompt, prompt_mask = _batch(4, 2, 6, (2, 0), cfg.vocab_size)
    cont = np.random.default_rng(5).integers(0, cfg.vocab_size, (2 * G, T)).astype(np.int32)
    cache, first, _ = models.prefill_shared(
        cfg, params, jnp.asarray(prompt), jnp.asarray(prompt_mask)
    )
    np.testing.assert_array_equal(cache.length, [4, 6])
    np.testing.assert_array_equal(cache.valid, prompt_mask.astype(bool))
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    assert cache.k[0].shape == (2, cfg.num_kv_heads, cfg.head_dim, 6)
    assert cache.v[0].shape == (2, cfg.num_kv_heads, 6, cfg.head_dim)

    rep_tokens = np.concatenate([np.repeat(prompt, G, 0), cont], 1)
    rep_mask = np.concatenate([np.repeat(prompt_mask, G, 0), np.ones_like(cont)], 1)
    full = np.asarray(models.forward(cfg, params, jnp.asarray(rep_tokens), jnp.asarray(rep_mask)))
    np.testing.assert_allclose(np.repeat(np.asarray(first), G, 0), full[:, 5], atol=2e-5)

    response = models.init_response_cache(cfg, 2 * G, T, segments=2)
    assert response.segments == ((0, 2), (2, 2)) and response.max_len == T
    for slot in range(T):
        logits, response, _ = models.decode_step_shared(
            cfg, params, cache, response, jnp.asarray(cont[:, slot]), slot,
            segment=0 if slot < 2 else 1,
        )  # fmt: skip
        np.testing.assert_allclose(logits, full[:, 6 + slot], atol=2e-5, err_msg=f"slot {slot}")
    # Rows sharing a prompt diverged only through their own continuation.
    assert np.abs(np.asarray(logits)[0] - np.asarray(logits)[1]).max() > 1e-3
    for layer in response.k:  # every slot of both segments was written, in every layer
        for segment in layer:
            assert (np.abs(np.asarray(segment)).max(axis=(1, 2)) > 0).all()


def test_decode_step_shared_rejects_bad_segments_and_rows(model):
    cfg, params = model
    prompt, prompt_mask = _batch(4, 2, 6, (2, 0), cfg.vocab_size)
    cache, _, _ = models.prefill_shared(cfg, params, jnp.asarray(prompt), jnp.asarray(prompt_mask))
    two = models.init_response_cache(cfg, 4, 4, segments=2)
    tokens = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"has 2 segments \[\(0, 2\), \(2, 2\)\]: pass segment="):
        models.decode_step_shared(cfg, params, cache, two, tokens, 0)
    with pytest.raises(ValueError, match="segment=2 outside"):
        models.decode_step_shared(cfg, params, cache, two, tokens, 0, segment=2)
    three = models.init_response_cache(cfg, 3, 4)
    with pytest.raises(ValueError, match="3 token rows, response cache of 3 rows and 2 prompt"):
        models.decode_step_shared(cfg, params, cache, three, tokens[:3], 0)


# ------------------------------------------------------------- one row per prompt


def test_prefill_then_decode_equals_full_forward(model):
    """6 rows with their own prompts (G = 1), left padded by 0-5: prefill the first 6
    columns, feed columns 6-9 one decode step each; every step's logits equal `forward`'s
    at that position, and the cache holds exactly what was fed."""
    cfg, params = model
    tokens, mask = _batch(0, 6, 10, (0, 2, 5, 0, 1, 3), cfg.vocab_size)
    full = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    prompt_len = 6
    cache, logits, _ = models.prefill_shared(
        cfg, params, jnp.asarray(tokens[:, :prompt_len]), jnp.asarray(mask[:, :prompt_len])
    )
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=2e-5)
    response = models.init_response_cache(cfg, 6, 10 - prompt_len)
    for t in range(prompt_len, 10):
        logits, response, _ = models.decode_step_shared(
            cfg, params, cache, response, jnp.asarray(tokens[:, t]), t - prompt_len
        )
        np.testing.assert_allclose(logits, full[:, t], atol=2e-5, err_msg=f"position {t}")
    # Cache bookkeeping: real prompt slots, positions = real prompt tokens, every response
    # slot of every row and layer written.
    np.testing.assert_array_equal(cache.valid, mask[:, :prompt_len].astype(bool))
    np.testing.assert_array_equal(cache.length, mask[:, :prompt_len].sum(1))
    for layer in response.k:
        assert (np.abs(np.asarray(layer[0])).max(axis=(1, 2)) > 0).all()
    # Feeding columns 6-9 by decode steps equals prefilling all 10 (the old chunked prefill).
    _, last, _ = models.prefill_shared(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(logits, last, atol=2e-5)


def test_cache_dtype_and_jit_with_donation():
    """The caches are pytrees that survive jit with donation, one buffer per layer (and
    time segment) in the [rows, K, C, slots] / [rows, K, slots, C] layout; bf16 caches on
    request."""
    cfg, params = models.load_pretrained(FIXTURES / "qwen2")
    n, K, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    prompt = jnp.ones((1, 4), jnp.int32)
    shared, _, _ = models.prefill_shared(cfg, params, prompt, prompt, dtype=jnp.bfloat16)
    assert len(shared.k) == n
    assert shared.k[0].dtype == jnp.bfloat16 and shared.k[0].shape == (1, K, C, 4)
    response = models.init_response_cache(cfg, 3, 6, segments=2, dtype=jnp.bfloat16)
    assert len(response.k) == len(response.v) == n and len(response.k[0]) == 2
    assert response.k[0][1].shape == (3, K, C, 3) and response.v[0][1].shape == (3, K, 3, C)
    step = jax.jit(
        models.decode_step_shared,
        static_argnums=0,
        static_argnames=("segment",),
        donate_argnames=("response",),
    )
    logits, response, _ = step(
        cfg, params, shared, response=response, tokens_B=jnp.zeros((3,), jnp.int32), slot=4,
        segment=1,
    )  # fmt: skip
    assert logits.shape == (3, cfg.vocab_size) and response.k[0][1].dtype == jnp.bfloat16
    # Slot 4 = offset 1 of segment 1 was written, in every layer, nothing else.
    for layer in response.k:
        written = np.abs(np.asarray(layer[1], np.float32)).max(axis=(0, 1, 2)) > 0
        np.testing.assert_array_equal(written, [False, True, False])
        assert not np.asarray(layer[0], np.float32).any()


def test_split_layers_gives_the_same_decode_step():
    """`layer_params=split_layers(...)` (weights sliced and cast to the compute dtype once,
    the MoE router kept in its stored dtype) gives bit-identical decode logits and cache to
    slicing inside the step, with f32 master weights and bf16 compute."""
    cfg, params = models.load_pretrained(FIXTURES / "qwen3_moe", compute_dtype="bfloat16")
    tokens, mask = _batch(6, 2, 5, (1, 0), cfg.vocab_size)
    cache, _, _ = models.prefill_shared(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))
    layers = jax.jit(models.split_layers, static_argnums=0)(cfg, params)
    assert layers[0]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert layers[0]["mlp"]["router"]["kernel"].dtype == jnp.float32
    response = models.init_response_cache(cfg, 4, 3)
    step = jnp.asarray([3, 4, 5, 6], jnp.int32)
    a = models.decode_step_shared(cfg, params, cache, response, step, 0)
    b = models.decode_step_shared(cfg, params, cache, response, step, 0, layer_params=layers)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_response_cache_is_sharded_over_rows_under_a_mesh():
    """Zeros depend on no input: under a mesh the response cache is constrained to rows
    over the batch axes (XLA replicated it before: every chip held the whole cache)."""
    from gspo_jax import sharding as sharding_lib

    cfg, _ = models.load_pretrained(FIXTURES / "qwen3")
    mesh = sharding_lib.make_mesh({"data": 4, "fsdp": 2, "tensor": 1, "expert": 1})
    with jax.set_mesh(mesh):
        cache = jax.jit(lambda: models.init_response_cache(cfg, 8, 6, segments=2))()
    for buffer in jax.tree.leaves(cache):
        assert buffer.sharding.spec[0] == sharding_lib.BATCH_AXES[:2]  # data, fsdp (expert 1)
        assert buffer.addressable_shards[0].data.shape[0] == 1  # 8 rows over 8 devices
