"""Plain-NumPy (float64) reference of the GSPO/GRPO losses and advantages, for parity tests.

Written from the formulas (GSPO paper §4, docs/architecture.md "The public API"), with explicit loops over sequences
and groups, and with *analytic* gradients of the policy loss w.r.t. logprobs, so that it shares
no code path with `gspo_jax.objectives` / `gspo_jax.advantages`. Garbage at masked positions
is never read. Shape letters: B responses, T tokens.
"""

import math

import numpy as np

EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Policy loss.
# ---------------------------------------------------------------------------------------------


def agg_weights(mask, mode, horizon=None, num_valid_tokens=None, num_valid_seqs=None):
    """Weights w[b, t] such that aggregate(L) = Σ_{b,t} w[b, t]·L[b, t] (w = 0 where masked)."""
    mask = np.asarray(mask, np.float64)
    num_b, num_t = mask.shape
    n_tok = mask.sum() if num_valid_tokens is None else float(num_valid_tokens)
    lens = mask.sum(axis=1)
    n_seq = float((lens > 0).sum()) if num_valid_seqs is None else float(num_valid_seqs)
    horizon = num_t if horizon is None else horizon
    w = np.zeros((num_b, num_t))
    for b in range(num_b):
        for t in range(num_t):
            if mask[b, t] == 0:
                continue
            if mode == "token-mean":
                w[b, t] = 1.0 / n_tok if n_tok > 0 else 0.0
            elif mode == "seq-mean-token-sum":
                w[b, t] = 1.0 / n_seq if n_seq > 0 else 0.0
            elif mode == "seq-mean-token-mean":
                w[b, t] = 1.0 / (n_seq * lens[b]) if n_seq > 0 else 0.0
            elif mode == "seq-mean-token-sum-norm":
                w[b, t] = 1.0 / (n_seq * horizon) if n_seq > 0 else 0.0
            else:
                raise ValueError(mode)
    return w


