"""RoPE's frequencies from a config.json: which scalings are read, and their inverse
frequencies, in float32 arithmetic that mirrors transformers (logits agree to ~1e-6).

Supported `rope_type`s: "default" (stored as None), "linear", "yarn" (the long-context
recipe of the Qwen2.5 / Qwen3 model cards) and "llama3" (Llama 3.1+). "dynamic" NTK
depends on the running sequence length and "longrope" is Phi's; both are refused, naming
the type.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gspo_jax.models.hf_fields import HfReader

ROPE_TYPES = ("linear", "yarn", "llama3")
# Keys allowed inside a rope dict, per type (besides rope_type/type/rope_theta).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}
_REQUIRED = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def parse_rope(hf: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, hashable rope_scaling) from either HF spelling (`rope_parameters`,
    transformers 5, or `rope_scaling`)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise TypeError(f"unsupported rope_parameters/rope_scaling={params!r} (expected a dict)")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"unsupported per-layer-type rope_parameters {sorted(params)}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"unsupported rope type {kind!r} in rope_parameters/rope_scaling; "
            f"supported: {sorted(_ROPE_KEYS)}"
        )
    extra = set(params) - {"rope_type", "type", "rope_theta"} - _ROPE_KEYS[kind]
    extra -= {"partial_rotary_factor"} if params.get("partial_rotary_factor") in (1, 1.0) else set()
    if extra:
        raise ValueError(f"unsupported keys {sorted(extra)} for rope type {kind!r}")
    if kind == "default":
        return theta, None
    scaling = {k: params[k] for k in _ROPE_KEYS[kind] if params.get(k) is not None}
    for key in ("factor", *_REQUIRED.get(kind, ())):
        if key not in scaling:
            raise ValueError(f"rope type {kind!r} needs {key!r}")
    for key in ("factor", "original_max_position_embeddings", "attention_factor"):
        if key in scaling:
            HfReader(hf).positive(f"rope scaling {key}", scaling[key])
    if kind == "llama3" and not 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError(
            "rope type 'llama3' needs 0 < low_freq_factor < high_freq_factor, got "
            f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}"
        )
    if kind == "yarn":
        scaling.setdefault(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 32768)
        )
    scaling["rope_type"] = kind
    return theta, tuple(sorted(scaling.items()))


def inv_freq_and_scale(
    theta: float, d: int, rope_scaling, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """Inverse frequencies [d/2] (float32) and the cos/sin scale of RoPE over `d` rotated
    dimensions.

    default: inv_freq_i = θ^(-2i/d).
    linear:  inv_freq_i / factor (positions interpolated by `factor`).
    yarn (arXiv 2309.00071): per dimension, blend interpolated (inv/factor) and
        extrapolated (inv) frequencies with a linear ramp between the dims whose
        wavelength makes beta_fast resp. beta_slow rotations over the original
        context; cos/sin scaled by attention_factor (default 0.1·ln(factor)+1).
    llama3: wavelengths 2π/inv longer than original / low_freq_factor are divided by
        `factor`, shorter than original / high_freq_factor kept, and those between
        blended with weight s = (original / wavelength − low) / (high − low).
    """
    base = np.float32(theta)
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    pos_freqs = base**exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    rope = {} if rope_scaling is None else dict(rope_scaling)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(rope["factor"])
    if kind == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, rope), 1.0
    return _yarn(inv_freq, pos_freqs, factor, rope, theta, d, max_position_embeddings)


def _llama3(inv_freq: np.ndarray, factor: float, rope: dict) -> np.ndarray:
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / np.float32(factor), inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn(inv_freq, pos_freqs, factor, rope, theta, d, max_position_embeddings):
    original = rope.get("original_max_position_embeddings") or max_position_embeddings

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (d * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    interp = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv = interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv.astype(np.float32), float(attention_factor)
