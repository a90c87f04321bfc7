"""Policy-gradient objectives: the GSPO family of losses (GSPO / GSPO-token / GRPO clipping,
SAPO, CISPO, GMPO, DPPO, LUSPO, off-policy sequence masking), KL estimators, loss aggregation.

Where it sits: `train_step` computes per-token log-probs of the current policy, then calls
`policy_loss(logprobs, old_logprobs, advantages, mask, ...)` once per micro-batch and sums the
results (the mini-batch's global token / sequence counts are passed in, so the sum does not
depend on how the mini-batch is split). The optional KL and entropy terms are aggregated with
the same `aggregate_loss`. Everything here is a pure, jittable function of arrays; mode names
are static Python strings (close over them or mark them static in `jax.jit`).

Shape letters: B responses (sequences) in this call, T response tokens.

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (GSPO, §4). The
other members of the family (`loss_mode`) each cite theirs; docs/objectives.md is their page.

Masks: a position with mask 0 may hold anything in `logprobs` / `old_logprobs` (padding, -inf,
NaN). Inputs are replaced by 0 there *before* any arithmetic (the "safe where" pattern), so no
NaN/inf reaches the loss, the metrics or the gradients. A sequence whose mask is all zero never
counts in any denominator.

To add a mode, decorate a function with `register_importance_sampling(name,
sequence_level=...)`, `register_loss_mode(name)`, `register_loss_agg(name)` or
`register_kl_estimator(name)`; config
validation reads the live registries, so the name is valid from then on. A new metric of
`policy_loss` is declared in `policy_metric_reductions` (how it combines over micro-batches
and updates, gspo_jax/algorithm/reductions.py).
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.masked import masked_mean, row_mean, safe_count
from gspo_jax.algorithm.reductions import MAX, MIN, SEQ_MEAN, SUM, TOKEN_MEAN, Reduction
from gspo_jax.registry import Registry

Array = jax.Array

# ---------------------------------------------------------------------------------------------
# Registries (gspo_jax.registry): a name is valid in a config as soon as it is registered.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ratio:
    """An importance ratio. `log_ratio(logprobs_BT, old_logprobs_BT, mask_BT) -> log r [B, T]`
    gets inputs already sanitised (0 at masked positions, f32); the policy loss clamps and
    exponentiates it. `sequence_level`: one value per sequence (its metrics, ratio statistics
    and clipfrac_seq, are then over sequences, and GSPO's config checks apply to it)."""

    log_ratio: Callable[[Array, Array, Array], Array]
    sequence_level: bool


RATIOS: Registry[Ratio] = Registry("importance_sampling")
IMPORTANCE_SAMPLING_MODES = RATIOS  # the config field's name for the same registry
# name -> fn(masked_loss_BT, mask_BT, *, horizon, num_valid_tokens, num_valid_seqs) -> scalar.
LOSS_AGG_MODES: Registry[Callable[..., Array]] = Registry("loss_agg_mode")
# name -> fn(log_ratio_BT) -> kl_BT, with log_ratio = logprobs − ref_logprobs.
KL_ESTIMATORS: Registry[Callable[[Array], Array]] = Registry("kl_estimator")


def register_importance_sampling(name: str, *, sequence_level: bool):
    """Decorator registering a log-ratio function as importance_sampling `name`."""

    def decorator(fn):
        RATIOS.add(name, Ratio(fn, sequence_level))
        return fn

    return decorator


@dataclasses.dataclass(frozen=True)
class LossMode:
    """A per-token policy loss of the GSPO family (`loss_mode`). `loss(x: LossInputs) ->
    (loss [B, T], flags)` with flags "low" / "high" (bool [B, T]: the mode reduces or removes
    this token's gradient, for A < 0 / A > 0), "range" (bool [B, T]: outside the mode's
    trust region whatever the advantage's sign) and "weight" (f32 [B, T], no gradient: the
    token's gradient weight as the mode sets it, 1 for the plain policy gradient on policy).
    `token_ratio`: the mode reads token log-ratios (importance_sampling must be "token")."""

    loss: Callable[..., tuple[Array, dict[str, Array]]]
    token_ratio: bool = False


LOSS_MODES: Registry[LossMode] = Registry("loss_mode")


class LossInputs(NamedTuple):
    """What a loss mode sees, sanitised (0 at masked positions; f32): `logp` (log π_θ, the
    differentiated input), `old` (log π_old, constant), `log_ratio` (the importance_sampling
    ratio's log, clamped), `ratio` (its exp, 1 at masked positions), `adv` (A per token,
    constant), `valid` (bool), `mask`, and `hp` (the modes' hyper-parameters by name)."""

    logp: Array
    old: Array
    log_ratio: Array
    ratio: Array
    adv: Array
    valid: Array
    mask: Array
    hp: dict


def register_loss_mode(name: str, *, token_ratio: bool = False):
    """Decorator registering `fn(x: LossInputs) -> (loss_BT, flags)` as loss_mode `name`."""

    def decorator(fn):
        LOSS_MODES.add(name, LossMode(fn, token_ratio))
        return fn

    return decorator


def register_loss_agg(name: str):
    """Decorator registering an aggregation `fn(loss_BT, mask_BT, *, horizon,
    num_valid_tokens, num_valid_seqs) -> scalar` as loss_agg_mode `name`."""
    return LOSS_AGG_MODES.decorator(name)


def register_kl_estimator(name: str):
    """Decorator registering `fn(log_ratio_BT) -> kl_BT` as kl_estimator `name`."""
    return KL_ESTIMATORS.decorator(name)


def is_sequence_level(importance_sampling: str) -> bool:
    """Whether the registered ratio `importance_sampling` is one value per sequence."""
    return RATIOS.get(importance_sampling).sequence_level


def sequence_level_modes() -> tuple[str, ...]:
    """The registered sequence-level ratios, read live (GSPO and its relatives)."""
    return tuple(sorted(name for name, ratio in RATIOS.items() if ratio.sequence_level))


# ---------------------------------------------------------------------------------------------
# Small masked helpers.
# ---------------------------------------------------------------------------------------------


def _seq_token_counts(mask_BT: Array) -> Array:
    return jnp.sum(mask_BT, axis=-1)


# ---------------------------------------------------------------------------------------------
# Importance-sampling ratios (log form).
# ---------------------------------------------------------------------------------------------


@register_importance_sampling("token", sequence_level=False)
def token_log_ratio(logprobs_BT: Array, old_logprobs_BT: Array, mask_BT: Array) -> Array:
    """GRPO / PPO per-token ratio: log r_t = log π_θ(y_t|·) − log π_old(y_t|·)."""
    return jnp.where(mask_BT > 0, logprobs_BT - old_logprobs_BT, 0.0)


def _seq_log_ratio_B(logprobs_BT: Array, old_logprobs_BT: Array, mask_BT: Array) -> Array:
    return row_mean(logprobs_BT - old_logprobs_BT, mask_BT)


@register_importance_sampling("seq", sequence_level=True)
def seq_log_ratio(logprobs_BT: Array, old_logprobs_BT: Array, mask_BT: Array) -> Array:
    """GSPO sequence ratio (paper §4.1), broadcast to every token of the sequence.

        log s_i = (1/|y_i|) Σ_t m_t (log π_θ(y_i,t|·) − log π_old(y_i,t|·)),  |y_i| = Σ_t m_t

    The gradient flows through the masked mean: ∇ log s_i = (1/|y_i|) Σ_t ∇ log π_θ(y_i,t|·).
    """
    log_s_B = _seq_log_ratio_B(logprobs_BT, old_logprobs_BT, mask_BT)
    return jnp.where(mask_BT > 0, log_s_B[:, None], 0.0)


@register_importance_sampling("seq_token", sequence_level=True)
def seq_token_log_ratio(logprobs_BT: Array, old_logprobs_BT: Array, mask_BT: Array) -> Array:
    """GSPO-token ratio (paper §4.3): s_i,t = sg[s_i] · π_θ(y_i,t) / sg[π_θ(y_i,t)].

    In log form: log s_i,t = sg[log s_i] + log π_θ(y_i,t) − sg[log π_θ(y_i,t)]. Its value is
    s_i; its gradient is s_i ∇ log π_θ(y_i,t), so per-token advantages weight each token.
    """
    log_s_B = jax.lax.stop_gradient(_seq_log_ratio_B(logprobs_BT, old_logprobs_BT, mask_BT))
    local_BT = logprobs_BT - jax.lax.stop_gradient(logprobs_BT)
    return jnp.where(mask_BT > 0, log_s_B[:, None] + local_BT, 0.0)


# ---------------------------------------------------------------------------------------------
# Loss aggregation.
# ---------------------------------------------------------------------------------------------


def _num_valid_seqs(mask_BT: Array) -> Array:
    return jnp.sum((_seq_token_counts(mask_BT) > 0).astype(jnp.float32))


@register_loss_agg("token-mean")
def _agg_token_mean(loss_BT, mask_BT, *, horizon, num_valid_tokens, num_valid_seqs):
    """Σ_{b,t} m·L / Σ_{b,t} m."""
    del horizon, num_valid_seqs
    denom = jnp.sum(mask_BT) if num_valid_tokens is None else num_valid_tokens
    return jnp.sum(loss_BT) / safe_count(denom)


@register_loss_agg("seq-mean-token-sum")
def _agg_seq_mean_token_sum(loss_BT, mask_BT, *, horizon, num_valid_tokens, num_valid_seqs):
    """(1/#valid seqs) Σ_b Σ_t m·L."""
    del horizon, num_valid_tokens
    denom = _num_valid_seqs(mask_BT) if num_valid_seqs is None else num_valid_seqs
    return jnp.sum(loss_BT) / safe_count(denom)


@register_loss_agg("seq-mean-token-mean")
def _agg_seq_mean_token_mean(loss_BT, mask_BT, *, horizon, num_valid_tokens, num_valid_seqs):
    """(1/#valid seqs) Σ_b (Σ_t m·L / Σ_t m)."""
    del horizon, num_valid_tokens
    per_seq_B = jnp.sum(loss_BT, axis=-1) / safe_count(_seq_token_counts(mask_BT))
    denom = _num_valid_seqs(mask_BT) if num_valid_seqs is None else num_valid_seqs
    return jnp.sum(per_seq_B) / safe_count(denom)


@register_loss_agg("seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(loss_BT, mask_BT, *, horizon, num_valid_tokens, num_valid_seqs):
    """(1/#valid seqs) Σ_b Σ_t m·L / horizon  (Dr. GRPO's constant normaliser)."""
    del num_valid_tokens
    denom = _num_valid_seqs(mask_BT) if num_valid_seqs is None else num_valid_seqs
    return jnp.sum(loss_BT) / safe_count(denom) / horizon


def aggregate_loss(
    loss_BT: Array,
    mask_BT: Array,
    loss_agg_mode: str,
    *,
    horizon: float | None = None,
    num_valid_tokens: Array | float | None = None,
    num_valid_seqs: Array | float | None = None,
) -> Array:
    """Reduces a per-token loss [B, T] to a scalar under `loss_agg_mode`.

    With m the mask, n_b = Σ_t m_bt and S the set of sequences with n_b > 0:

      token-mean:               Σ_{b,t} m·L / Σ_{b,t} m
      seq-mean-token-sum:       (1/|S|) Σ_b Σ_t m·L
      seq-mean-token-mean:      (1/|S|) Σ_{b∈S} (Σ_t m·L / n_b)
      seq-mean-token-sum-norm:  (1/|S|) Σ_b Σ_t m·L / horizon   (horizon defaults to T)

    `num_valid_tokens` / `num_valid_seqs` replace Σ m / |S| by global counts: the trainer passes
    the mini-batch's counts to every micro-batch and sums the results, which then equals the
    loss of the whole mini-batch (n_b is always local: a sequence is never split). A zero
    denominator gives loss 0. Masked positions of `loss_BT` are ignored in value; for clean
    gradients, compute `loss_BT` from inputs already sanitised at masked positions.
    """
    aggregate = LOSS_AGG_MODES.get(loss_agg_mode)
    if loss_BT.ndim != 2 or mask_BT.shape != loss_BT.shape:
        raise ValueError(
            f"aggregate_loss: loss_BT {loss_BT.shape} and mask_BT {mask_BT.shape} must both be "
            "[B, T] of the same shape"
        )
    mask_BT = jnp.asarray(mask_BT, jnp.float32)
    loss_BT = jnp.where(mask_BT > 0, loss_BT.astype(jnp.float32) * mask_BT, 0.0)
    if horizon is None:
        horizon = loss_BT.shape[-1]
    elif isinstance(horizon, int | float) and horizon <= 0:
        raise ValueError(f"aggregate_loss: horizon must be > 0, got {horizon}")
    return aggregate(
        loss_BT,
        mask_BT,
        horizon=horizon,
        num_valid_tokens=num_valid_tokens,
        num_valid_seqs=num_valid_seqs,
    )


def entropy_loss(
    entropy_BT: Array,
    mask_BT: Array,
    loss_agg_mode: str,
    *,
    horizon: float | None = None,
    num_valid_tokens: Array | float | None = None,
    num_valid_seqs: Array | float | None = None,
) -> Array:
    """Per-token entropy H_t aggregated like the policy loss (the trainer subtracts
    entropy_coef × this). Masked positions may hold garbage; they are zeroed first."""
    entropy_BT = jnp.where(jnp.asarray(mask_BT) > 0, entropy_BT, 0.0)
    return aggregate_loss(
        entropy_BT,
        mask_BT,
        loss_agg_mode,
        horizon=horizon,
        num_valid_tokens=num_valid_tokens,
        num_valid_seqs=num_valid_seqs,
    )


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
def _kl_k3(log_ratio_BT: Array) -> Array:
    """k3 = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1  (≥ 0)."""
    neg_BT = -log_ratio_BT
    # expm1 keeps k3 accurate (and exactly >= 0 in practice) for small log-ratios.
    return jnp.expm1(neg_BT) - neg_BT


@register_kl_estimator("low_var_kl")
def _kl_low_var(log_ratio_BT: Array) -> Array:
    """k3 with the log-ratio clamped to [−20, 20] and the result clamped to [−10, 10] (verl)."""
    return jnp.clip(_kl_k3(jnp.clip(log_ratio_BT, -20.0, 20.0)), -10.0, 10.0)


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


# ---------------------------------------------------------------------------------------------
# Rollout correction: the sampler / trainer mismatch, as a weight kept apart from the ratio.
# ---------------------------------------------------------------------------------------------

# Response-length buckets of the by_length/* metrics: [1, 4), [4, 8), ..., [256, inf).
LENGTH_EDGES = (1, 4, 8, 16, 32, 64, 128, 256)


def length_buckets() -> tuple[tuple[str, int, int | None], ...]:
    """(name, lo, hi) of each response-length bucket: lengths lo <= n < hi (hi None: no
    upper end); names "1-3", ..., "256+"."""
    ends = (*LENGTH_EDGES[1:], None)
    return tuple(
        (f"{lo}-{hi - 1}" if hi else f"{lo}+", lo, hi) for lo, hi in zip(LENGTH_EDGES, ends)
    )


ROLLOUT_CORRECTIONS = ("none", "tis", "mask")
ROLLOUT_CORRECTION_LEVELS = ("token", "seq")


def rollout_correction_weights(
    old_logprobs: Array,
    rollout_logprobs: Array,
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
    _choice_of("rollout_correction", mode, ROLLOUT_CORRECTIONS[1:])
    _choice_of("rollout_correction_level", level, ROLLOUT_CORRECTION_LEVELS)
    if isinstance(threshold, int | float) and not threshold > 1.0:
        raise ValueError(f"rollout_correction_threshold must be > 1, got {threshold}")
    if old_logprobs.shape != mask.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(
            f"rollout_correction_weights: old_logprobs {old_logprobs.shape}, rollout_logprobs "
            f"{rollout_logprobs.shape} and mask {mask.shape} must all be [B, T]"
        )
    sg = jax.lax.stop_gradient
    mask_BT = jnp.asarray(mask, jnp.float32)
    valid_BT = mask_BT > 0
    old_BT = jnp.where(valid_BT, sg(old_logprobs).astype(jnp.float32), 0.0)
    mu_BT = jnp.where(valid_BT, sg(rollout_logprobs).astype(jnp.float32), 0.0)
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


def _choice_of(name: str, value: str, valid: tuple[str, ...]) -> None:
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


# ---------------------------------------------------------------------------------------------
# Loss modes: the GSPO family (docs/objectives.md). Each gets the ratio r that
# importance_sampling selects (r_t per token, or s_i on every token of sequence i).
# ---------------------------------------------------------------------------------------------


def _signed_flags(x: LossInputs, out_BT: Array) -> dict[str, Array]:
    """low / high: `out_BT` on tokens with A < 0 / A > 0 (A = 0 has no gradient to limit)."""
    out_BT = x.valid & out_BT
    return {"low": out_BT & (x.adv < 0), "high": out_BT & (x.adv > 0), "range": out_BT}


@register_loss_mode("clip")
def _loss_clip(x: LossInputs):
    """PPO / GRPO / GSPO clipped surrogate (GSPO paper §4): L = max(−A·r, −A·clip(r, 1 − ε_low,
    1 + ε_high)); the gradient weight is 1 where the unclipped term is active, else 0."""
    loss_BT, flags = _clipped_loss(x.ratio, x.adv, x.valid, x.hp["clip_low"], x.hp["clip_high"])
    flags["weight"] = jnp.where(flags["low"] | flags["high"], 0.0, 1.0)
    return loss_BT, flags


@register_loss_mode("sapo")
def _loss_sapo(x: LossInputs):
    """SAPO (Gao et al., arXiv 2511.20347): a soft gate instead of the clip.

        L = −A·f(r),  f(r) = (4/τ)·σ(τ·(r − 1)),  τ = τ_pos if A > 0 else τ_neg

    ∂L/∂log π = −A·r·sech²(τ(r − 1)/2): the gate sech² is 1 on policy and decays smoothly
    away from r = 1 (faster for A < 0 with τ_neg > τ_pos). Nothing is cut: a token is counted
    as limited where the gate is below ½ (half its gradient or more removed). With
    importance_sampling="seq", r = s_i: sequence-level SAPO.
    """
    tau_BT = jnp.where(x.adv > 0, x.hp["sapo_tau_pos"], x.hp["sapo_tau_neg"])
    z_BT = tau_BT * (x.ratio - 1.0)
    loss_BT = -x.adv * (4.0 / tau_BT) * jax.nn.sigmoid(z_BT)
    z_BT = jax.lax.stop_gradient(z_BT)
    gate_BT = 4.0 * jax.nn.sigmoid(z_BT) * jax.nn.sigmoid(-z_BT)  # = sech²(z/2)
    flags = _signed_flags(x, gate_BT < 0.5)
    flags["weight"] = jnp.where(x.valid, gate_BT, 0.0)
    return loss_BT, flags


@register_loss_mode("cispo")
def _loss_cispo(x: LossInputs):
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped, never the
    gradient path.

        L = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π_θ(y_t)

    Every token keeps a gradient −w·A·∇log π; limited: the clip changed the weight.
    """
    lo, hi = 1.0 - x.hp["clip_low"], 1.0 + x.hp["clip_high"]
    ratio_BT = jax.lax.stop_gradient(x.ratio)
    weight_BT = jnp.clip(ratio_BT, lo, hi)
    loss_BT = -x.adv * weight_BT * x.logp
    flags = _signed_flags(x, (ratio_BT < lo) | (ratio_BT > hi))
    flags["weight"] = jnp.where(x.valid, weight_BT, 0.0)
    return loss_BT, flags


@register_loss_mode("gmpo", token_ratio=True)
def _loss_gmpo(x: LossInputs):
    """GMPO (Zhao et al., arXiv 2507.20673): the geometric mean of the token ratios, clipped
    in log space, per sequence.

        log ρ_i = (1/|y_i|) Σ_t sgn(A)·min(sgn(A)·log r_t, sgn(A)·clip(log r_t, −ε_low, ε_high))
        L_i = −A_i·ρ_i   (on each of the sequence's tokens; seq-mean-token-mean: (1/G) Σ_i L_i)

    A token whose clipped term is active contributes a constant to log ρ_i: no gradient.
    """
    lo, hi = -x.hp["clip_low"], x.hp["clip_high"]
    log_r_BT = x.log_ratio
    clipped_BT = (x.adv > 0) & (log_r_BT > hi) | (x.adv < 0) & (log_r_BT < lo)
    clipped_BT = x.valid & clipped_BT
    term_BT = jnp.where(clipped_BT, jnp.clip(jax.lax.stop_gradient(log_r_BT), lo, hi), log_r_BT)
    term_BT = jnp.where(x.adv == 0, 0.0, term_BT)  # sgn(0) = 0
    rho_B = jnp.exp(row_mean(term_BT, x.mask))
    loss_BT = -x.adv * rho_B[:, None]
    flags = _signed_flags(x, (log_r_BT < lo) | (log_r_BT > hi))
    flags["low"], flags["high"] = clipped_BT & (x.adv < 0), clipped_BT & (x.adv > 0)
    flags["weight"] = jnp.where(x.valid & ~clipped_BT, 1.0, 0.0)
    return loss_BT, flags


def _dppo(x: LossInputs, divergence: str):
    """DPPO's masked, capped policy gradient (`_loss_dppo_tv` / `_loss_dppo_kl`)."""
    sg = jax.lax.stop_gradient
    logp_BT = sg(x.logp)
    p_BT, old_p_BT = jnp.exp(logp_BT), jnp.exp(x.old)
    up_BT, down_BT = p_BT > old_p_BT, p_BT < old_p_BT
    if divergence == "tv":
        high_BT = p_BT - old_p_BT > x.hp["dppo_delta_high"]
        low_BT = p_BT - old_p_BT < -x.hp["dppo_delta_low"]
    else:  # binary KL(p_old ‖ p) over {y_t, not y_t}
        q_BT, old_q_BT = -jnp.expm1(logp_BT), -jnp.expm1(x.old)
        xlogy = jax.scipy.special.xlogy
        kl_BT = xlogy(old_p_BT, old_p_BT) - old_p_BT * logp_BT + xlogy(old_q_BT, old_q_BT)
        kl_BT = kl_BT - xlogy(old_q_BT, q_BT)
        beyond_BT = kl_BT > x.hp["dppo_delta_high"]
        high_BT, low_BT = beyond_BT & up_BT, beyond_BT & down_BT
    masked_BT = x.valid & ((x.adv > 0) & high_BT | (x.adv < 0) & low_BT)
    ratio_BT = sg(x.ratio)
    weight_BT = jnp.minimum(ratio_BT, x.hp["dppo_max_weight"])
    keep_BT = jnp.where(masked_BT, 0.0, 1.0)
    loss_BT = -x.adv * weight_BT * x.logp * keep_BT
    capped_BT = x.valid & (x.adv != 0) & (ratio_BT > x.hp["dppo_max_weight"])
    flags = {
        "low": masked_BT & (x.adv < 0) | capped_BT & (x.adv < 0),
        "high": masked_BT & (x.adv > 0) | capped_BT & (x.adv > 0),
        "range": x.valid & (high_BT | low_BT),
        "weight": jnp.where(x.valid, keep_BT, 0.0),
    }
    return loss_BT, flags


@register_loss_mode("dppo_tv")
def _loss_dppo_tv(x: LossInputs):
    """DPPO, binary total variation (Qi et al., arXiv 2602.04879): a token trust region on
    the sampled token's probability p = exp(log π_θ) against p_old = exp(log π_old).

        m_t = 0 if (A > 0 and p − p_old > δ_high) or (A < 0 and p − p_old < −δ_low), else 1
        L = −A·sg(min(r, w_max))·log π_θ(y_t)·m_t

    Limited: masked tokens, and tokens whose weight the cap w_max lowered.
    """
    return _dppo(x, "tv")


@register_loss_mode("dppo_kl")
def _loss_dppo_kl(x: LossInputs):
    """DPPO, binary KL (arXiv 2602.04879): as dppo_tv with the mask

    m_t = 0 if KL(p_old ‖ p) > δ_high and p moved in A's direction (up for A > 0, down
          for A < 0), KL(a ‖ b) = a log(a/b) + (1 − a) log((1 − a)/(1 − b))
    """
    return _dppo(x, "kl")


def _opsm_mask(x: LossInputs, rollout_BT: Array, delta) -> Array:
    """Off-policy sequence masking (DeepSeek-V3.2, §3): bool [B, T], True on every token of a
    sequence with A < 0 whose mean_t (log μ − log π_θ) over its valid tokens exceeds δ (the
    sequence's advantage: the mean of its tokens'). No gradient (a mask)."""
    gap_B = row_mean(rollout_BT - jax.lax.stop_gradient(x.logp), x.mask)
    adv_B = row_mean(x.adv, x.mask)
    masked_B = jnp.any(x.valid, axis=-1) & (adv_B < 0) & (gap_B > delta)
    return x.valid & masked_B[:, None]


# ---------------------------------------------------------------------------------------------
# The policy loss.
# ---------------------------------------------------------------------------------------------


def policy_loss(
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    importance_sampling: str,
    clip_low: float,
    clip_high: float,
    dual_clip_loss: bool = False,
    dual_clip_ratio: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    horizon: float | None = None,
    num_valid_tokens: Array | float | None = None,
    num_valid_seqs: Array | float | None = None,
    log_ratio_clamp: float | None = 20.0,
    rollout_logprobs: Array | None = None,
    rollout_correction: str = "none",
    rollout_correction_level: str = "token",
    rollout_correction_threshold: float = 2.0,
    loss_mode: str = "clip",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    dppo_delta_low: float = 0.15,
    dppo_delta_high: float = 0.15,
    dppo_max_weight: float = 5.0,
    opsm_delta: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Policy-gradient loss of the GSPO family: GRPO (token ratio), GSPO and GSPO-token
    (paper §4) with the clipped surrogate, or another `loss_mode` (docs/objectives.md).

    Per valid token, with r the ratio chosen by `importance_sampling` (see the registry:
    "token" r_t = π_θ/π_old per token; "seq" r = s_i, the length-normalised sequence ratio of
    §4.1 with gradient through the mean; "seq_token" the §4.3 stop-gradient form, equal to s_i
    in value):

        L_t = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))
        dual clip (if dual_clip_loss), for A < 0:  L_t = min(L_t, −A·dual_clip_ratio)

    That is `loss_mode="clip"` (the default). The other modes replace L_t, with the same r:
      "sapo":    L_t = −A·(4/τ)·σ(τ(r − 1)), τ = sapo_tau_pos if A > 0 else sapo_tau_neg
      "cispo":   L_t = −sg(clip(r, 1 − clip_low, 1 + clip_high))·A·log π_θ(y_t)
      "gmpo":    L_t = −A·ρ_i, log ρ_i the mean over the sequence of the log-space clipped
                 token log-ratios (clip_low / clip_high; importance_sampling="token" only)
      "dppo_tv", "dppo_kl": L_t = −A·sg(min(r, dppo_max_weight))·log π_θ(y_t)·m_t, m_t = 0
                 outside the binary TV / KL trust region (dppo_delta_low / dppo_delta_high)
    (each mode's function docstring has the details). LUSPO is "clip" with
    importance_sampling="seq" and loss_agg_mode="seq-mean-token-sum".

    The loss is `aggregate_loss(L, mask, loss_agg_mode, ...)`. J_GSPO of §4.1 is
    seq + seq-mean-token-mean: every token of a sequence carries the same L, so the token mean
    is the sequence's term.

    Off-policy sequence masking (`opsm_delta` δ, None: off; DeepSeek-V3.2 §3), with any mode:
    every token of a sequence with A < 0 and mean_t (log μ − log π_θ) > δ gets L_t = 0 (μ:
    `rollout_logprobs`, the sampler's); the denominators are unchanged.

    Args:
      logprobs: [B, T] log π_θ of the response tokens (the differentiated input).
      old_logprobs: [B, T] log π_old (sampler's or recomputed); treated as a constant.
      advantages: [B] (broadcast over T) or [B, T].
      mask: [B, T], 1 for response tokens that count; 0 positions may hold garbage.
      importance_sampling, loss_agg_mode: names in the registries (static).
      clip_low, clip_high: ε_low, ε_high. Paper: 3e-4 / 4e-4 (GSPO), 0.2 / 0.27 (GRPO).
      horizon, num_valid_tokens, num_valid_seqs: see `aggregate_loss`.
      log_ratio_clamp: the log-ratio is clamped to ±this before exp (the token log-ratio, or
        log s_i — the mean, never a sum — for seq modes) so an extreme policy drift cannot
        overflow; its gradient is 0 beyond the clamp. None disables.
      rollout_logprobs: [B, T] log μ, the sampler's log-probs of the tokens (needed with a
        rollout correction, where `old_logprobs` must be the trainer's own π_old, and with
        `opsm_delta`).
      rollout_correction, rollout_correction_level, rollout_correction_threshold: "none"
        (default), or "tis" / "mask" at "token" / "seq" level with threshold C: each L_t is
        multiplied by the stop-gradient weight of `rollout_correction_weights` (ρ = π_old / μ)
        before aggregation. The weight never enters r or its clip, so the clip measures the
        policy's change since π_old only; the denominators are unchanged.
      loss_mode: a name in LOSS_MODES (static); sapo_tau_pos / sapo_tau_neg (> 0),
        dppo_delta_low / dppo_delta_high / dppo_max_weight (> 0): those modes' parameters.
      opsm_delta: off-policy sequence masking's threshold δ (None: off).

    Returns:
      (loss, metrics). metrics is a flat dict of f32 scalars over this call's valid data, each
      declared in `policy_metric_reductions`:
      clipfrac (valid tokens whose clipped term is active — the clip binds, which depends on
      the advantage's sign — = clipfrac_low + clipfrac_high), clipfrac_low (r < 1 − clip_low
      with A < 0), clipfrac_high (r > 1 + clip_high with A > 0), clipfrac_range (valid tokens
      whose ratio is outside [1 − clip_low, 1 + clip_high], whatever the advantage's sign),
      clipfrac_seq (valid sequences with ≥ 1 clipped token; clipfrac_seq_low / _high: with ≥ 1
      token clipped on that side — in `seq` mode every token of a sequence shares its clip
      state, so these are the sequence-level clip fractions), clipfrac_seq_range (valid
      sequences with ≥ 1 token out of range), dual_clipfrac (valid tokens capped by the dual
      clip), limited_frac (valid tokens whose gradient the mode reduces or removes: clipped
      or dual-clipped for "clip" — then the low / high clipfracs are the mode's limited tokens
      by the advantage's sign —, SAPO's gate below ½, CISPO's weight changed by its clip,
      GMPO's clipped tokens, DPPO's masked or capped tokens, and OPSM's masked sequences),
      limited_frac_seq (valid sequences with >= 1 limited token), weight_mean (the mean
      gradient weight over valid tokens: SAPO's gate, CISPO's clipped weight, DPPO's mask,
      1 − clipped for "clip" and "gmpo"; 0 on OPSM-masked tokens), opsm_masked_frac (with
      `opsm_delta`: valid sequences OPSM masks), ratio_min / ratio_mean / ratio_max (over valid tokens for token modes, over valid
      sequences for sequence modes; 1.0 when nothing is valid), approx_kl (masked mean of
      old − logp, k1 of KL(π_old ‖ π_θ)), approx_kl_k3 (masked mean of r_t − 1 − log r_t with
      the token ratio), pg_loss (= loss), num_valid_tokens and num_valid_seqs (local counts,
      for weighting metrics across micro-batches). With a rollout correction, also the
      correction/* metrics of `rollout_correction_weights`. by_length/log_s_sq_<b> and
      by_length/seqs_<b>: per response-length bucket b (`length_buckets`), the sum over its
      valid sequences of (log s_i)², log s_i = the mean over the sequence's valid tokens of
      logp − old (GSPO's log sequence ratio, whatever the objective), and their count:
      sqrt(sum / count) is log s_i's spread at that length (paper: token noise averages
      out over long responses).
    """
    ratio = RATIOS.get(importance_sampling)
    mode = LOSS_MODES.get(loss_mode)
    _check_policy_args(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    hp = {
        "clip_low": clip_low,
        "clip_high": clip_high,
        "sapo_tau_pos": sapo_tau_pos,
        "sapo_tau_neg": sapo_tau_neg,
        "dppo_delta_low": dppo_delta_low,
        "dppo_delta_high": dppo_delta_high,
        "dppo_max_weight": dppo_max_weight,
    }
    _check_loss_mode(loss_mode, mode, importance_sampling, hp, dual_clip_loss, opsm_delta)
    correction = _correction_args(
        rollout_logprobs if rollout_correction != "none" or opsm_delta is None else None,
        rollout_correction,
        level=rollout_correction_level,
        threshold=rollout_correction_threshold,
        log_ratio_clamp=20.0 if log_ratio_clamp is None else log_ratio_clamp,
    )
    if opsm_delta is not None and rollout_logprobs is None:
        raise ValueError(
            "policy_loss: opsm_delta (off-policy sequence masking) needs rollout_logprobs, "
            "the sampler's log-probs μ"
        )
    if dual_clip_loss and isinstance(dual_clip_ratio, int | float) and dual_clip_ratio <= 1.0:
        raise ValueError(f"policy_loss: dual_clip_ratio must be > 1, got {dual_clip_ratio}")
    mask_BT = jnp.asarray(mask, jnp.float32)
    valid_BT = mask_BT > 0
    # Safe where: garbage (-inf, NaN) at masked positions is replaced before any arithmetic, so
    # neither values nor gradients (0 · inf) can become NaN.
    logp_BT = jnp.where(valid_BT, logprobs.astype(jnp.float32), 0.0)
    old_BT = jax.lax.stop_gradient(jnp.where(valid_BT, old_logprobs.astype(jnp.float32), 0.0))
    adv_BT = advantages[:, None] if advantages.ndim == 1 else advantages
    adv_BT = jnp.where(valid_BT, jnp.broadcast_to(adv_BT, logp_BT.shape), 0.0)
    adv_BT = jax.lax.stop_gradient(adv_BT.astype(jnp.float32))

    log_ratio_BT = ratio.log_ratio(logp_BT, old_BT, mask_BT)
    if log_ratio_clamp is not None:
        log_ratio_BT = jnp.clip(log_ratio_BT, -log_ratio_clamp, log_ratio_clamp)
    ratio_BT = jnp.where(valid_BT, jnp.exp(log_ratio_BT), 1.0)
    inputs = LossInputs(logp_BT, old_BT, log_ratio_BT, ratio_BT, adv_BT, valid_BT, mask_BT, hp)
    loss_BT, flags = mode.loss(inputs)
    flags["limited"] = flags["low"] | flags["high"]
    if dual_clip_loss:
        # verl/ROLL dual clip: a negative-advantage token whose ratio exploded is capped at
        # −A·c (constant, no gradient) instead of growing without bound.
        cap_BT = -adv_BT * dual_clip_ratio
        flags["dual"] = valid_BT & (adv_BT < 0) & (loss_BT > cap_BT)
        loss_BT = jnp.where(flags["dual"], cap_BT, loss_BT)
        flags["limited"] = flags["limited"] | flags["dual"]
        flags["weight"] = jnp.where(flags["dual"], 0.0, flags["weight"])
    else:
        flags["dual"] = jnp.zeros_like(valid_BT)
    opsm_metrics = {}
    if opsm_delta is not None:
        rollout_BT = jnp.where(valid_BT, rollout_logprobs.astype(jnp.float32), 0.0)
        opsm_BT = _opsm_mask(inputs, jax.lax.stop_gradient(rollout_BT), opsm_delta)
        loss_BT = jnp.where(opsm_BT, 0.0, loss_BT)
        flags["limited"] = flags["limited"] | opsm_BT
        flags["weight"] = jnp.where(opsm_BT, 0.0, flags["weight"])
        opsm_B = jnp.any(opsm_BT, axis=-1)
        n_seq = jnp.sum(jnp.any(valid_BT, axis=-1).astype(jnp.float32))
        opsm_metrics["opsm_masked_frac"] = jax.lax.stop_gradient(
            jnp.sum(opsm_B.astype(jnp.float32)) / safe_count(n_seq)
        )
    correction_metrics = {}
    if correction is not None:
        weight_BT, correction_metrics = rollout_correction_weights(
            old_BT, correction.pop("rollout_logprobs"), mask_BT, **correction
        )
        loss_BT = loss_BT * weight_BT
    loss_BT = jnp.where(valid_BT, loss_BT, 0.0)
    loss = aggregate_loss(
        loss_BT,
        mask_BT,
        loss_agg_mode,
        horizon=horizon,
        num_valid_tokens=num_valid_tokens,
        num_valid_seqs=num_valid_seqs,
    )
    clamp = 20.0 if log_ratio_clamp is None else log_ratio_clamp
    metrics = _policy_metrics(ratio, loss, logp_BT, old_BT, mask_BT, ratio_BT, flags, clamp)
    return loss, {**metrics, **opsm_metrics, **correction_metrics}


def _check_loss_mode(name, mode: LossMode, importance_sampling, hp, dual_clip_loss, opsm_delta):
    """The loss mode against its parameters (concrete values only) and the ratio it needs."""
    if mode.token_ratio and importance_sampling != "token":
        raise ValueError(
            f"policy_loss: loss_mode={name!r} needs token log-ratios: importance_sampling "
            f"must be 'token', got {importance_sampling!r}"
        )
    if dual_clip_loss and name != "clip":
        raise ValueError(f"policy_loss: dual_clip_loss applies to loss_mode='clip', not {name!r}")
    positive = {"sapo": ("sapo_tau_pos", "sapo_tau_neg"), "cispo": ("clip_high",)}
    dppo = ("dppo_delta_low", "dppo_delta_high", "dppo_max_weight")
    positive.update(dppo_tv=dppo, dppo_kl=dppo)
    for field in positive.get(name, ()):
        value = hp[field]
        if isinstance(value, int | float) and not value > 0:
            raise ValueError(
                f"policy_loss: {field} must be > 0 with loss_mode={name!r}, got {value}"
            )
    if isinstance(opsm_delta, int | float) and not opsm_delta >= 0:
        raise ValueError(f"policy_loss: opsm_delta must be >= 0 (or None), got {opsm_delta}")


def _correction_args(
    rollout_logprobs, mode: str, *, level: str, threshold, log_ratio_clamp: float
) -> dict | None:
    """`rollout_correction_weights`' arguments, or None without a correction."""
    _choice_of("rollout_correction", mode, ROLLOUT_CORRECTIONS)
    if mode == "none":
        if rollout_logprobs is not None:
            raise ValueError(
                "policy_loss: rollout_logprobs given with rollout_correction='none' (they "
                "would be ignored); pass rollout_correction='tis' or 'mask' to use them"
            )
        return None
    if rollout_logprobs is None:
        raise ValueError(f"policy_loss: rollout_correction={mode!r} needs rollout_logprobs")
    return {
        "rollout_logprobs": rollout_logprobs,
        "mode": mode,
        "level": level,
        "threshold": threshold,
        "log_ratio_clamp": log_ratio_clamp,
    }


def _check_policy_args(logprobs, old_logprobs, advantages, mask, clip_low, clip_high) -> None:
    """Shapes ([B, T] everywhere, advantages [B] or [B, T]) and the clip range's sign."""
    if logprobs.ndim != 2:
        raise ValueError(f"policy_loss: logprobs must be [B, T], got shape {logprobs.shape}")
    for name, x in (("old_logprobs", old_logprobs), ("mask", mask)):
        if x.shape != logprobs.shape:
            raise ValueError(
                f"policy_loss: {name} has shape {x.shape}, expected logprobs' {logprobs.shape}"
            )
    num_b, num_t = logprobs.shape
    if advantages.shape not in ((num_b,), (num_b, num_t)):
        raise ValueError(
            f"policy_loss: advantages has shape {advantages.shape}, expected [B]=({num_b},) "
            f"or [B, T]=({num_b}, {num_t})"
        )
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        # Only checkable when concrete; traced values are the caller's responsibility.
        if isinstance(value, int | float) and value < 0:
            raise ValueError(f"policy_loss: {name} must be >= 0, got {value}")


def _clipped_loss(ratio_BT, adv_BT, valid_BT, clip_low, clip_high):
    """max(−A·r, −A·clip(r)) written as a select on *when* the clipped term wins, so the clip
    metric and the gradient agree exactly (the clipped term carries no gradient). Returns
    (loss [B, T], {"low", "high": the clip binds on that side; "range": r out of range})."""
    flags = {
        "low": valid_BT & (adv_BT < 0) & (ratio_BT < 1.0 - clip_low),
        "high": valid_BT & (adv_BT > 0) & (ratio_BT > 1.0 + clip_high),
        "range": valid_BT & ((ratio_BT < 1.0 - clip_low) | (ratio_BT > 1.0 + clip_high)),
    }
    clipped_BT = flags["low"] | flags["high"]
    clipped_ratio_BT = jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    loss_BT = jnp.where(clipped_BT, -adv_BT * clipped_ratio_BT, -adv_BT * ratio_BT)
    return loss_BT, flags


def policy_metric_reductions(
    importance_sampling: str, rollout_correction_level: str = "token"
) -> dict[str, Reduction]:
    """How each metric of `policy_loss` combines over micro-batches and updates
    (gspo_jax.algorithm.reductions); per-update ones are also logged as updates/<name>. The
    correction/* metrics are means over tokens or sequences as `rollout_correction_level`."""
    per_seq = is_sequence_level(importance_sampling)
    mean = SEQ_MEAN if rollout_correction_level == "seq" else TOKEN_MEAN
    return {
        "correction/weight_mean": mean.logged(),
        "correction/weight_mean_raw": mean,
        "correction/weight_min_raw": MIN,
        "correction/weight_max_raw": MAX.logged(),
        "correction/capped_frac": mean.logged(),
        "correction/masked_frac": mean.logged(),
        "pg_loss": SUM,  # with global denominators, the micro-batches' losses add up
        "limited_frac": TOKEN_MEAN.logged(),
        "limited_frac_seq": SEQ_MEAN.logged(),
        "weight_mean": TOKEN_MEAN.logged(),
        "opsm_masked_frac": SEQ_MEAN.logged(),
        "clipfrac": TOKEN_MEAN.logged(),
        "clipfrac_low": TOKEN_MEAN,
        "clipfrac_high": TOKEN_MEAN,
        "clipfrac_range": TOKEN_MEAN.logged(),
        "clipfrac_seq": SEQ_MEAN.logged(),
        "clipfrac_seq_low": SEQ_MEAN,
        "clipfrac_seq_high": SEQ_MEAN,
        "clipfrac_seq_range": SEQ_MEAN.logged(),
        "dual_clipfrac": TOKEN_MEAN,
        "ratio_min": MIN.logged(),
        "ratio_mean": (SEQ_MEAN if per_seq else TOKEN_MEAN).logged(),
        "ratio_max": MAX.logged(),
        "approx_kl": TOKEN_MEAN.logged(),
        "approx_kl_k3": TOKEN_MEAN,
        "num_valid_tokens": SUM,
        "num_valid_seqs": SUM,
        **{
            f"by_length/{kind}_{name}": Reduction("sum", updates="sum")
            for name, _, _ in length_buckets()
            for kind in ("log_s_sq", "seqs")
        },
    }


def _policy_metrics(ratio: Ratio, loss, logp_BT, old_BT, mask_BT, ratio_BT, flags, clamp):
    """The metrics `policy_loss` documents, from its intermediates (no gradient)."""
    sg = jax.lax.stop_gradient
    logp_BT, ratio_BT = sg(logp_BT), sg(ratio_BT)
    valid_BT = mask_BT > 0
    valid_B = jnp.any(valid_BT, axis=-1)
    n_tok = jnp.sum(mask_BT)
    n_seq = jnp.sum(valid_B.astype(jnp.float32))

    def tok_frac(flag_BT):
        return jnp.sum(flag_BT.astype(jnp.float32)) / safe_count(n_tok)

    def seq_frac(flag_BT):
        flag_B = jnp.any(flag_BT, axis=-1) & valid_B
        return jnp.sum(flag_B.astype(jnp.float32)) / safe_count(n_seq)

    if ratio.sequence_level:
        # One ratio per sequence: the max over its valid tokens is that value, exactly.
        values = jnp.max(jnp.where(valid_BT, ratio_BT, -jnp.inf), axis=-1)
        valid, count = valid_B, n_seq
        values = jnp.where(valid, values, 1.0)
    else:
        values, valid, count = ratio_BT, valid_BT, n_tok
    any_valid = count > 0
    token_log_ratio_BT = jnp.where(valid_BT, logp_BT - old_BT, 0.0)
    # k3 of KL(π_old ‖ π_θ) from samples of π_old: r − 1 − log r with r = π_θ / π_old.
    k3_BT = _kl_k3(-jnp.clip(token_log_ratio_BT, -clamp, clamp))
    clipped_BT = flags["low"] | flags["high"]
    metrics = {
        "pg_loss": loss,
        "limited_frac": tok_frac(flags["limited"]),
        "limited_frac_seq": seq_frac(flags["limited"]),
        "weight_mean": masked_mean(sg(flags["weight"]), mask_BT),
        "clipfrac": tok_frac(clipped_BT),
        "clipfrac_low": tok_frac(flags["low"]),
        "clipfrac_high": tok_frac(flags["high"]),
        "clipfrac_range": tok_frac(flags["range"]),
        "clipfrac_seq": seq_frac(clipped_BT),
        "clipfrac_seq_low": seq_frac(flags["low"]),
        "clipfrac_seq_high": seq_frac(flags["high"]),
        "clipfrac_seq_range": seq_frac(flags["range"]),
        "dual_clipfrac": tok_frac(flags["dual"]),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(valid, values, jnp.inf)), 1.0),
        "ratio_mean": jnp.where(any_valid, masked_mean(values, valid.astype(jnp.float32)), 1.0),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid, values, -jnp.inf)), 1.0),
        "approx_kl": masked_mean(-token_log_ratio_BT, mask_BT),
        "approx_kl_k3": masked_mean(k3_BT, mask_BT),
        "num_valid_tokens": n_tok,
        "num_valid_seqs": n_seq,
    }
    n_B = jnp.sum(valid_BT, axis=-1)
    log_s_B = jnp.sum(token_log_ratio_BT, axis=-1) / jnp.maximum(n_B, 1)
    for name, lo, hi in length_buckets():
        in_B = valid_B & (n_B >= lo) & ((n_B < hi) if hi else True)
        metrics[f"by_length/log_s_sq_{name}"] = jnp.sum(jnp.where(in_B, log_s_B**2, 0.0))
        metrics[f"by_length/seqs_{name}"] = jnp.sum(in_B.astype(jnp.float32))
    return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
