"""The continuous engine's per-slot Gated DeltaNet states (hybrid Qwen3.5 models).

A hybrid model's full-attention layers keep keys/values in the page pools as any model's
do (pages for those layers only); each Gated DeltaNet layer keeps, per decode slot, its
conv window [S, K−1, channels] (compute dtype) and recurrent state [S, heads, d_k, d_v]
(float32), next to the pools in the loop's carry: `EngineState.kv` is then the pair
(pools, slot states), as `models.decode_step_paged` takes and returns it.

The prefill leaves each prompt's states after its last token ([Q, ...], `PromptCache.linear`);
the G sequences of a prompt share them as they share its pages: a slot that takes a
sequence (a first admission, a refill after its last sequence ended, a preempted sequence
coming back) copies its prompt's states in (`reset`), so no state of the slot's previous
sequence survives; a slot that does not decode in a step (idle, stalled for a page)
keeps the states it had (`keep`). For a model with no DeltaNet layer every function
here is the identity on the engine's own structures (its pools, no slot states), so the
engine's program is unchanged.

Shape letters: Q prompt rows, S slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gspo_jax.models import partition


def split(cfg, prompt_pages):
    """(page pools per full-attention layer, the prompts' DeltaNet states per linear layer:
    () for a model without such layers)."""
    return prompt_pages if cfg.is_hybrid else (prompt_pages, ())


def prompt_rows(cfg, prompt_pages, logits_QV):
    """(the prompts' last logits, their DeltaNet states: `split`'s), rows laid out as the
    rules in force lay rows out (whole within one of the engine's replicas). The loop
    gathers them by slot every step; left split over a mesh axis the slots are not, XLA
    all-reduced the gathered rows every step (Qwen3.5-35B-A3B on v5p-128: 67 MB per
    DeltaNet layer per step, over the expert axis)."""

    def rows(x):
        return partition.constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    return jax.tree.map(rows, (logits_QV, split(cfg, prompt_pages)[1]))


def initial(cfg, pools, prompt_states, S: int):
    """The engine's `kv` at the start: the pools, and for a hybrid model zeroed states for
    S slots (each of its prompt states' dtype and trailing shape)."""
    if not cfg.is_hybrid:
        return pools
    return pools, jax.tree.map(lambda x: jnp.zeros((S, *x.shape[1:]), x.dtype), prompt_states)


def map_pools(cfg, kv, fn):
    """`kv` with `fn` applied to its tuple of pools (the slot states untouched)."""
    return (fn(kv[0]), kv[1]) if cfg.is_hybrid else fn(kv)


def _where(rows_S, a, b):
    def pick(x, y):
        return jnp.where(rows_S.reshape(-1, *[1] * (x.ndim - 1)), x, y)

    return jax.tree.map(pick, a, b)


def after_decode(cfg, progress_S, new_kv, old_kv):
    """The decode step's `kv`, each slot's states kept from before where it did not decode
    (idle, or stalled for a page)."""
    if not cfg.is_hybrid:
        return new_kv
    return new_kv[0], _where(progress_S, new_kv[1], old_kv[1])


def admit(cfg, kv, admitted_S, prompt_S, prompt_states):
    """Admitted slots start from their prompt's states (prompt_S: each slot's prompt row)."""
    if not cfg.is_hybrid:
        return kv
    start = jax.tree.map(lambda x: x[prompt_S], prompt_states)
    return kv[0], _where(admitted_S, start, kv[1])


def compact(cfg, kv, order_W):
    """`kv` with only the slot states of the slots `order_W` (the drain's compaction)."""
    if not cfg.is_hybrid:
        return kv
    return kv[0], jax.tree.map(lambda x: x[order_W], kv[1])
