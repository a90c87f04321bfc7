"""LoRA: low-rank adapters on the frozen weights (Hu et al. 2021, arXiv 2106.09685).

A projection named in `ModelConfig.lora_targets` computes
y = x · W + (alpha / r) · (x · A) · B with A [*in, r], B [r, *out] (layers.py `Proj`). The
adapters are ordinary leaves of the params tree, beside the kernel they adapt and stacked
on the same leading layer axis: `layers/attn/q_proj/{kernel, lora_a, lora_b}`. A is drawn
uniform(±1/√fan_in) (PEFT's default), B is zero, so a fresh adapter leaves the model
exactly as it was.

What trains is the adapters (`partition`: frozen base, adapters); the optimizer state and
the checkpoints hold only them. The reference policy of a KL term is the base itself:
`adapters_off` zeroes B (arrays the size of the adapters), no second copy of the weights.
Export: `merged` folds W + (alpha/r)·A·B into a plain model for `save_pretrained`, and
`save_peft` writes the adapters alone in PEFT's layout (adapter_config.json +
adapter_model.safetensors, torch (out, in) tensors named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`).

Supported targets: attention q/k/v/o and the dense SwiGLU MLP's gate/up/down
(`config.LORA_TARGETS`); MoE experts and the router are not adapted (ModelConfig refuses
MLP targets on a MoE model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.hf_io import _tensor_specs
from gspo_jax.models.params import abstract_params, init_params

ADAPTER_KEYS = ("lora_a", "lora_b")


def partition(params) -> tuple[dict, dict]:
    """(frozen, adapters): the tree's leaves split by name, each half keeping the nested
    layout (empty branches dropped). Without adapters: ({}, params), so code written for
    LoRA trains every parameter of a plain model."""

    def walk(node):
        frozen, adapters = {}, {}
        for key, value in node.items():
            if isinstance(value, dict):
                f, a = walk(value)
                if f:
                    frozen[key] = f
                if a:
                    adapters[key] = a
            elif key in ADAPTER_KEYS:
                adapters[key] = value
            else:
                frozen[key] = value
        return frozen, adapters

    frozen, adapters = walk(params)
    return (frozen, adapters) if adapters else ({}, params)


def combine(frozen, adapters):
    """The inverse of `partition`: one tree holding both halves' leaves."""
    if not frozen:
        return adapters
    out = dict(frozen)
    for key, value in adapters.items():
        out[key] = combine(frozen[key], value) if isinstance(value, dict) else value
    return out


def trainable(params):
    """The leaves an optimizer updates: the adapters, or every leaf of a plain model."""
    return partition(params)[1]


def has_adapters(params) -> bool:
    return bool(partition(params)[0])


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The same model without adapters (the frozen base's config)."""
    return dataclasses.replace(cfg, lora_rank=0)


def adapters_off(params):
    """The base model's function from a LoRA tree: every B set to zeros (then B(A x) is
    exactly 0), the weights shared, not copied. π_ref of a KL term under LoRA."""
    frozen, adapters = partition(params)
    if not frozen:
        return params
    off = _map_adapters(adapters, lambda a, b: (a, jnp.zeros_like(b)))
    return combine(frozen, off)


def init_adapters(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Fresh adapters of `cfg` (A uniform ±1/√fan_in, B zeros), the tree `partition` gives.
    Jittable; under jit the base weights `init_params` also draws are dead code."""
    return partition(init_params(cfg, rng))[1]


def _map_adapters(adapters, fn):
    """fn(A, B) -> (A', B') on every {lora_a, lora_b} pair of an adapter tree."""
    if "lora_a" in adapters:
        a, b = fn(adapters["lora_a"], adapters["lora_b"])
        return {"lora_a": a, "lora_b": b}
    return {k: _map_adapters(v, fn) for k, v in adapters.items()}


def delta(kernel, a, b, scale: float):
    """(alpha/r)·A·B in the kernel's shape and dtype, over a leading layer axis:
    kernel [n, *in, *out], A [n, *in, r], B [n, r, *out]; computed in float32."""
    n, r = a.shape[0], a.shape[-1]
    a2 = a.astype(jnp.float32).reshape(n, -1, r)
    b2 = b.astype(jnp.float32).reshape(n, r, -1)
    return (scale * jnp.einsum("nir,nro->nio", a2, b2)).reshape(kernel.shape)


def merged(cfg: ModelConfig, params) -> tuple[ModelConfig, dict]:
    """(base config, params with W + (alpha/r)·A·B in place of each adapted kernel and no
    adapters): the fine-tuned model as a plain one (`save_pretrained`). Jittable."""
    if not cfg.lora_rank:
        return cfg, params

    def walk(node):
        if "lora_a" in node:
            out = {k: v for k, v in node.items() if k not in ADAPTER_KEYS}
            w = node["kernel"]
            d = delta(w, node["lora_a"], node["lora_b"], cfg.lora_scale)
            out["kernel"] = (w.astype(jnp.float32) + d).astype(w.dtype)
            return out
        return {k: walk(v) if isinstance(v, dict) else v for k, v in node.items()}

    return base_config(cfg), walk(params)


def adapter_count(cfg: ModelConfig) -> int:
    """Number of adapter parameters of `cfg` (0 without LoRA)."""
    adapters = trainable(abstract_params(cfg)) if cfg.lora_rank else {}
    return sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))


# ------------------------------------------------------------------------- PEFT export


def peft_config(cfg: ModelConfig, base_model: str = "") -> dict:
    """adapter_config.json of PEFT's LoraConfig for these adapters (scale = alpha / r)."""
    return {
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": float(cfg.lora_alpha),
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": cfg.lora_rank,
        "target_modules": sorted(cfg.lora_targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def peft_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """PEFT's state dict of the adapters: for each adapted projection of layer i,
    `base_model.model.<HF weight name without .weight>.lora_A.weight` = A as torch
    [r, in] and `....lora_B.weight` = B as [out, r] (float32 host arrays)."""
    out = {}
    for spec in _tensor_specs(base_config(cfg)):
        if spec.kind != "linear" or spec.path[0] != "layers" or spec.path[1] == "moe":
            continue
        node = params
        for key in spec.path[:-1]:
            node = node[key]
        if "lora_a" not in node:
            continue
        a = np.asarray(jax.device_get(node["lora_a"][spec.index]), np.float32)
        b = np.asarray(jax.device_get(node["lora_b"][spec.index]), np.float32)
        r = a.shape[-1]
        name = "base_model.model." + spec.hf_names[0].removesuffix(".weight")
        out[name + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
        out[name + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return out


def save_peft(cfg: ModelConfig, params, path: str, *, base_model: str = "") -> str:
    """Writes the adapters at `path` as PEFT does (adapter_config.json,
    adapter_model.safetensors). `params` must be addressable here (a multi-host run
    gathers them first); process 0 writes."""
    tensors = peft_tensors(cfg, params)
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(peft_config(cfg, base_model), f, indent=2)
            f.write("\n")
    return path
