"""Our Qwen2 / Qwen3 / Qwen3-MoE logits equal transformers' (fixtures from make_fixtures.py).

Specification: f32 logits within 1e-4 of transformers at every real token, with and
without left padding; greedy decoding through prefill_shared + decode_step_shared reproduces
transformers' `generate` tokens on a left-padded batch; bf16 compute stays close to f32.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    cfg, params = models.load_pretrained(FIXTURES / request.param)
    ref = dict(np.load(FIXTURES / f"reference_{request.param}.npz"))
    return request.param, cfg, params, ref


def test_fixture_configs_cover_the_variants(family):
    name, cfg, _, _ = family
    expected = {
        "qwen2": {
            "qkv_bias": True,
            "qk_norm": False,
            "tie_word_embeddings": False,
            "rope_type": "yarn",
        },
        "qwen3": {
            "qkv_bias": False,
            "qk_norm": True,
            "tie_word_embeddings": True,
            "rope_type": "default",
        },
        "qwen3_moe": {"qk_norm": True, "tie_word_embeddings": False, "num_moe_layers": 2},
        "llama": {
            "arch": "llama",
            "qkv_bias": False,
            "o_bias": False,
            "qk_norm": False,
            "tie_word_embeddings": False,
            "rope_type": "llama3",
        },
    }[name]
    for field, value in expected.items():
        assert getattr(cfg, field) == value, field
    assert cfg.num_kv_heads < cfg.num_heads  # GQA exercised
    if name == "qwen3":
        assert cfg.head_dim != cfg.hidden_size // cfg.num_heads
    if name == "qwen3_moe":
        assert cfg.moe_layers == (0, 2)  # layer 1 is dense via mlp_only_layers


@pytest.mark.parametrize("case", ["full", "left"])
def test_logits_match_transformers(family, case):
    _, cfg, params, ref = family
    mask = ref[f"mask_{case}"]
    logits = models.forward(cfg, params, jnp.asarray(ref["tokens"]), jnp.asarray(mask))
    assert logits.dtype == jnp.float32
    valid = mask.astype(bool)
    assert valid.sum() < valid.size or case == "full"
    np.testing.assert_allclose(
        np.asarray(logits)[valid], ref[f"logits_{case}"][valid], atol=1e-4, rtol=0
    )


def test_left_padding_does_not_change_real_tokens(family):
    """Row with 5 pads == the same 5 real tokens run alone without padding."""
    _, cfg, params, ref = family
    tokens, mask = ref["tokens"], ref["mask_left"]
    padded = models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask))
    row = 2
    start = int(np.argmax(mask[row]))
    alone = models.forward(
        cfg,
        params,
        jnp.asarray(tokens[row : row + 1, start:]),
        jnp.ones((1, 10 - start), jnp.int32),
    )
    np.testing.assert_allclose(np.asarray(padded)[row, start:], np.asarray(alone)[0], atol=2e-5)


def test_greedy_decode_matches_transformers_generate(family):
    """prefill + 12 decode steps with argmax == transformers' greedy generate (left padded),
    token by token, through the sampler's shared-prefix cache (one row per prompt) with
    the response cache split in two time segments."""
    _, cfg, params, ref = family
    prompt, prompt_mask = ref["gen_prompt_tokens"], ref["gen_prompt_mask"]
    new = ref["gen_tokens"].shape[1]
    cache, logits, _ = models.prefill_shared(
        cfg, params, jnp.asarray(prompt), jnp.asarray(prompt_mask)
    )
    response = models.init_response_cache(cfg, prompt.shape[0], new, segments=2)
    bounds = response.segments
    tokens, logprobs = [], []
    for slot in range(new):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logprobs.append(jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], 1)[:, 0])
        tokens.append(token)
        segment = next(m for m, (start, width) in enumerate(bounds) if slot < start + width)
        logits, response, _ = models.decode_step_shared(
            cfg, params, cache, response, token, slot, segment=segment
        )
    np.testing.assert_array_equal(np.stack(tokens, 1), ref["gen_tokens"])
    np.testing.assert_allclose(np.stack(logprobs, 1), ref["gen_logprobs"], atol=1e-4)
    np.testing.assert_array_equal(cache.length, prompt_mask.sum(1))


def test_bf16_compute_close_to_f32():
    """bf16 params + bf16 compute: hidden states are bf16, logits f32 and near the f32 ones."""
    ref = dict(np.load(FIXTURES / "reference_qwen3.npz"))
    cfg32, p32 = models.load_pretrained(FIXTURES / "qwen3")
    cfg16, p16 = models.load_pretrained(FIXTURES / "qwen3", dtype="bfloat16")
    assert cfg16.dtype == cfg16.param_dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask_left"])
    hidden, _ = models.hidden_states(cfg16, p16, tokens, mask)
    assert hidden.dtype == jnp.bfloat16
    l16 = np.asarray(models.forward(cfg16, p16, tokens, mask))
    l32 = np.asarray(models.forward(cfg32, p32, tokens, mask))
    valid = ref["mask_left"].astype(bool)
    err = np.abs(l16 - l32)[valid]
    scale = np.abs(l32[valid]).max()
    assert l16.dtype == np.float32
    assert err.max() < 0.05 * scale, (err.max(), scale)  # bf16 has ~3 significant digits
    assert err.max() > 0  # it really ran in bf16
    # Same greedy choice almost everywhere.
    agree = (l16.argmax(-1) == l32.argmax(-1))[valid].mean()
    assert agree > 0.9
