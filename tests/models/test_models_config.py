"""ModelConfig specification: reads published Qwen config.json files and transformers-5
spellings, rejects what the model does not implement, and computes RoPE frequencies.
"""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from gspo_jax.models import ModelConfig

# config.json of the published checkpoints as on the Hugging Face hub (old spellings:
# top-level rope_theta, num_experts, torch_dtype), copied by tests/fixtures/make_fixtures.py.
PUBLISHED = json.loads(
    (Path(__file__).parents[1] / "fixtures/models/published_configs.json").read_text()
)
QWEN3_0_6B = PUBLISHED["Qwen/Qwen3-0.6B"]
QWEN2_5_1_5B_INSTRUCT = PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"]
QWEN3_30B_A3B = PUBLISHED["Qwen/Qwen3-30B-A3B"]


def test_published_qwen3_0_6b():
    cfg = ModelConfig.from_hf_config(QWEN3_0_6B)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == ("qwen3", 28, 1024, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta) == (16, 8, 1e6)
    assert cfg.tie_word_embeddings and cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias
    assert cfg.rope_scaling is None and cfg.eos_token_ids == (151645,)
    assert cfg.bos_token_id == 151643 and cfg.pad_token_id is None
    hash(cfg)  # static jit argument


def test_published_qwen2_5_with_inactive_sliding_window():
    cfg = ModelConfig.from_hf_config(QWEN2_5_1_5B_INSTRUCT)
    assert cfg.arch == "qwen2" and cfg.head_dim == 1536 // 12 == 128
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm
    assert cfg.num_kv_heads == 2 and cfg.tie_word_embeddings


def test_published_qwen3_30b_a3b_and_moe_placement():
    cfg = ModelConfig.from_hf_config(QWEN3_30B_A3B)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob and cfg.moe_layers == tuple(range(48))
    # Placement rule: mlp_only_layers wins, then every decoder_sparse_step-th layer.
    sparse = dataclasses.replace(cfg, num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert sparse.moe_layers == (1, 5)


def test_transformers5_spellings_are_read():
    hf = dict(QWEN3_30B_A3B)
    del hf["num_experts"], hf["rope_theta"], hf["rope_scaling"], hf["torch_dtype"]
    hf.update(
        num_local_experts=128,
        rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
        dtype="bfloat16",
    )
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.num_experts == 128 and cfg.rope_theta == 5e5 and cfg.rope_scaling is None


def test_to_hf_config_round_trips():
    for hf in (QWEN3_0_6B, QWEN2_5_1_5B_INSTRUCT, QWEN3_30B_A3B):
        cfg = ModelConfig.from_hf_config(hf)
        back = cfg.to_hf_config()
        assert ModelConfig.from_hf_config(back) == cfg
        assert back["rope_parameters"] == {"rope_theta": cfg.rope_theta, "rope_type": "default"}


def test_yarn_rope_scaling_both_spellings():
    old = dict(
        QWEN3_0_6B,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    new = dict(
        QWEN3_0_6B,
        rope_scaling=None,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "rope_theta": 1000000,
        },
    )
    a, b = ModelConfig.from_hf_config(old), ModelConfig.from_hf_config(new)
    assert a == b and a.rope_type == "yarn"
    assert dict(a.rope_scaling)["factor"] == 4.0
    hash(a)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "mistral"),
        ({"model_type": None}, "model_type=None"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "Qwen3ForSequenceClassification"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"] * 28}, "sliding_attention"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1}},
            "low_freq_factor",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_are_named(edit, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(dict(QWEN3_0_6B, **edit))


def test_invalid_fields_are_named():
    base = ModelConfig.from_hf_config(QWEN3_0_6B)
    for field, value in [
        ("remat", "some"),
        ("moe_impl", "sparse"),
        ("dtype", "int8"),
        ("num_kv_heads", 3),
        ("head_dim", 7),
    ]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(base, **{field: value})


def test_rope_frequencies_match_formulas():
    cfg = ModelConfig.from_hf_config(QWEN3_0_6B)
    d = cfg.head_dim
    inv, scale = cfg.rope_inv_freq_and_scale()
    want = 1.0 / (1e6 ** (np.arange(0, d, 2) / d))
    np.testing.assert_allclose(inv, want, rtol=1e-6)
    assert scale == 1.0
    linear = ModelConfig.from_hf_config(
        dict(QWEN3_0_6B, rope_scaling={"type": "linear", "factor": 2.0})
    )
    inv_l, _ = linear.rope_inv_freq_and_scale()
    np.testing.assert_allclose(inv_l, want / 2, rtol=1e-6)
    # YaRN (arXiv 2309.00071): high-frequency dims kept, low-frequency dims divided by
    # factor, attention scale 0.1·ln(factor) + 1.
    yarn = ModelConfig.from_hf_config(
        dict(
            QWEN3_0_6B,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        )
    )
    inv_y, scale_y = yarn.rope_inv_freq_and_scale()
    assert math.isclose(scale_y, 0.1 * math.log(4.0) + 1, rel_tol=1e-9)
    np.testing.assert_allclose(inv_y[:4], want[:4], rtol=1e-6)
    np.testing.assert_allclose(inv_y[-4:], want[-4:] / 4, rtol=1e-6)
    assert np.all(inv_y <= want * (1 + 1e-6)) and np.all(inv_y >= want / 4 * (1 - 1e-6))


def test_rope_rotates_each_pair_i_and_i_plus_half():
    """apply_rope against the rotate-half formula written out in NumPy (transformers'
    layout): pair (i, i + C/2) at position p turns by the angle p·inv_freq[i]; the norm of
    each pair is kept, and position 0 is the identity."""
    import jax.numpy as jnp

    from gspo_jax.models.layers import apply_rope, rope_cos_sin

    cfg = ModelConfig.from_hf_config(dict(QWEN3_0_6B, head_dim=8))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [0, 0, 1, 7, 100]])
    cos, sin = rope_cos_sin(cfg, jnp.asarray(positions))
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv, _ = cfg.rope_inv_freq_and_scale()
    angle = positions[..., None, None] * inv.astype(np.float64)  # [B, L, 1, C/2]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
    want = np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
    )
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_array_equal(got[:, 0], x[:, 0])  # position 0: the identity

    def pair_norms(a):
        return np.hypot(a[..., :4], a[..., 4:])

    np.testing.assert_allclose(pair_norms(got), pair_norms(x), rtol=1e-5)
