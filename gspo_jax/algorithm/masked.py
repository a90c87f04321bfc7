"""Masked reductions, written once for the math modules and the loop that reports them.

A position with mask 0 may hold anything (padding, -inf, NaN): it is replaced by 0 with a
`where` *before* any arithmetic (the "safe where" pattern), so neither values nor gradients
see it, and an empty selection divides by 1 instead of 0 (its numerator is 0 too).

Shape letters: B rows (responses), T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def safe_count(count: Array) -> Array:
    """A count used as a divisor, as float32: 1 where it is 0."""
    count = jnp.asarray(count, jnp.float32)
    return jnp.where(count > 0, count, 1.0)


def masked_mean(x: Array, mask: Array) -> Array:
    """Σ m·x / Σ m over every axis: the mean of the valid entries (0 when none is valid)."""
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / safe_count(jnp.sum(mask))


def row_mean(x_BT: Array, mask_BT: Array) -> Array:
    """(1/|y_b|) Σ_t m_bt·x_bt -> [B], with |y_b| = Σ_t m_bt: the per-sequence mean.

    This is GSPO's length normalisation (paper §4.1): log s_i is the row mean of the
    token log-ratios. A row with no valid token gives 0, never NaN, and no gradient.
    """
    total_B = jnp.sum(jnp.where(mask_BT > 0, x_BT, 0.0), axis=-1)
    return total_B / safe_count(jnp.sum(mask_BT, axis=-1))
