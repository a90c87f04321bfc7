"""Qwen3-MoE's router load-balancing loss (Switch Transformer eqs. 4-6), as transformers'
`qwen3_moe.load_balancing_loss_func` computes it and `Qwen3MoeForCausalLM` adds it to the
loss times `config.router_aux_loss_coef`:

    F_e  = (Σ_layers Σ_valid rows [e ∈ top-k of the row]) / R       (not differentiated)
    P_e  = (Σ_layers Σ_valid rows softmax(router logits)_e) / R
    loss = E · Σ_e F_e · P_e,        R = layers × valid rows

F and P pool every layer's rows before the product (not a mean of per-layer losses), so a
caller accumulates `router_load_stats` over layers and calls `load_balancing_loss` once.
Uniform routing gives loss = k (F_e = k/E, P_e = 1/E); the loss grows as routing
concentrates. Only P carries gradient (top-k membership is discrete).

Where it is used: with `model.router_aux_loss_coef` > 0 the MoE layer (`layers.MoE`)
returns its `router_load_stats` beside its routing, the layer stack sums them over layers
(`layer_stack.apply_layers`), and the train step (`train_step/step.py`) and the supervised
warm start (`trainer/warm_start.py`) add `router_aux_loss_coef · load_balancing_loss` to
their losses. Only real tokens count (the attention mask).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def router_load_stats(logits_JE, k: int, mask_J=None, *, chosen_JX=None):
    """(counts [E], prob sums [E], rows) of one layer: how often each expert is in a valid
    row's top-k, the sum of its router probability over valid rows, the valid rows.
    logits_JE: [J, E] router logits; mask_J: [J] 1 for a valid row (None: all valid);
    chosen_JX: [J, k] the top-k expert indices when the caller has them already (the MoE
    layer's own routing), else computed here."""
    if logits_JE.ndim != 2:
        raise ValueError(f"router logits must be [rows, experts], got shape {logits_JE.shape}")
    J, E = logits_JE.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k k={k} must be in [1, {E}] for {E} experts")
    m_J = jnp.ones((J,), F32) if mask_J is None else mask_J.astype(F32)
    probs_JE = jax.nn.softmax(logits_JE.astype(F32), axis=-1)
    idx_JX = jax.lax.top_k(probs_JE, k)[1] if chosen_JX is None else chosen_JX
    chosen_JE = jnp.sum(jax.nn.one_hot(idx_JX, E, dtype=F32), axis=1)  # 1 where chosen
    counts_E = jnp.sum(jax.lax.stop_gradient(chosen_JE) * m_J[:, None], axis=0)
    probs_E = jnp.sum(probs_JE * m_J[:, None], axis=0)
    return counts_E, probs_E, jnp.sum(m_J)


def load_balancing_loss(counts_E, probs_E, rows):
    """E · Σ_e (counts_e / rows) · (probs_e / rows) from stats summed over layers (0 when
    no row is valid)."""
    E = counts_E.shape[-1]
    safe = jnp.maximum(rows, 1.0)
    return E * jnp.sum((counts_E / safe) * (probs_E / safe)) * (rows > 0)


def load_balancing_loss_from_logits(logits_LJE, k: int, mask_J=None):
    """The loss of every layer's router logits [layers, J, E] (one mask for all layers)."""
    stats = [router_load_stats(logits_LJE[i], k, mask_J) for i in range(logits_LJE.shape[0])]
    counts, probs, rows = (sum(s[j] for s in stats) for j in range(3))
    return load_balancing_loss(counts, probs, rows)
