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
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.correction import (  # noqa: F401 (objectives.* names)
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTIONS,
    correction_args,
    rollout_correction_weights,
)
from gspo_jax.algorithm.kl import (  # noqa: F401 (objectives.* names)
    KL_ESTIMATORS,
    kl_penalty,
    register_kl_estimator,
)
from gspo_jax.algorithm.losses import (  # noqa: F401 (objectives.* names)
    LOSS_MODES,
    LossInputs,
    LossMode,
    clipped_loss,
    opsm_mask,
    register_loss_mode,
)
from gspo_jax.algorithm.masked import row_mean, safe_count
from gspo_jax.algorithm.policy_metrics import (  # noqa: F401 (objectives.* names)
    LENGTH_EDGES,
    length_buckets,
    policy_metrics,
)
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


def register_importance_sampling(name: str, *, sequence_level: bool):
    """Decorator registering a log-ratio function as importance_sampling `name`."""

    def decorator(fn):
        RATIOS.add(name, Ratio(fn, sequence_level))
        return fn

    return decorator


def register_loss_agg(name: str):
    """Decorator registering an aggregation `fn(loss_BT, mask_BT, *, horizon,
    num_valid_tokens, num_valid_seqs) -> scalar` as loss_agg_mode `name`."""
    return LOSS_AGG_MODES.decorator(name)


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
    sampler_logprobs: Array | None = None,
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
    rollout_logprobs: Array | None = None,
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
    `sampler_logprobs`, the sampler's); the denominators are unchanged.

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
      sampler_logprobs: [B, T] log μ, the sampler's log-probs of the tokens (needed with a
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
      rollout_logprobs: the old name of `sampler_logprobs` (a DeprecationWarning; until the
        next release).

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
    sampler_logprobs = _renamed(sampler_logprobs, rollout_logprobs)
    ratio = RATIOS.get(importance_sampling)
    mode = LOSS_MODES.get(loss_mode)
    _check_policy_args(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    hp = dict(clip_low=clip_low, clip_high=clip_high, sapo_tau_pos=sapo_tau_pos)  # noqa: C408
    hp |= dict(sapo_tau_neg=sapo_tau_neg, dppo_delta_low=dppo_delta_low)  # noqa: C408
    hp |= dict(dppo_delta_high=dppo_delta_high, dppo_max_weight=dppo_max_weight)  # noqa: C408
    _check_loss_mode(loss_mode, mode, importance_sampling, hp, dual_clip_loss, opsm_delta)
    clamp = 20.0 if log_ratio_clamp is None else log_ratio_clamp
    mu = sampler_logprobs if rollout_correction != "none" or opsm_delta is None else None
    correction = correction_args(
        mu, rollout_correction, level=rollout_correction_level,
        threshold=rollout_correction_threshold, log_ratio_clamp=clamp,
    )  # fmt: skip
    _check_extras(sampler_logprobs, opsm_delta, dual_clip_loss, dual_clip_ratio)
    mask_BT, valid_BT, logp_BT, old_BT, adv_BT = _sanitised(
        logprobs, old_logprobs, advantages, mask
    )
    log_ratio_BT = ratio.log_ratio(logp_BT, old_BT, mask_BT)
    if log_ratio_clamp is not None:
        log_ratio_BT = jnp.clip(log_ratio_BT, -log_ratio_clamp, log_ratio_clamp)
    ratio_BT = jnp.where(valid_BT, jnp.exp(log_ratio_BT), 1.0)
    inputs = LossInputs(logp_BT, old_BT, log_ratio_BT, ratio_BT, adv_BT, valid_BT, mask_BT, hp)
    loss_BT, flags = mode.loss(inputs)
    flags["limited"] = flags["low"] | flags["high"]
    loss_BT = _dual_clip(loss_BT, inputs, flags, dual_clip_ratio if dual_clip_loss else None)
    opsm_metrics = {}
    if opsm_delta is not None:
        loss_BT, opsm_metrics = _off_policy_masking(
            loss_BT, inputs, flags, sampler_logprobs, opsm_delta
        )
    correction_metrics = {}
    if correction is not None:
        weight_BT, correction_metrics = rollout_correction_weights(
            old_BT, correction.pop("sampler_logprobs"), mask_BT, **correction
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
    metrics = policy_metrics(
        ratio.sequence_level, loss, logp_BT, old_BT, mask_BT, ratio_BT, flags, clamp
    )
    return loss, {**metrics, **opsm_metrics, **correction_metrics}


def _sanitised(logprobs, old_logprobs, advantages, mask):
    """(mask, valid, log π_θ, log π_old, A [B, T]) in f32, 0 at masked positions: garbage
    (-inf, NaN) there is replaced before any arithmetic (the "safe where"), so neither values
    nor gradients (0 · inf) can become NaN; π_old and A carry no gradient."""
    mask_BT = jnp.asarray(mask, jnp.float32)
    valid_BT = mask_BT > 0
    logp_BT = jnp.where(valid_BT, logprobs.astype(jnp.float32), 0.0)
    old_BT = jax.lax.stop_gradient(jnp.where(valid_BT, old_logprobs.astype(jnp.float32), 0.0))
    adv_BT = advantages[:, None] if advantages.ndim == 1 else advantages
    adv_BT = jnp.where(valid_BT, jnp.broadcast_to(adv_BT, logp_BT.shape), 0.0)
    return mask_BT, valid_BT, logp_BT, old_BT, jax.lax.stop_gradient(adv_BT.astype(jnp.float32))


def _renamed(sampler_logprobs, rollout_logprobs):
    """`rollout_logprobs`, the old name of `sampler_logprobs`, read for one release."""
    if rollout_logprobs is None:
        return sampler_logprobs
    warnings.warn(
        "policy_loss(rollout_logprobs=...) is now sampler_logprobs=", DeprecationWarning, 3
    )
    return rollout_logprobs if sampler_logprobs is None else sampler_logprobs


def _dual_clip(loss_BT, x: LossInputs, flags: dict, ratio: float | None):
    """verl / ROLL's dual clip (ratio c, None: off): a negative-advantage token whose ratio
    exploded is capped at −A·c (constant, no gradient) instead of growing without bound."""
    if ratio is None:
        flags["dual"] = jnp.zeros_like(x.valid)
        return loss_BT
    cap_BT = -x.adv * ratio
    flags["dual"] = x.valid & (x.adv < 0) & (loss_BT > cap_BT)
    flags["limited"] = flags["limited"] | flags["dual"]
    flags["weight"] = jnp.where(flags["dual"], 0.0, flags["weight"])
    return jnp.where(flags["dual"], cap_BT, loss_BT)


def _off_policy_masking(loss_BT, x: LossInputs, flags: dict, sampler_logprobs, delta):
    """OPSM (DeepSeek-V3.2 §3, `losses.opsm_mask`): the masked sequences' tokens get no
    loss; returns (loss, {"opsm_masked_frac": the fraction of valid sequences masked})."""
    rollout_BT = jnp.where(x.valid, sampler_logprobs.astype(jnp.float32), 0.0)
    opsm_BT = opsm_mask(x, jax.lax.stop_gradient(rollout_BT), delta)
    flags["limited"] = flags["limited"] | opsm_BT
    flags["weight"] = jnp.where(opsm_BT, 0.0, flags["weight"])
    opsm_B = jnp.any(opsm_BT, axis=-1)
    n_seq = jnp.sum(jnp.any(x.valid, axis=-1).astype(jnp.float32))
    frac = jax.lax.stop_gradient(jnp.sum(opsm_B.astype(jnp.float32)) / safe_count(n_seq))
    return jnp.where(opsm_BT, 0.0, loss_BT), {"opsm_masked_frac": frac}


def _check_extras(sampler_logprobs, opsm_delta, dual_clip_loss, dual_clip_ratio) -> None:
    if opsm_delta is not None and sampler_logprobs is None:
        raise ValueError(
            "policy_loss: opsm_delta (off-policy sequence masking) needs sampler_logprobs, "
            "the sampler's log-probs μ"
        )
    if dual_clip_loss and isinstance(dual_clip_ratio, int | float) and dual_clip_ratio <= 1.0:
        raise ValueError(f"policy_loss: dual_clip_ratio must be > 1, got {dual_clip_ratio}")


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
