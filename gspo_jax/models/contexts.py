"""Attention contexts of the full-sequence passes.

What differs between the full-sequence pass, the cached prefill and the one-token decode
step is only which keys each query attends to and what is stored for later: that is the
*attention context*, a callable `(layer_data, q, k, v) -> (out, cache_entry)` the decoder
hands to every block (decoder.py). `layer_data` is this layer's slice of the context's own
per-layer arrays (`context.layer_data`, leading layer axis, or None). This module holds
the full-sequence contexts; kv_cache.py has the decode step's.

Shape letters: B batch, L tokens, N prompts, S tokens of a shared-prompt row, H query
heads, K kv heads, C head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gspo_jax.models.attention import (
    attend,
    attend_shared_prompt,
    causal_allowed,
    packed_allowed,
    resolve_impl,
    self_attention,
)
from gspo_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SelfAttention:
    """Attention context of a full-sequence pass: each query attends to this call's real
    keys at or before it (`attention.self_attention` with implementation `impl`); the
    layer's cache entry is its (k [B, L, K, C], v [B, L, K, C]) when `keep_kv` (what
    `kv_cache.prefill_shared` stores), else None."""

    mask_BL: jax.Array
    impl: str
    keep_kv: bool = False
    allowed_BLS: jax.Array | None = None  # built once for "xla" (see `full_context`)
    layer_data = None  # nothing per layer

    def __call__(self, layer_data, q_BLHC, k_BLKC, v_BLKC):
        del layer_data
        dtype = q_BLHC.dtype
        k_BLKC, v_BLKC = k_BLKC.astype(dtype), v_BLKC.astype(dtype)
        out = self_attention(self.impl, q_BLHC, k_BLKC, v_BLKC, self.mask_BL, self.allowed_BLS)
        return out, ((k_BLKC, v_BLKC) if self.keep_kv else None)

    def linear(self, layer_data):
        """A Gated DeltaNet layer's context (block.py): this call's mask, no state carried
        in, the chunked form; its final (conv window, state) kept when `keep_kv`."""
        del layer_data
        return self.mask_BL, None, self.keep_kv, False


def full_context(cfg: ModelConfig, mask_BL, *, keep_kv: bool = False) -> SelfAttention:
    """The `SelfAttention` context of `cfg.attention_impl` for a batch with this mask."""
    impl = resolve_impl(cfg.attention_impl, dtype=cfg.dtype)
    allowed = causal_allowed(mask_BL) if impl == "xla" else None
    return SelfAttention(mask_BL, impl, keep_kv, allowed)


@dataclasses.dataclass(frozen=True)
class SharedPromptAttention:
    """Attention context of the shared-prompt full-sequence pass (`hidden_states_shared`):
    row n of the call holds prompt n's P tokens, then its G responses of T tokens
    (`attention.attend_shared_prompt`). Always the einsum arithmetic (`attend`'s), whatever
    `attention_impl` says; no cache entry."""

    prompt_mask_NP: jax.Array
    response_mask_NGT: jax.Array
    layer_data = None  # nothing per layer

    def __call__(self, layer_data, q_NSHC, k_NSKC, v_NSKC):
        del layer_data
        dtype = q_NSHC.dtype
        out = attend_shared_prompt(
            q_NSHC,
            k_NSKC.astype(dtype),
            v_NSKC.astype(dtype),
            self.prompt_mask_NP,
            self.response_mask_NGT,
        )
        return out, None

    def linear(self, layer_data):
        raise ValueError(
            "hidden_states_shared: a hybrid (Gated DeltaNet) model's responses cannot share "
            "their prompt's row (each needs the prompt's recurrent state); use hidden_states"
        )


@dataclasses.dataclass(frozen=True)
class PackedAttention:
    """Attention context of a packed pass (`hidden_states_packed`): each row holds several
    segments (a prompt, then one or more responses to it), and a query sees the keys at or
    before it of its own segment's prompt and its own response (`attention.packed_allowed`).
    "splash" runs the kernel with the segment ids (causal within a segment: one response
    per segment); every other implementation runs `attend` with the mask built once. A
    hybrid model's Gated DeltaNet layers restart their state and conv window at each
    segment's first token (`reset_BL`; a segment then holds one response: `shared_group`
    is 1 for them)."""

    segment_BL: jax.Array
    impl: str
    allowed_BLS: jax.Array | None = None
    layer_data = None  # nothing per layer

    def __call__(self, layer_data, q_BLHC, k_BLKC, v_BLKC):
        del layer_data
        dtype = q_BLHC.dtype
        k_BLKC, v_BLKC = k_BLKC.astype(dtype), v_BLKC.astype(dtype)
        if self.impl == "splash":
            return self_attention("splash", q_BLHC, k_BLKC, v_BLKC, self.segment_BL), None
        return attend(q_BLHC, k_BLKC, v_BLKC, self.allowed_BLS), None

    def linear(self, layer_data):
        """A Gated DeltaNet layer's context: real slots, no state carried in, the chunked
        form, and a fifth value, the segment starts (block.py)."""
        del layer_data
        return self.segment_BL > 0, None, False, False, segment_starts(self.segment_BL)


def segment_starts(segment_BL):
    """True at each slot whose segment id differs from the slot before (and at slot 0)."""
    changed = segment_BL[:, 1:] != segment_BL[:, :-1]
    return jnp.concatenate([jnp.ones_like(changed[:, :1]), changed], axis=1)


def packed_context(cfg: ModelConfig, segment_BL, member_BL) -> PackedAttention:
    """The `PackedAttention` of `cfg.attention_impl`: splash keeps its kernel (segment ids),
    everything else (xla, and cudnn, which masks by lengths only) the einsum path."""
    impl = resolve_impl(cfg.attention_impl, dtype=cfg.dtype)
    if impl == "splash":
        return PackedAttention(segment_BL, impl)
    return PackedAttention(segment_BL, "xla", packed_allowed(segment_BL, member_BL))
