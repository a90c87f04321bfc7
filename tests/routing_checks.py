"""A test-side diagnostic of MoE routing: how many routing decisions differ between two
parameter sets (tests/models/test_models_moe.py, tests/train_step/test_routing_replay.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gspo_jax import models
from gspo_jax.models import ModelConfig

F32 = jnp.float32


@functools.partial(jax.jit, static_argnums=0)
def routing_disagreement(model_config: ModelConfig, params_a, params_b, tokens, attention_mask):
    """Fraction of routing decisions that differ between two parameter sets (paper §5.3).

    Each model routes the same tokens with its own hidden states; per valid token and MoE
    layer the k chosen experts are compared as sets:
        1 − Σ_{m,b,l} mask·|top_a ∩ top_b| / (k · M · Σ mask).
    """
    if model_config.num_moe_layers == 0:
        raise ValueError(f"routing_disagreement needs an MoE model, got arch={model_config.arch!r}")
    _, idx_a = models.hidden_states(model_config, params_a, tokens, attention_mask)
    _, idx_b = models.hidden_states(model_config, params_b, tokens, attention_mask)
    same = jnp.any(idx_a[..., :, None] == idx_b[..., None, :], axis=-1).sum(-1)  # [M, B, L]
    mask = attention_mask.astype(F32)
    kept = jnp.sum(same.astype(F32) * mask[None])
    total = model_config.num_experts_per_tok * model_config.num_moe_layers * jnp.sum(mask)
    return 1.0 - kept / jnp.maximum(total, 1.0)