def aggregate(loss, mask, mode, **kwargs):
    w = agg_weights(mask, mode, **kwargs)
    total = 0.0
    for b in range(loss.shape[0]):
        for t in range(loss.shape[1]):
            if w[b, t] != 0.0:
                total += w[b, t] * float(loss[b, t])
    return total


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    importance_sampling,
    clip_low,
    clip_high,
    dual_clip_loss=False,
    dual_clip_ratio=3.0,
    loss_agg_mode="seq-mean-token-mean",
    horizon=None,
    num_valid_tokens=None,
    num_valid_seqs=None,
    weights=None,
):
    """Returns (loss, dloss/dlogprobs [B, T], metrics) in float64. `weights` [B, T]: constant
    per-token factors of L (a rollout correction's), 1 when None."""
    lp = np.asarray(logprobs, np.float64)
    old = np.asarray(old_logprobs, np.float64)
    mask = np.asarray(mask, np.float64)
    num_b, num_t = lp.shape
    adv = np.asarray(advantages, np.float64)
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], num_t, axis=1)
    w = agg_weights(mask, loss_agg_mode, horizon, num_valid_tokens, num_valid_seqs)

    ratio = np.ones((num_b, num_t))
    seq_ratio = {}
    for b in range(num_b):
        idx = [t for t in range(num_t) if mask[b, t] > 0]
        if not idx:
            continue
        if importance_sampling == "token":
            for t in idx:
                ratio[b, t] = math.exp(lp[b, t] - old[b, t])
        else:  # seq / seq_token: s_b = exp(mean_t (lp − old)) over the valid tokens
            s = math.exp(sum(lp[b, t] - old[b, t] for t in idx) / len(idx))
            seq_ratio[b] = s
            for t in idx:
                ratio[b, t] = s

    loss_tok = np.zeros((num_b, num_t))
    # dL[b,t]/dr[b,t] (0 when the clipped or dual-clipped constant is active)
    dldr = np.zeros((num_b, num_t))
    clipped = np.zeros((num_b, num_t), bool)
    low = np.zeros((num_b, num_t), bool)
    high = np.zeros((num_b, num_t), bool)
    dual = np.zeros((num_b, num_t), bool)
    for b in range(num_b):
        for t in range(num_t):
            if mask[b, t] == 0:
                continue
            a, r = adv[b, t], ratio[b, t]
            unclipped = -a * r
            clipped_term = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            if clipped_term > unclipped:
                value, deriv = clipped_term, 0.0
                clipped[b, t] = True
                low[b, t] = a < 0
                high[b, t] = a > 0
            else:
                value, deriv = unclipped, -a
            if dual_clip_loss and a < 0 and value > -a * dual_clip_ratio:
                value, deriv = -a * dual_clip_ratio, 0.0
                dual[b, t] = True
            factor = 1.0 if weights is None else float(weights[b, t])
            loss_tok[b, t] = value * factor
            dldr[b, t] = deriv * factor

    loss = float(np.sum(w * loss_tok))
    # Chain rule to logprobs. token: dr_t/dlp_t = r_t. seq: r = s_b for every token, and
    # ds_b/dlp_t' = s_b/|y_b|. seq_token: ds_{b,t}/dlp_t = s_b (local only).
    grad = np.zeros((num_b, num_t))
    for b in range(num_b):
        idx = [t for t in range(num_t) if mask[b, t] > 0]
        if not idx:
            continue
        if importance_sampling == "token" or importance_sampling == "seq_token":
            for t in idx:
                grad[b, t] = w[b, t] * dldr[b, t] * ratio[b, t]
        else:
            total = sum(w[b, t] * dldr[b, t] for t in idx)
            for t in idx:
                grad[b, t] = total * seq_ratio[b] / len(idx)

    n_tok = mask.sum()
    valid_seqs = [b for b in range(num_b) if mask[b].sum() > 0]
    if importance_sampling == "token":
        values = [ratio[b, t] for b in range(num_b) for t in range(num_t) if mask[b, t] > 0]
    else:
        values = [seq_ratio[b] for b in valid_seqs]
    lr = [lp[b, t] - old[b, t] for b in range(num_b) for t in range(num_t) if mask[b, t] > 0]
    metrics = {
        "pg_loss": loss,
        "clipfrac": clipped[mask > 0].sum() / max(n_tok, 1),
        "clipfrac_low": low[mask > 0].sum() / max(n_tok, 1),
        "clipfrac_high": high[mask > 0].sum() / max(n_tok, 1),
        "clipfrac_seq": sum(bool(clipped[b].any()) for b in valid_seqs) / max(len(valid_seqs), 1),
        "clipfrac_seq_low": sum(bool(low[b].any()) for b in valid_seqs) / max(len(valid_seqs), 1),
        "clipfrac_seq_high": sum(bool(high[b].any()) for b in valid_seqs) / max(len(valid_seqs), 1),
        "dual_clipfrac": dual[mask > 0].sum() / max(n_tok, 1),
        "ratio_min": min(values) if values else 1.0,
        "ratio_mean": float(np.mean(values)) if values else 1.0,
        "ratio_max": max(values) if values else 1.0,
        "approx_kl": -float(np.mean(lr)) if lr else 0.0,
        "approx_kl_k3": float(np.mean([math.exp(x) - 1 - x for x in lr])) if lr else 0.0,
        "num_valid_tokens": n_tok,
        "num_valid_seqs": float(len(valid_seqs)),
    }
    return loss, grad, metrics


def rollout_correction_weights(old_logprobs, rollout_logprobs, mask, mode, level, threshold):
    """Rollout-correction weights [B, T] (0 where masked): ρ = π_old / μ per token, or per
    sequence exp(mean over its valid tokens of log ρ); "tis": min(ρ, C); "mask": ρ inside
    [1/C, C], else 0. Also returns the raw ρ values (per token or per sequence)."""
    old = np.asarray(old_logprobs, np.float64)
    mu = np.asarray(rollout_logprobs, np.float64)
    w = np.zeros(old.shape)
    raw = []
    for b in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[b, t] > 0]
        if not idx:
            continue
        if level == "seq":
            rho_seq = math.exp(sum(old[b, t] - mu[b, t] for t in idx) / len(idx))
            rhos = {t: rho_seq for t in idx}
            raw.append(rho_seq)
        else:
            rhos = {t: math.exp(old[b, t] - mu[b, t]) for t in idx}
            raw.extend(rhos.values())
        for t, rho in rhos.items():
            if mode == "tis":
                w[b, t] = min(rho, threshold)
            else:
                w[b, t] = rho if 1.0 / threshold <= rho <= threshold else 0.0
    return w, raw


