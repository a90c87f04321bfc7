"""`ModelConfig`: one frozen, hashable description of a Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5 /
Llama 3 decoder.

Where it sits: `load_pretrained` builds it from a checkpoint's config.json
(`ModelConfig.from_hf_config`), every model function takes it as its first, static
(jit-hashable) argument, and `save_pretrained` writes it back (`to_hf_config`). Anything
the model code does not implement (sliding-window attention, other activations, RoPE
variants not listed in rope.py, MLP biases, other architectures) is rejected here with a
message naming the field, so a checkpoint is never silently run with the wrong maths.

Llama ("llama": Llama 3.x dense, LlamaForCausalLM) is Qwen3's decoder without q/k norms:
attention_bias on q/k/v/o, tied or untied embeddings, the "llama3" RoPE scaling.

Both spellings of the fields that moved between transformers versions are read:
`rope_theta` at top level (published Qwen checkpoints) or inside `rope_parameters`
(transformers 5), `rope_scaling` (old) or `rope_parameters` (new), `num_experts`
(Qwen) or `num_local_experts` (transformers 5), `dtype` or `torch_dtype`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from gspo_jax.models import rope as rope_lib
from gspo_jax.models.hf_fields import HfReader as _HfReader
from gspo_jax.models.hybrid_config import (
    CAUSAL_LM,
    HYBRID_ARCHS,
    check_hybrid,
    hybrid_fields,
    hybrid_hf,
    text_part,
)

ARCHS = ("qwen2", "qwen3", "qwen3_moe", "llama") + HYBRID_ARCHS
MOE_ARCHS = ("qwen3_moe", "qwen3_5_moe")
HF_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    **{arch: names[1] for arch, names in CAUSAL_LM.items()},
}
REMAT_POLICIES = ("none", "full", "dots", "save_qkv", "save_qkv_attention")
MOE_IMPLS = ("dense", "ragged")
ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")  # see attention.py
DTYPES = ("float32", "bfloat16", "float16")
# Projections LoRA can adapt (models/lora.py): attention q/k/v/o, dense SwiGLU MLP.
LORA_ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = LORA_ATTENTION_TARGETS + LORA_MLP_TARGETS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture + numerics of one decoder. Frozen and hashable: pass it as a static arg.

    Fields mirror the Hugging Face config names where one exists (renamed to short forms:
    num_layers = num_hidden_layers, num_heads = num_attention_heads, num_kv_heads =
    num_key_value_heads). Beyond the architecture:

    - `param_dtype`: dtype the parameters are stored in ("float32" | "bfloat16").
    - `dtype`: compute dtype of matmuls and activations. Softmaxes, norms' statistics,
      RoPE angles, the MoE router and the returned logits are always float32.
    - `remat`: rematerialisation of each decoder layer in the backward pass:
      "none" (keep all activations), "full" (keep only each layer's input, recompute
      the layer), "dots" (keep the outputs of weight matmuls, recompute attention
      scores/softmax and elementwise ops: `dots_with_no_batch_dims_saveable`),
      "save_qkv" (keep each layer's input and its normed, rotated q/k/v: the backward
      recomputes the MLP and the attention, not the q/k/v projections), "save_qkv_attention"
      (also keep the attention output, so the backward does not re-run the attention
      forward; the kernel's own residuals are still recomputed where it keeps any).
    - `moe_impl`: "ragged" (tokens sorted by expert, `jax.lax.ragged_dot` per expert
      group: compute proportional to top-k) or "dense" (every expert on every token,
      weighted by the sparse gates: an exact reference for tests and tiny models).
    - `attention_impl`: kernel of the full-sequence attention (train step, log-probs,
      prefill): "auto" (splash on TPU, cuDNN on GPU with 16-bit compute, else "xla"),
      "xla" (the einsum reference), "splash" (Pallas, TPU), "cudnn" (GPU). Decode steps
      always use the cache-layout einsum. See attention.py.
    - `scan_layers`: the full-sequence pass (train step, log-probs, prefill) runs the
      layers as one `jax.lax.scan` over their stacked weights (True: compile time and
      program size independent of depth) or in a Python loop (False: faster for a few
      small layers, where the scan's stacked backward residuals cost as much as the
      layers' elementwise work; compile time grows with depth). The same math either way
      (tests compare both with a per-layer loop; the TRL anchor's train step gave
      bit-identical parameters). Decode steps always run the layers unrolled.
    - `rope_scaling`: None for plain RoPE, else a sorted tuple of (key, value) pairs
      with "rope_type" in ("linear", "yarn") — hashable form of the HF dict.
    - `eos_token_ids`: tuple (HF allows an int or a list); empty when unknown.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (qwen3_moe only).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    # Hybrid Qwen3.5 (hybrid_config.py): per-layer "linear_attention" / "full_attention"
    # (empty: all full), the Gated DeltaNet widths, RoPE on the first
    # partial_rotary_factor·head_dim dims, the MoE's shared expert width.
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    # Numerics and implementation choices (not part of the checkpoint).
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    moe_impl: str = "ragged"
    attention_impl: str = "auto"
    scan_layers: bool = True
    # Tokens per chunk of the chunked Gated DeltaNet (deltanet.py): the full-sequence
    # passes' parallel form; the state is carried between chunks in float32.
    deltanet_chunk_size: int = 64
    # LoRA adapters (models/lora.py): rank 0 = off; y = W x + (alpha/rank)·B(A x) on each
    # projection named in lora_targets.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    # Special tokens, when the checkpoint's config names them.
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        if self.arch not in ARCHS:
            bad("arch", f"unsupported architecture; supported: {ARCHS}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, f)) <= 0:
                bad(f, "must be positive")
        for f in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(f, "must be a number")
            if not (math.isfinite(value) and value > 0):
                bad(f, "must be a finite number > 0")
        if self.head_dim <= 0 or self.head_dim % 2:
            bad("head_dim", "must be a positive even number (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            bad("num_kv_heads", f"must divide num_heads={self.num_heads} (grouped-query)")
        if self.remat not in REMAT_POLICIES:
            bad("remat", f"expected one of {REMAT_POLICIES}")
        if self.moe_impl not in MOE_IMPLS:
            bad("moe_impl", f"expected one of {MOE_IMPLS}")
        if self.attention_impl not in ATTENTION_IMPLS:
            bad("attention_impl", f"expected one of {ATTENTION_IMPLS}")
        if not isinstance(self.scan_layers, bool):
            bad("scan_layers", "expected True or False")
        for f in ("param_dtype", "dtype"):
            if getattr(self, f) not in DTYPES:
                bad(f, f"expected one of {DTYPES}")
        if self.rope_scaling is not None:
            rope = dict(self.rope_scaling)
            if rope.get("rope_type") not in rope_lib.ROPE_TYPES:
                bad("rope_scaling", f"rope_type must be one of {rope_lib.ROPE_TYPES}")
            if "factor" not in rope:
                bad("rope_scaling", "needs a 'factor'")
            if not (math.isfinite(float(rope["factor"])) and float(rope["factor"]) > 0):
                bad("rope_scaling", "its 'factor' must be a finite number > 0")
        if not isinstance(self.mlp_only_layers, tuple):
            bad("mlp_only_layers", "must be a tuple (hashable)")
        if not isinstance(self.eos_token_ids, tuple):
            bad("eos_token_ids", "must be a tuple (hashable)")
        if self.arch in MOE_ARCHS:
            if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
                bad("num_experts", "qwen3_moe needs num_experts > 0 and moe_intermediate_size > 0")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                bad("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}]")
            if self.decoder_sparse_step <= 0:
                bad("decoder_sparse_step", "must be positive")
        elif self.num_experts:
            bad("num_experts", f"only {MOE_ARCHS} have experts, not {self.arch}")
        check_hybrid(self, bad)
        self._check_lora(bad)

    def _check_lora(self, bad) -> None:
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            bad("lora_rank", "must be an integer >= 0 (0: no LoRA adapters)")
        if not self.lora_rank:
            return
        if not float(self.lora_alpha) > 0:
            bad("lora_alpha", "must be > 0 (the adapters' scale is lora_alpha / lora_rank)")
        targets = self.lora_targets
        if not isinstance(targets, tuple) or not targets:
            bad("lora_targets", f"must be a non-empty tuple of names from {LORA_TARGETS}")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or len(set(targets)) != len(targets):
            bad("lora_targets", f"unknown or repeated {unknown or targets}; known: {LORA_TARGETS}")
        mlp = [t for t in targets if t in LORA_MLP_TARGETS]
        if mlp and self.num_moe_layers:
            bad(
                "lora_targets",
                f"{mlp} on a Mixture-of-Experts model: LoRA on MoE experts is not supported; "
                f"adapt the attention projections {LORA_ATTENTION_TARGETS} only",
            )

    @property
    def lora_scale(self) -> float:
        """alpha / rank: the factor of the adapters' B(A x) (0 without LoRA)."""
        return float(self.lora_alpha) / self.lora_rank if self.lora_rank else 0.0

    def lora_rank_of(self, name: str) -> int:
        """The adapter rank of projection `name` (0: not adapted)."""
        return self.lora_rank if name in self.lora_targets else 0

    # ------------------------------------------------------------------ derived
    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE placement rule: MoE unless listed in mlp_only_layers, every
        decoder_sparse_step-th layer (1-based), when there are experts at all."""
        return (
            self.arch in MOE_ARCHS
            and self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def is_linear_layer(self, i: int) -> bool:
        """Layer i is a Gated DeltaNet layer (hybrid Qwen3.5), not full attention."""
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5: DeltaNet layers, gated attention, zero-centred RMSNorms."""
        return self.arch in HYBRID_ARCHS

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear_layer(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """Leading head dims RoPE rotates (head_dim unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers; routing arrays are stacked in this order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else dict(self.rope_scaling)["rope_type"]

    def rope_inv_freq_and_scale(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies [rotary_dim/2] (float32) and the cos/sin scale of RoPE for
        this model's `rope_scaling` (`rope.inv_freq_and_scale`: default, linear, yarn,
        llama3)."""
        return rope_lib.inv_freq_and_scale(
            self.rope_theta, self.rotary_dim, self.rope_scaling, self.max_position_embeddings
        )

    # --------------------------------------------------------------- HF mapping
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Reads a Hugging Face config.json dict (published-Qwen or transformers-5 spelling).

        `overrides` set the non-checkpoint fields (param_dtype, dtype, remat, moe_impl,
        attention_impl, scan_layers) or
        any other field. Raises ValueError naming the unsupported architecture / field.
        """
        hf = text_part(hf)
        model_type = hf.get("model_type")
        read = _HfReader(hf)
        _check_supported(hf, read)

        rope_theta, rope_scaling = rope_lib.parse_rope(hf)
        hidden, heads = read.count("hidden_size"), read.count("num_attention_heads")
        head_dim = read.count("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"hidden_size={hidden} does not split into num_attention_heads={heads} "
                    "heads (and there is no head_dim)"
                )
            head_dim = hidden // heads
        kv_heads = read.count("num_key_value_heads", heads)
        is_qwen3 = model_type in ("qwen3", "qwen3_moe")
        attention_bias = read.flag("attention_bias", False)
        eos = hf.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        eos_ids = tuple(read.token_id("eos_token_id", e) for e in eos_list)
        fields: dict[str, Any] = {
            "arch": model_type,
            "vocab_size": read.count("vocab_size"),
            "hidden_size": hidden,
            # Qwen3.5-MoE has no dense MLP width (hybrid_fields fills in the expert width).
            "intermediate_size": read.count(
                "intermediate_size", 1 if model_type == "qwen3_5_moe" else _HfReader._REQUIRED
            ),
            "num_layers": read.count("num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "rope_theta": read.positive("rope_theta", rope_theta),
            "rope_scaling": rope_scaling,
            "rms_norm_eps": read.positive("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": read.flag("tie_word_embeddings", False),
            # Qwen2 hard-codes bias on q/k/v (not o); Qwen3 and Llama follow attention_bias
            # on all four.
            "qkv_bias": True if model_type == "qwen2" else attention_bias,
            "o_bias": False if model_type == "qwen2" else attention_bias,
            "qk_norm": is_qwen3,
            "max_position_embeddings": read.count("max_position_embeddings", 32768),
            "bos_token_id": read.token_id("bos_token_id", hf.get("bos_token_id")),
            "eos_token_ids": eos_ids,
            "pad_token_id": read.token_id("pad_token_id", hf.get("pad_token_id")),
        }
        if model_type in HYBRID_ARCHS:
            fields.update(hybrid_fields(hf, read, fields["num_layers"]))
        if model_type == "llama":
            _check_llama(hf, read)
        if model_type == "qwen3_moe":
            num_experts = hf.get("num_experts", hf.get("num_local_experts"))
            if num_experts is None:
                raise ValueError("config.json for 'qwen3_moe' lacks num_experts/num_local_experts")
            key = "num_experts" if "num_experts" in hf else "num_local_experts"
            fields.update(
                num_experts=read.count(key),
                num_experts_per_tok=read.count("num_experts_per_tok"),
                moe_intermediate_size=read.count("moe_intermediate_size"),
                norm_topk_prob=read.flag("norm_topk_prob", False),
                decoder_sparse_step=read.count("decoder_sparse_step", 1),
                mlp_only_layers=tuple(
                    read.integer("mlp_only_layers", i) for i in (hf.get("mlp_only_layers") or [])
                ),
            )
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads="
                f"{kv_heads} (grouped-query attention shares each key/value head among "
                "whole groups)"
            )
        fields.update(overrides)
        _check_ids_and_layers(fields, model_type)
        return cls(**fields)

    def to_hf_config(self, dtype: str | None = None) -> dict[str, Any]:
        """The config.json dict transformers 5.23 writes for this model (same keys).

        `dtype`: the checkpoint dtype to record (default: param_dtype).
        """
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dict(self.rope_scaling))
        eos = self.eos_token_ids
        hf: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.arch]],
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "dtype": dtype or self.param_dtype,
            "eos_token_id": None if not eos else (eos[0] if len(eos) == 1 else list(eos)),
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": self.arch,
            "num_attention_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "pad_token_id": self.pad_token_id,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": dict(sorted(rope.items())),
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "transformers_version": "5.23.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        if self.is_hybrid:
            hf.update(hybrid_hf(self))
            drop = ["max_window_layers", "sliding_window", "use_sliding_window"]
            drop += ["intermediate_size"] if self.arch == "qwen3_5_moe" else []
            for key in drop:
                hf.pop(key, None)
            return dict(sorted(hf.items()))
        if self.arch == "llama":
            if self.qkv_bias != self.o_bias or self.qk_norm:
                raise ValueError("llama needs qkv_bias == o_bias and qk_norm=False")
            for key in ("sliding_window", "use_sliding_window"):
                hf.pop(key)
            hf.update(attention_bias=self.qkv_bias, head_dim=self.head_dim, mlp_bias=False)
            hf["pretraining_tp"] = 1
            return dict(sorted(hf.items()))
        if self.arch in ("qwen2", "qwen3"):
            hf["layer_types"] = ["full_attention"] * self.num_layers
            hf["max_window_layers"] = self.num_layers
        else:
            if self.qkv_bias != self.o_bias:
                raise ValueError("qwen3_moe has one attention_bias for q/k/v/o")
        if self.arch == "qwen2":
            if not self.qkv_bias or self.o_bias or self.qk_norm:
                raise ValueError("qwen2 needs qkv_bias=True, o_bias=False, qk_norm=False")
            if self.head_dim != self.hidden_size // self.num_heads:
                hf["head_dim"] = self.head_dim
        else:
            if self.qkv_bias != self.o_bias or not self.qk_norm:
                raise ValueError(f"{self.arch} needs qkv_bias == o_bias and qk_norm=True")
            hf["attention_bias"] = self.qkv_bias
            hf["head_dim"] = self.head_dim
        if self.arch == "qwen3_moe":
            hf.update(
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                num_experts_per_tok=self.num_experts_per_tok,
                num_local_experts=self.num_experts,
                output_router_logits=False,
                router_aux_loss_coef=0.001,
            )
        return dict(sorted(hf.items()))


def _check_supported(hf: dict[str, Any], read) -> None:
    """The architecture and the features a config.json asks for are ones implemented here."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type not in ARCHS:
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r}, "
            f"architectures={architectures!r}; supported model_type: {ARCHS}"
        )
    expected = HF_ARCHITECTURES[model_type]
    if architectures and list(architectures) != [expected]:
        raise ValueError(
            f"unsupported architecture: architectures={architectures!r} for "
            f"model_type={model_type!r}; only [{expected!r}] (causal LM) is supported"
        )

    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act={act!r} (only 'silu' / SwiGLU)")
    if read.flag("use_sliding_window", False):
        raise ValueError(
            f"unsupported: use_sliding_window=true (sliding_window={hf.get('sliding_window')})"
            " — sliding-window attention is not implemented"
        )
    if model_type in HYBRID_ARCHS:
        return  # layer types and partial rotary: hybrid_config.hybrid_fields
    layer_types = hf.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"unsupported layer_types {other}: only 'full_attention' layers")
    partial = hf.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"unsupported partial_rotary_factor={partial!r} (only 1.0)")


