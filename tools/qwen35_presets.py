"""`tools.aot --preset=Qwen3.5-0.8B` / `--preset=Qwen3.5-35B-A3B`: the released config.json
of each (the vision-language wrapper, `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration`, architecture fields of its `text_config` only; the
vision tower's fields are not read). `models.ModelConfig.from_hf_config` takes the text part
as it does from a checkpoint directory (models/hybrid_config.py).

Values as published on the Hugging Face Hub (Qwen/Qwen3.5-0.8B, Qwen/Qwen3.5-35B-A3B),
read here from copies of those config.json files quoted in public repositories (this
machine has no Hub access): 0.8B, 24 layers (18 Gated DeltaNet + 6 gated attention), width
1,024, 8 query / 2 kv heads of 256, DeltaNet 16 key / 16 value heads of 128, MLP 3,584,
tied embeddings; 35B-A3B, 40 layers (30 + 10), width 2,048, 16 / 2 heads of 256, DeltaNet
16 key / 32 value heads of 128, 256 experts of width 512 with top-8 routing and a shared
expert of width 512, untied. Both: vocabulary 248,320, RoPE θ = 1e7 on a quarter of each
head (partial_rotary_factor 0.25; the multimodal sections [11, 11, 10] rotate text as plain
RoPE), conv kernel 4, max positions 262,144.
"""

from __future__ import annotations

from typing import Any


def _layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


_TEXT = {
    "attention_bias": False,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "vocab_size": 248320,
    "bos_token_id": 248044,
    "eos_token_id": 248044,
}

QWEN35_PRESETS: dict[str, dict[str, Any]] = {
    "Qwen3.5-0.8B": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": dict(
            _TEXT,
            model_type="qwen3_5_text",
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            layer_types=_layer_types(24),
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_value_heads=16,
            tie_word_embeddings=True,
        ),
    },
    "Qwen3.5-35B-A3B": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": dict(
            _TEXT,
            model_type="qwen3_5_moe_text",
            hidden_size=2048,
            num_hidden_layers=40,
            layer_types=_layer_types(40),
            num_attention_heads=16,
            num_key_value_heads=2,
            linear_num_value_heads=32,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
            tie_word_embeddings=False,
        ),
    },
}