def kl_penalty(logprobs, ref_logprobs, estimator):
    d = np.asarray(logprobs, np.float64) - np.asarray(ref_logprobs, np.float64)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return np.exp(-d) + d - 1.0
    if estimator == "low_var_kl":
        d = np.clip(d, -20, 20)
        return np.clip(np.exp(-d) + d - 1.0, -10, 10)
    raise ValueError(estimator)


# ---------------------------------------------------------------------------------------------
# Advantages.
# ---------------------------------------------------------------------------------------------


def _mean_std(values):
    """Mean and unbiased std (0 for fewer than two values)."""
    values = np.asarray(values, np.float64)
    if len(values) == 0:
        return 0.0, 0.0
    mean = float(values.mean())
    std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return mean, std


def _norm(x, mean, std, shift, scale):
    if not shift and not scale:
        shift = scale = True
    if shift:
        x = x - mean
    if scale:
        x = x / (std + EPS)
    return x


def process_rewards(
    rewards,
    valid,
    *,
    group_size,
    reward_norm=None,
    reward_shift=False,
    reward_scale=False,
    reward_clip=None,
    history=None,
):
    """Normalise then clip. `history`: every valid reward of earlier batches (running mode)."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    idx = [i for i in range(len(rewards)) if valid[i]]
    if reward_norm is None:
        for i in idx:
            out[i] = rewards[i]
    elif reward_norm in ("batch", "running"):
        pool = [rewards[i] for i in idx]
        if reward_norm == "running":
            pool = list(history if history is not None else []) + pool
        mean, std = _mean_std(pool)
        for i in idx:
            out[i] = _norm(rewards[i], mean, std, reward_shift, reward_scale)
    elif reward_norm == "group":
        for start in range(0, len(rewards), group_size):
            members = [i for i in idx if start <= i < start + group_size]
            mean, std = _mean_std([rewards[i] for i in members])
            for i in members:
                out[i] = _norm(rewards[i], mean, std, reward_shift, reward_scale)
    else:
        raise ValueError(reward_norm)
    if reward_clip is not None:
        for i in idx:
            out[i] = min(max(out[i], -reward_clip), reward_clip)
    return out


def compute_advantages(
    rewards,
    *,
    group_size,
    adv_estimator,
    reward_clip=None,
    reward_norm=None,
    reward_shift=False,
    reward_scale=False,
    whiten_advantages=False,
    advantage_clip=None,
    mask=None,
    history=None,
):
    rewards = np.asarray(rewards, np.float64)
    valid = np.ones(len(rewards), bool) if mask is None else np.asarray(mask) > 0
    r = process_rewards(
        rewards,
        valid,
        group_size=group_size,
        reward_norm=reward_norm,
        reward_shift=reward_shift,
        reward_scale=reward_scale,
        reward_clip=reward_clip,
        history=history,
    )
    adv = np.zeros_like(r)
    idx = [i for i in range(len(r)) if valid[i]]
    if adv_estimator == "grpo":
        for start in range(0, len(r), group_size):
            members = [i for i in idx if start <= i < start + group_size]
            mean, std = _mean_std([r[i] for i in members])
            for i in members:
                adv[i] = (r[i] - mean) / (std + EPS)
    elif adv_estimator == "reinforce":
        for i in idx:
            adv[i] = r[i]
    else:
        raise ValueError(adv_estimator)
    if whiten_advantages:
        mean, std = _mean_std([adv[i] for i in idx])
        for i in idx:
            adv[i] = (adv[i] - mean) / (std + EPS)
    if advantage_clip is not None:
        for i in idx:
            adv[i] = min(max(adv[i], -advantage_clip), advantage_clip)
    return adv


def token_level_returns(token_rewards, mask, gamma=1.0):
    """R_t = Σ over later valid tokens t' of γ^(#valid tokens in (t, t']) r_t'; 0 if masked."""
    token_rewards = np.asarray(token_rewards, np.float64)
    num_b, num_t = token_rewards.shape
    out = np.zeros((num_b, num_t))
    for b in range(num_b):
        valid_t = [t for t in range(num_t) if mask[b, t] > 0]
        for k, t in enumerate(valid_t):
            out[b, t] = sum(gamma**j * token_rewards[b, t2] for j, t2 in enumerate(valid_t[k:]))
    return out
