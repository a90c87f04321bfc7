"""The GSPO family's per-token losses (`loss_mode`): clip (GSPO / GRPO's clipped
surrogate), SAPO, CISPO, GMPO, DPPO (TV and KL), and off-policy sequence masking. Each gets
the ratio r that `importance_sampling` selects (r_t per token, or s_i on every token of
sequence i) in a `LossInputs`, and returns its loss [B, T] and which tokens it limited.
`objectives.policy_loss` calls them; docs/objectives.md has each formula and its paper.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.masked import row_mean
from gspo_jax.registry import Registry

Array = jax.Array


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
    loss_BT, flags = clipped_loss(x.ratio, x.adv, x.valid, x.hp["clip_low"], x.hp["clip_high"])
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


def opsm_mask(x: LossInputs, rollout_BT: Array, delta) -> Array:
    """Off-policy sequence masking (DeepSeek-V3.2, §3): bool [B, T], True on every token of a
    sequence with A < 0 whose mean_t (log μ − log π_θ) over its valid tokens exceeds δ (the
    sequence's advantage: the mean of its tokens'). No gradient (a mask)."""
    gap_B = row_mean(rollout_BT - jax.lax.stop_gradient(x.logp), x.mask)
    adv_B = row_mean(x.adv, x.mask)
    masked_B = jnp.any(x.valid, axis=-1) & (adv_B < 0) & (gap_B > delta)
    return x.valid & masked_B[:, None]


def clipped_loss(ratio_BT, adv_BT, valid_BT, clip_low, clip_high):
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
