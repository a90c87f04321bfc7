"""KL estimators (k1, k2, k3, low_var_kl) and `kl_penalty`, the per-token KL term of the
loss (`use_kl_loss`) and of the token-level KL reward (`add_token_level_kl`). Public as
`gspo_jax.objectives.kl_penalty`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gspo_jax.registry import Registry

Array = jax.Array

# name -> fn(log_ratio_BT) -> kl_BT, with log_ratio = logprobs − ref_logprobs.
KL_ESTIMATORS: Registry[Callable[[Array], Array]] = Registry("kl_estimator")


def register_kl_estimator(name: str):
    """Decorator registering `fn(log_ratio_BT) -> kl_BT` as kl_estimator `name`."""
    return KL_ESTIMATORS.decorator(name)


# ---------------------------------------------------------------------------------------------
# KL estimators.
# ---------------------------------------------------------------------------------------------


@register_kl_estimator("k1")
def _kl_k1(log_ratio_BT: Array) -> Array:
    """k1 = log π_θ − log π_ref."""
    return log_ratio_BT


@register_kl_estimator("k2")
def _kl_k2(log_ratio_BT: Array) -> Array:
    """k2 = ½ (log π_θ − log π_ref)²."""
    return 0.5 * jnp.square(log_ratio_BT)


@register_kl_estimator("k3")
def kl_k3(log_ratio_BT: Array) -> Array:
    """k3 = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1  (≥ 0)."""
    neg_BT = -log_ratio_BT
    # expm1 keeps k3 accurate (and exactly >= 0 in practice) for small log-ratios.
    return jnp.expm1(neg_BT) - neg_BT


@register_kl_estimator("low_var_kl")
def _kl_low_var(log_ratio_BT: Array) -> Array:
    """k3 with the log-ratio clamped to [−20, 20] and the result clamped to [−10, 10] (verl)."""
    return jnp.clip(kl_k3(jnp.clip(log_ratio_BT, -20.0, 20.0)), -10.0, 10.0)


def kl_penalty(
    logprobs: Array, ref_logprobs: Array, estimator: str, *, mask: Array | None = None
) -> Array:
    """Per-token KL(π_θ ‖ π_ref) estimate [B, T] from samples of π_θ (Schulman's k1/k2/k3).

    With d = log π_θ − log π_ref, over samples y ~ π_θ:
      k1 = d                      unbiased as a value (high variance, can be negative); as a
                                  loss its expected gradient is E[∇ log π_θ] = 0
      k2 = ½ d²                   biased as a value; as a loss its expected gradient
                                  E[d ∇ log π_θ] is that of KL(π_θ ‖ π_ref) itself
      k3 = exp(−d) + d − 1        unbiased as a value, ≥ 0; as a loss its expected gradient
                                  is −E_{π_ref}[∇ log π_θ] = ∇ KL(π_ref ‖ π_θ), the forward
                                  KL's gradient
      low_var_kl = clip(k3(clip(d, −20, 20)), −10, 10)   (verl's bounded k3)
    (In the train step the samples come from π_old, so these hold up to that off-policy gap.)

    `mask` (optional, [B, T]): positions with mask 0 give 0 and carry no gradient, even when
    their inputs are -inf/NaN.
    """
    kl = KL_ESTIMATORS.get(estimator)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs {logprobs.shape} and ref_logprobs {ref_logprobs.shape} differ"
        )
    logprobs = logprobs.astype(jnp.float32)
    ref_logprobs = ref_logprobs.astype(jnp.float32)
    if mask is None:
        return kl(logprobs - ref_logprobs)
    valid = jnp.asarray(mask) > 0
    log_ratio = jnp.where(valid, logprobs, 0.0) - jnp.where(valid, ref_logprobs, 0.0)
    return jnp.where(valid, kl(log_ratio), 0.0)
