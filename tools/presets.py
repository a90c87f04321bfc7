"""Published model shapes by name, for `python -m tools.aot --preset=NAME`: each Hugging
Face repo's config.json, architecture fields only (no weights). Qwen3.5's are in
tools/qwen35_presets.py."""

from __future__ import annotations

from typing import Any

from tools.qwen35_presets import QWEN35_PRESETS

# Published shapes (the config.json of each Hugging Face repo, architecture fields only).
# Qwen3-0.6B and Qwen3-30B-A3B as in tests/fixtures/models/published_configs.json;
# Qwen3-8B per its model card (36 layers, 32 query / 8 kv heads, 8.2B parameters of which
# 6.95B non-embedding, untied), which these widths reproduce exactly.
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen3-8B": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_hidden_layers=36,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "Qwen3-30B-A3B": dict(
        _QWEN3,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_hidden_layers=48,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=768,
        norm_topk_prob=True,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    **QWEN35_PRESETS,  # Qwen3.5-0.8B, Qwen3.5-35B-A3B: tools/qwen35_presets.py
}
