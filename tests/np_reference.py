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


def rollout_correction_weights(old_logprobs, sampler_logprobs, mask, mode, level, threshold):
    """Rollout-correction weights [B, T] (0 where masked): ρ = π_old / μ per token, or per
    sequence exp(mean over its valid tokens of log ρ); "tis": min(ρ, C); "mask": ρ inside
    [1/C, C], else 0. Also returns the raw ρ values (per token or per sequence)."""
    old = np.asarray(old_logprobs, np.float64)
    mu = np.asarray(sampler_logprobs, np.float64)
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


# ---------------------------------------------------------------------------------------------
# The GSPO family (loss_mode), written from docs/objectives.md with analytic gradients.
# ---------------------------------------------------------------------------------------------


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _binary_kl(a, b):
    """KL(a ‖ b) of two Bernoulli distributions (0·log 0 = 0)."""

    def term(x, y):
        if x == 0.0:
            return 0.0
        if y == 0.0:
            return math.inf
        return x * math.log(x / y)

    return term(a, b) + term(1.0 - a, 1.0 - b)


def family_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    loss_mode,
    importance_sampling="token",
    clip_low=0.2,
    clip_high=0.2,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    dppo_delta_low=0.15,
    dppo_delta_high=0.15,
    dppo_max_weight=5.0,
    opsm_delta=None,
    sampler_logprobs=None,
    loss_agg_mode="seq-mean-token-mean",
    horizon=None,
    num_valid_tokens=None,
    num_valid_seqs=None,
):
    """(loss, dloss/dlogprobs [B, T], metrics) of the non-clip loss modes in float64.

    Per token, with r the importance_sampling ratio (token: r_t; seq / seq_token: s_b):
      sapo:  L = −A·(4/τ)·σ(τ(r − 1)),  dL/dr = −A·4σ(1 − σ)  (the gate, sech²(τ(r − 1)/2))
      cispo: L = −w·A·lp, w = clip(r, 1 − cl, 1 + ch) constant: dL/dlp_t = −w·A
      dppo:  L = −min(r, W)·A·lp·m, constant weight and mask: dL/dlp_t = −min(r, W)·A·m
      gmpo:  L_t = −A_t·ρ_b, log ρ_b = mean over the sequence of the log-space-clipped token
             log-ratios: dL_t/dlp_t' = −A_t·ρ_b·u_t'/n_b (u: the token's term is unclipped)
    OPSM zeroes every token of a masked sequence. Metrics: limited_frac, limited_frac_seq,
    weight_mean, opsm_masked_frac (with opsm_delta).
    """
    lp = np.asarray(logprobs, np.float64)
    old = np.asarray(old_logprobs, np.float64)
    mask = np.asarray(mask, np.float64)
    num_b, num_t = lp.shape
    adv = np.asarray(advantages, np.float64)
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], num_t, axis=1)
    w = agg_weights(mask, loss_agg_mode, horizon, num_valid_tokens, num_valid_seqs)
    loss_tok = np.zeros((num_b, num_t))
    grad = np.zeros((num_b, num_t))
    limited = np.zeros((num_b, num_t), bool)
    weight = np.zeros((num_b, num_t))
    opsm_seqs = 0
    valid_seqs = 0
    for b in range(num_b):
        idx = [t for t in range(num_t) if mask[b, t] > 0]
        if not idx:
            continue
        valid_seqs += 1
        n = len(idx)
        log_s = sum(lp[b, t] - old[b, t] for t in idx) / n
        opsm = False
        if opsm_delta is not None:
            mu = np.asarray(sampler_logprobs, np.float64)
            gap = sum(mu[b, t] - lp[b, t] for t in idx) / n
            adv_b = sum(adv[b, t] for t in idx) / n
            opsm = adv_b < 0 and gap > opsm_delta
            opsm_seqs += int(opsm)
        # d r_{b,t} / d lp_{b,t'}: token and seq_token: r (own token); seq: s/n (every token)
        ratio = {}
        for t in idx:
            ratio[t] = (
                math.exp(lp[b, t] - old[b, t])
                if importance_sampling == "token"
                else (math.exp(log_s))
            )
        dldr = {}
        dldlp = {}
        if loss_mode == "gmpo":
            assert importance_sampling == "token"
            terms, unclipped = {}, {}
            for t in idx:
                a, x = float(adv[b, t]), float(lp[b, t] - old[b, t])
                sgn = int(a > 0) - int(a < 0)
                clipped_x = min(max(x, -clip_low), clip_high)
                terms[t] = sgn * min(sgn * x, sgn * clipped_x)
                unclipped[t] = sgn != 0 and sgn * x <= sgn * clipped_x
                limited[b, t] = sgn != 0 and not unclipped[t]
                weight[b, t] = 0.0 if limited[b, t] else 1.0
            rho = math.exp(sum(terms.values()) / n)
            for t in idx:
                loss_tok[b, t] = -adv[b, t] * rho
            if not opsm:
                for t2 in idx:
                    if unclipped[t2]:
                        grad[b, t2] += sum(w[b, t] * -adv[b, t] * rho for t in idx) / n
        else:
            for t in idx:
                a, r = adv[b, t], ratio[t]
                if loss_mode == "sapo":
                    tau = sapo_tau_pos if a > 0 else sapo_tau_neg
                    sig = _sigmoid(tau * (r - 1.0))
                    loss_tok[b, t] = -a * 4.0 / tau * sig
                    gate = 4.0 * sig * (1.0 - sig)
                    dldr[t] = -a * gate
                    weight[b, t] = gate
                    limited[b, t] = a != 0 and gate < 0.5
                elif loss_mode == "cispo":
                    wt = min(max(r, 1.0 - clip_low), 1.0 + clip_high)
                    loss_tok[b, t] = -wt * a * lp[b, t]
                    dldlp[t] = -wt * a
                    weight[b, t] = wt
                    limited[b, t] = a != 0 and wt != r
                elif loss_mode in ("dppo_tv", "dppo_kl"):
                    p, p_old = math.exp(lp[b, t]), math.exp(old[b, t])
                    if loss_mode == "dppo_tv":
                        up, down = p - p_old > dppo_delta_high, p - p_old < -dppo_delta_low
                    else:
                        beyond = _binary_kl(p_old, p) > dppo_delta_high
                        up, down = beyond and p > p_old, beyond and p < p_old
                    keep = 0.0 if (a > 0 and up) or (a < 0 and down) else 1.0
                    wt = min(r, dppo_max_weight)
                    loss_tok[b, t] = -wt * a * lp[b, t] * keep
                    dldlp[t] = -wt * a * keep
                    weight[b, t] = keep
                    limited[b, t] = a != 0 and (keep == 0.0 or r > dppo_max_weight)
                else:
                    raise ValueError(loss_mode)
            if not opsm:
                for t in idx:
                    grad[b, t] += w[b, t] * dldlp.get(t, 0.0)
                    if t in dldr:
                        if importance_sampling == "seq":
                            for t2 in idx:
                                grad[b, t2] += w[b, t] * dldr[t] * ratio[t] / n
                        else:
                            grad[b, t] += w[b, t] * dldr[t] * ratio[t]
        if opsm:
            for t in idx:
                loss_tok[b, t] = 0.0
                limited[b, t] = True
                weight[b, t] = 0.0
    loss = float(np.sum(w * loss_tok))
    n_tok = max(mask.sum(), 1)
    seq_limited = sum(bool(limited[b][mask[b] > 0].any()) for b in range(num_b))
    metrics = {
        "limited_frac": float(limited[mask > 0].sum() / n_tok),
        "limited_frac_seq": seq_limited / max(valid_seqs, 1),
        "weight_mean": float(weight[mask > 0].sum() / n_tok),
    }
    if opsm_delta is not None:
        metrics["opsm_masked_frac"] = opsm_seqs / max(valid_seqs, 1)
    return loss, grad, metrics


def rloo_advantages(rewards, group_size, valid=None):
    """Â_i = r_i − mean of the other valid members of i's group (0 alone in its group)."""
    rewards = np.asarray(rewards, np.float64)
    valid = np.ones(len(rewards), bool) if valid is None else np.asarray(valid) > 0
    adv = np.zeros_like(rewards)
    for start in range(0, len(rewards), group_size):
        members = [i for i in range(start, start + group_size) if valid[i]]
        for i in members:
            others = [rewards[j] for j in members if j != i]
            adv[i] = rewards[i] - sum(others) / len(others) if others else 0.0
    return adv


def dr_grpo_advantages(rewards, group_size, valid=None):
    """Dr. GRPO: Â_i = r_i − mean of i's group (no division by the std)."""
    rewards = np.asarray(rewards, np.float64)
    valid = np.ones(len(rewards), bool) if valid is None else np.asarray(valid) > 0
    adv = np.zeros_like(rewards)
    for start in range(0, len(rewards), group_size):
        members = [i for i in range(start, start + group_size) if valid[i]]
        mean = sum(rewards[i] for i in members) / max(len(members), 1)
        for i in members:
            adv[i] = rewards[i] - mean
    return adv