def _check_llama(hf: dict[str, Any], read) -> None:
    """What Llama's config.json may ask for that the decoder does not do: MLP biases and
    the tensor-parallel pretraining split of the projections."""
    if read.flag("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=true for llama (the MLP has no biases here)")
    tp = hf.get("pretraining_tp", 1)
    if tp not in (None, 1):
        raise ValueError(f"unsupported pretraining_tp={tp!r} for llama (only 1)")


def _check_ids_and_layers(fields: dict[str, Any], model_type: str) -> None:
    """Token ids inside the vocabulary; MoE layer indices inside the model."""
    vocab = fields["vocab_size"]
    for key in ("bos_token_id", "pad_token_id"):
        if fields[key] is not None and not fields[key] < vocab:
            raise ValueError(f"{key}={fields[key]} is outside the vocabulary [0, {vocab})")
    for eos in fields["eos_token_ids"]:
        if not eos < vocab:
            raise ValueError(f"eos_token_id={eos} is outside the vocabulary [0, {vocab})")
    step = fields.get("decoder_sparse_step", 1)
    if model_type == "qwen3_moe" and step > fields["num_layers"]:
        raise ValueError(
            f"decoder_sparse_step={step} exceeds num_hidden_layers={fields['num_layers']}: "
            "no layer would hold the experts"
        )
    for i in fields.get("mlp_only_layers", ()):
        if not i < fields["num_layers"]:
            raise ValueError(
                f"mlp_only_layers lists layer {i}, but num_hidden_layers={fields['num_layers']}"
            )
