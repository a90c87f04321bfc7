"""config.json of the hybrid Qwen3.5 models (Gated DeltaNet + gated full attention), read
and written for `ModelConfig` (config.py).

Qwen3.5 ships as `Qwen3_5ForCausalLM` (model_type "qwen3_5_text", the text model alone)
and as the released vision-language `Qwen3_5ForConditionalGeneration` (model_type
"qwen3_5", the text model's fields under `text_config`); the MoE family likewise
("qwen3_5_moe_text" / "qwen3_5_moe"). `text_part` turns either into one flat dict whose
model_type is our arch ("qwen3_5" / "qwen3_5_moe"); `hybrid_fields` reads what the
hybrid layers need; `hybrid_hf` writes it back (as transformers 5.23 writes a
`Qwen3_5ForCausalLM` config.json).

Differences from Qwen3 the fields below carry: each layer is `linear_attention` (Gated
DeltaNet, deltanet.py) or `full_attention` (`layer_types`, or every
`full_attention_interval`-th layer); full attention has a sigmoid output gate (q_proj
doubled), RoPE on the first `partial_rotary_factor`·head_dim dims only, and every
RMSNorm but the DeltaNet's gated one is zero-centred (scale 1 + w). The multimodal RoPE
sections (`mrope_section`) rotate text tokens exactly as plain RoPE (all three sections
share the text position), so they are read and dropped.
"""

from __future__ import annotations

from typing import Any

HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")
# Our arch -> (model_type of the causal LM's config.json, its architecture name).
CAUSAL_LM = {
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
# model_type of the vision-language wrapper -> (our arch, its architecture name).
CONDITIONAL = {
    "qwen3_5": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
}
_ROPE_DROPPED = ("mrope_section", "mrope_interleaved", "partial_rotary_factor")


def text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """The flat text-model config.json of a Qwen3.5 checkpoint (model_type = our arch,
    architectures = [the causal LM]); any other config.json unchanged."""
    model_type = hf.get("model_type")
    arch = {v[0]: k for k, v in CAUSAL_LM.items()}.get(model_type)
    if arch is not None:
        out, wanted = dict(hf), CAUSAL_LM[arch][1]
    elif model_type in CONDITIONAL and isinstance(hf.get("text_config"), dict):
        arch, wanted = CONDITIONAL[model_type]
        out = dict(hf["text_config"])
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
            if key not in out and key in hf:
                out[key] = hf[key]
    else:
        return hf
    architectures = hf.get("architectures") or []
    if architectures and list(architectures) != [wanted]:
        raise ValueError(
            f"unsupported architecture: architectures={architectures!r} for "
            f"model_type={model_type!r}; expected [{wanted!r}]"
        )
    rope = dict(out.get("rope_parameters") or out.get("rope_scaling") or {})
    if "partial_rotary_factor" in rope and "partial_rotary_factor" not in out:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    for key in _ROPE_DROPPED:
        rope.pop(key, None)
    out.pop("rope_scaling", None)
    out["rope_parameters"] = rope
    out["model_type"], out["architectures"] = arch, [CAUSAL_LM[arch][1]]
    return out


def _layer_types(hf: dict[str, Any], read, n: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:
        interval = read.count("full_attention_interval", 4)
        return tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        )
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"layer_types must be a list of num_hidden_layers={n} entries")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(
                f"layer_types[{i}]={t!r} is not a known layer type; known: {LAYER_TYPES}"
            )
    return tuple(types)


def hybrid_fields(hf: dict[str, Any], read, n: int) -> dict[str, Any]:
    """ModelConfig fields of a flat Qwen3.5 config.json (`text_part`)."""
    partial = read.positive("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    bias = read.flag("attention_bias", False)
    fields = {
        "layer_types": _layer_types(hf, read, n),
        "linear_conv_kernel_dim": read.count("linear_conv_kernel_dim", 4),
        "linear_key_head_dim": read.count("linear_key_head_dim", 128),
        "linear_value_head_dim": read.count("linear_value_head_dim", 128),
        "linear_num_key_heads": read.count("linear_num_key_heads", 16),
        "linear_num_value_heads": read.count("linear_num_value_heads", 32),
        "partial_rotary_factor": partial,
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
    }
    if hf.get("model_type") == "qwen3_5_moe":
        moe_width = read.count("moe_intermediate_size")
        fields.update(
            num_experts=read.count("num_experts"),
            num_experts_per_tok=read.count("num_experts_per_tok"),
            moe_intermediate_size=moe_width,
            shared_expert_intermediate_size=read.count("shared_expert_intermediate_size"),
            norm_topk_prob=True,  # the Qwen3.5-MoE router always renormalises its top-k
            intermediate_size=read.count("intermediate_size", moe_width),
        )
    return fields


def check_hybrid(cfg, bad) -> None:
    """ModelConfig.__post_init__'s checks of the hybrid fields."""
    if cfg.arch not in HYBRID_ARCHS:
        if cfg.layer_types and set(cfg.layer_types) != {"full_attention"}:
            bad("layer_types", f"linear_attention layers need arch in {HYBRID_ARCHS}")
        return
    if len(cfg.layer_types) != cfg.num_layers:
        bad("layer_types", f"needs num_layers={cfg.num_layers} entries")
    unknown = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if unknown:
        bad("layer_types", f"unknown entries {unknown}; known: {LAYER_TYPES}")
    for f in (
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "deltanet_chunk_size",
    ):
        if not isinstance(getattr(cfg, f), int) or getattr(cfg, f) <= 0:
            bad(f, "must be a positive integer")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        bad("linear_num_value_heads", "must be a multiple of linear_num_key_heads")
    if not 0 < cfg.partial_rotary_factor <= 1 or cfg.rotary_dim % 2 or not cfg.rotary_dim:
        bad("partial_rotary_factor", "must give an even rotary dim in (0, head_dim]")
    if cfg.arch == "qwen3_5_moe" and cfg.shared_expert_intermediate_size <= 0:
        bad("shared_expert_intermediate_size", "qwen3_5_moe needs a shared expert width > 0")


def hybrid_hf(cfg) -> dict[str, Any]:
    """The config.json keys of a hybrid model beyond the common ones (config.py)."""
    model_type, architecture = CAUSAL_LM[cfg.arch]
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "attention_bias": cfg.qkv_bias,
        "head_dim": cfg.head_dim,
        "layer_types": list(cfg.layer_types),
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
    }
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    rope.update(dict(cfg.rope_scaling or ()))
    rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    hf["rope_parameters"] = dict(sorted(rope.items()))
    if cfg.arch == "qwen3_5_moe":
        hf.update(
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    return hf
