"""Rollout correction (docs/rollout_correction.md): a stop-gradient weight of
ρ = π_old / μ (the trainer's π_old over the sampler's μ) on the policy loss, truncated
(`tis`) or masking (`mask`), per token or per sequence; kept apart from the GSPO ratio and
its clip. `objectives.policy_loss` applies it.
"""

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.masked import masked_mean, row_mean

Array = jax.Array


ROLLOUT_CORRECTIONS = ("none", "tis", "mask")
ROLLOUT_CORRECTION_LEVELS = ("token", "seq")


def rollout_correction_weights(
    old_logprobs: Array,
    sampler_logprobs: Array,
    mask: Array,
    *,
    mode: str,
    level: str,
    threshold: float,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """Stop-gradient weight [B, T] correcting for tokens drawn from the sampler μ rather than
    from the trainer's π_old (docs/rollout_correction.md), and its metrics.

        token:  log ρ_t = log π_old(y_t) − log μ(y_t)                    per valid token
        seq:    log ρ_i = (1/|y_i|) Σ_t m_t (log π_old − log μ)           (geometric mean,
                broadcast to the sequence's tokens; never exp of the sum, which is ~0 or
                ~∞ for long responses)
        tis:    w = min(ρ, C)                    (truncated importance sampling)
        mask:   w = ρ if 1/C <= ρ <= C, else 0   (outliers dropped; ρ kept inside)

    with C = `threshold` (> 1; inf: no cap) and log ρ clamped to ±`log_ratio_clamp` before
    exp. Masked positions get weight 0 and may hold garbage (-inf, NaN). Neither π_old nor μ
    depends on the params, so the weight carries no gradient.

    Metrics (declared in `policy_metric_reductions`; over valid tokens for `token`, over
    valid sequences for `seq`): correction/weight_mean (after the cap or mask),
    correction/weight_mean_raw, correction/weight_min_raw and correction/weight_max_raw (ρ
    before it), correction/capped_frac (tis: ρ > C) or correction/masked_frac (mask: ρ
    outside [1/C, C]).
    """
    choice_of("rollout_correction", mode, ROLLOUT_CORRECTIONS[1:])
    choice_of("rollout_correction_level", level, ROLLOUT_CORRECTION_LEVELS)
    if isinstance(threshold, int | float) and not threshold > 1.0:
        raise ValueError(f"rollout_correction_threshold must be > 1, got {threshold}")
    if old_logprobs.shape != mask.shape or sampler_logprobs.shape != mask.shape:
        raise ValueError(
            f"rollout_correction_weights: old_logprobs {old_logprobs.shape}, sampler_logprobs "
            f"{sampler_logprobs.shape} and mask {mask.shape} must all be [B, T]"
        )
    sg = jax.lax.stop_gradient
    mask_BT = jnp.asarray(mask, jnp.float32)
    valid_BT = mask_BT > 0
    old_BT = jnp.where(valid_BT, sg(old_logprobs).astype(jnp.float32), 0.0)
    mu_BT = jnp.where(valid_BT, sg(sampler_logprobs).astype(jnp.float32), 0.0)
    log_rho_BT = old_BT - mu_BT
    if level == "seq":
        log_rho_BT = jnp.where(valid_BT, row_mean(log_rho_BT, mask_BT)[:, None], 0.0)
    log_rho_BT = jnp.clip(log_rho_BT, -log_ratio_clamp, log_ratio_clamp)
    rho_BT = jnp.where(valid_BT, jnp.exp(log_rho_BT), 1.0)
    if mode == "tis":
        out_BT = valid_BT & (rho_BT > threshold)
        weight_BT = jnp.minimum(rho_BT, threshold)
    else:
        out_BT = valid_BT & ((rho_BT < 1.0 / threshold) | (rho_BT > threshold))
        weight_BT = jnp.where(out_BT, 0.0, rho_BT)
    weight_BT = jnp.where(valid_BT, weight_BT, 0.0)
    metrics = _correction_metrics(mode, level, mask_BT, rho_BT, weight_BT, out_BT)
    return sg(weight_BT), metrics


def choice_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not one of {list(valid)}")


def _correction_metrics(mode, level, mask_BT, rho_BT, weight_BT, out_BT) -> dict[str, Array]:
    """`rollout_correction_weights`' metrics: per token, or per sequence (a sequence's
    tokens share its value, so its first valid token stands for it)."""
    valid_BT = mask_BT > 0
    if level == "seq":
        first_BT = valid_BT & (jnp.cumsum(mask_BT > 0, axis=-1) == 1)
        count_BT = first_BT.astype(jnp.float32)
    else:
        count_BT = mask_BT
    counted_BT = count_BT > 0
    any_counted = jnp.any(counted_BT)
    metrics = {
        "correction/weight_mean": masked_mean(weight_BT, count_BT),
        "correction/weight_mean_raw": jnp.where(any_counted, masked_mean(rho_BT, count_BT), 1.0),
        "correction/weight_min_raw": jnp.where(
            any_counted, jnp.min(jnp.where(counted_BT, rho_BT, jnp.inf)), 1.0
        ),
        "correction/weight_max_raw": jnp.where(
            any_counted, jnp.max(jnp.where(counted_BT, rho_BT, -jnp.inf)), 1.0
        ),
        f"correction/{'capped' if mode == 'tis' else 'masked'}_frac": masked_mean(
            out_BT.astype(jnp.float32), count_BT
        ),
    }
    return {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}


def correction_args(
    sampler_logprobs, mode: str, *, level: str, threshold, log_ratio_clamp: float
) -> dict | None:
    """`rollout_correction_weights`' arguments, or None without a correction."""
    choice_of("rollout_correction", mode, ROLLOUT_CORRECTIONS)
    if mode == "none":
        if sampler_logprobs is not None:
            raise ValueError(
                "policy_loss: sampler_logprobs given with rollout_correction='none' (they "
                "would be ignored); pass rollout_correction='tis' or 'mask' to use them"
            )
        return None
    if sampler_logprobs is None:
        raise ValueError(f"policy_loss: rollout_correction={mode!r} needs sampler_logprobs")
    return {
        "sampler_logprobs": sampler_logprobs,
        "mode": mode,
        "level": level,
        "threshold": threshold,
        "log_ratio_clamp": log_ratio_clamp,
    }
