"""Specifications of the GSPO family (`loss_mode`, off-policy sequence masking) in
gspo_jax.objectives: parity with the float64 NumPy reference (tests/np_reference.py, value
and gradient w.r.t. the log-probs), hand examples at the boundaries, micro-batch split
invariance, and one-line errors. docs/objectives.md states the formulas.

Functions run eagerly (tiny shapes dispatch faster than they compile).
"""

import itertools
import math

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from gspo_jax import objectives as obj

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# (loss_mode, importance_sampling) pairs the parity test covers: every mode at token level,
# the modes that read r alone at sequence level too (GMPO needs token log-ratios).
CASES = (
    ("sapo", "token"),
    ("sapo", "seq"),
    ("sapo", "seq_token"),
    ("cispo", "token"),
    ("cispo", "seq"),
    ("gmpo", "token"),
    ("dppo_tv", "token"),
    ("dppo_tv", "seq"),
    ("dppo_kl", "token"),
)
# Parameters that make every mode act on _random_batch's drift (a few limited tokens each).
PARAMS = {
    "clip_low": 0.1,
    "clip_high": 0.15,
    "dppo_delta_low": 0.05,
    "dppo_delta_high": 0.05,
    "dppo_max_weight": 1.2,
}


def _loss_and_grad(logprobs, old, adv, mask, **kwargs):
    """(loss, metrics, dloss/dlogprobs) of policy_loss, eagerly."""

    def f(lp):
        return obj.policy_loss(lp, old, adv, mask, **kwargs)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logprobs))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def _random_batch(seed, num_b=6, num_t=5, *, token_adv=False):
    """Off-policy inputs around probabilities 0.1-0.8 (so DPPO's probability differences
    matter), ragged masks, one fully masked row, garbage at masked positions, and sampler
    log-probs μ for OPSM."""
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.1, 0.8, (num_b, num_t)))
    lp = old + rng.uniform(-0.3, 0.3, (num_b, 1)) + rng.normal(0.0, 0.2, (num_b, num_t))
    lp = np.minimum(lp, -1e-3)
    mu = old + rng.normal(0.0, 0.3, (num_b, num_t))
    lengths = rng.integers(1, num_t + 1, num_b)
    mask = (np.arange(num_t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[num_b // 2] = 0.0
    adv = rng.normal(size=(num_b, num_t) if token_adv else (num_b,))
    lp[mask == 0] = -np.inf
    old[mask == 0] = np.nan
    mu[mask == 0] = np.nan
    f32 = np.float32
    return lp.astype(f32), old.astype(f32), adv.astype(f32), mask, mu.astype(f32)


# ---------------------------------------------------------------------------------------------
# Parity with the NumPy reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_mode,importance_sampling", CASES)
def test_parity_with_numpy_reference(loss_mode, importance_sampling):
    for seed, (agg, token_adv) in enumerate(itertools.product(AGG_MODES, (False, True))):
        lp, old, adv, mask, mu = _random_batch(200 + seed, token_adv=token_adv)
        opsm = 0.05 if seed % 4 in (0, 1) else None
        kwargs = dict(PARAMS, loss_mode=loss_mode, importance_sampling=importance_sampling)
        kwargs.update(loss_agg_mode=agg, opsm_delta=opsm)
        if seed % 4 in (1, 2):  # as one micro-batch of a larger mini-batch
            kwargs.update(num_valid_tokens=40.0, num_valid_seqs=11.0, horizon=7)
        mu_kw = {"sampler_logprobs": mu} if opsm is not None else {}
        loss, m, grad = _loss_and_grad(lp, old, adv, mask, **kwargs, **mu_kw)
        r_loss, r_grad, r_m = ref.family_loss(lp, old, adv, mask, **kwargs, **mu_kw)
        case = (agg, token_adv, opsm)
        np.testing.assert_allclose(loss, r_loss, rtol=2e-5, atol=1e-7, err_msg=str(case))
        np.testing.assert_allclose(grad, r_grad, rtol=2e-5, atol=1e-7, err_msg=str(case))
        for key, value in r_m.items():
            assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (case, key)
        assert np.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_the_examples_exercise_every_mode():
    """The parity inputs are not trivial: each mode limits some tokens and not others, and
    OPSM masks some sequences and not others."""
    lp, old, adv, mask, mu = _random_batch(200)
    for loss_mode, importance_sampling in CASES:
        _, m, _ = _loss_and_grad(
            lp,
            old,
            adv,
            mask,
            **PARAMS,
            loss_mode=loss_mode,
            importance_sampling=importance_sampling,
            loss_agg_mode="token-mean",
        )
        if loss_mode == "sapo":  # soft: the gate lowers every gradient a little, none by half
            assert 0.5 < m["weight_mean"] < 1.0, m["weight_mean"]
        elif importance_sampling == "token":
            assert 0.0 < m["limited_frac"] < 1.0, (loss_mode, m["limited_frac"])
    fracs = []
    for seed in range(200, 232):
        lp, old, adv, mask, mu = _random_batch(seed)
        _, m, _ = _loss_and_grad(
            lp,
            old,
            adv,
            mask,
            **PARAMS,
            loss_mode="cispo",
            importance_sampling="token",
            opsm_delta=0.05,
            sampler_logprobs=mu,
        )
        fracs.append(m["opsm_masked_frac"])
    assert min(fracs) < max(fracs) and 0.0 < np.mean(fracs) < 1.0


def test_gmpo_reference_gradient_matches_finite_differences():
    # GMPO has no stop-gradient in its value: the reference's analytic gradient is checked
    # against central differences of its own float64 loss.
    lp, old, adv, mask, _ = _random_batch(7, num_b=4, num_t=3, token_adv=True)
    base = lp.astype(np.float64)
    for agg in AGG_MODES:
        kwargs = {"loss_mode": "gmpo", "clip_low": 0.1, "clip_high": 0.15, "loss_agg_mode": agg}
        _, grad, _ = ref.family_loss(base, old, adv, mask, **kwargs)
        for b, t in zip(*np.nonzero(mask), strict=True):
            up, down = base.copy(), base.copy()
            up[b, t] += 1e-6
            down[b, t] -= 1e-6
            fd = (
                ref.family_loss(up, old, adv, mask, **kwargs)[0]
                - ref.family_loss(down, old, adv, mask, **kwargs)[0]
            ) / 2e-6
            assert grad[b, t] == pytest.approx(fd, rel=1e-4, abs=1e-7), (agg, b, t)


# ---------------------------------------------------------------------------------------------
# Hand examples.
# ---------------------------------------------------------------------------------------------


def test_sapo_gate_is_one_on_policy_and_uses_the_temperature_of_the_advantage_sign():
    # On policy r = 1: f(1) = (4/τ)·σ(0) = 2/τ, the gate sech²(0) = 1, so the gradient is
    # the plain policy gradient −A. Rows: A = +1 (τ_pos = 1) and A = −1 (τ_neg = 2).
    lp = np.log(np.array([[0.5], [0.5]], np.float32))
    adv = np.array([1.0, -1.0], np.float32)
    mask = np.ones((2, 1), np.float32)
    kwargs = {"importance_sampling": "token", "clip_low": 0.2, "clip_high": 0.2}
    kwargs.update(loss_mode="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0, loss_agg_mode="token-mean")
    loss, m, grad = _loss_and_grad(lp, lp, adv, mask, **kwargs)
    assert loss == pytest.approx((-2.0 / 1.0 + 2.0 / 2.0) / 2)  # (−A·2/τ) averaged
    np.testing.assert_allclose(grad[:, 0], [-0.5, 0.5], rtol=1e-6)
    assert m["weight_mean"] == 1.0 and m["limited_frac"] == 0.0
    # Off policy, log r = 1.2 (r = 3.3201): gate = sech²(τ(r − 1)/2): τ = 1 -> 0.32586;
    # τ = 2 -> 0.037887; both under ½: limited. Gradient −A·gate·r / 2 tokens.
    r = math.exp(1.2)
    old = lp - 1.2
    _, m, grad = _loss_and_grad(lp, old, adv, mask, **kwargs)
    gates = [1.0 / math.cosh(tau * (r - 1) / 2) ** 2 for tau in (1.0, 2.0)]
    np.testing.assert_allclose(gates, [0.32586, 0.037887], rtol=1e-4)
    np.testing.assert_allclose(grad[:, 0], [-gates[0] * r / 2, gates[1] * r / 2], rtol=1e-5)
    assert m["weight_mean"] == pytest.approx(sum(gates) / 2, rel=1e-5)
    assert m["limited_frac"] == 1.0


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    # token-mean over 4 tokens, cap 1 + 4 = 5, no lower bound (clip_low = 1): r = 8 -> w = 5
    # (limited), r = 2 -> 2, r = 0.1 -> 0.1, r = 1 -> 1. dL/dlp_t = −w_t·A_t / 4: every token
    # keeps its gradient, the clipped one included (PPO's clip would zero it).
    r = np.array([8.0, 2.0, 0.1, 1.0])
    lp = np.log(np.array([[0.4, 0.3, 0.2, 0.6]], np.float32))
    old = (lp - np.log(r)).astype(np.float32)
    adv = np.array([[1.0, -2.0, 0.5, -1.0]], np.float32)
    mask = np.ones((1, 4), np.float32)
    kwargs = {"importance_sampling": "token", "clip_low": 1.0, "clip_high": 4.0}
    _, m, grad = _loss_and_grad(
        lp, old, adv, mask, loss_mode="cispo", loss_agg_mode="token-mean", **kwargs
    )
    w = np.array([5.0, 2.0, 0.1, 1.0])
    np.testing.assert_allclose(grad[0], -w * adv[0] / 4, rtol=1e-5)
    assert m["limited_frac"] == pytest.approx(0.25)
    assert m["weight_mean"] == pytest.approx(w.mean(), rel=1e-5)


def test_gmpo_hand_example():
    # One sequence, A = +1, token log-ratios [0.6, 0.1, −0.6], ε = 0.4 / 0.4 in log space:
    # token 0 clipped to 0.4 (A > 0, above), token 2 kept (A > 0 keeps the lower side).
    # log ρ = (0.4 + 0.1 − 0.6)/3 = −0.1/3; L = −ρ; dL/dlp_t = −ρ/3 for tokens 1, 2, 0 for 0.
    x = np.array([[0.6, 0.1, -0.6]], np.float32)
    old = np.full((1, 3), -1.0, np.float32)
    lp = old + x
    mask = np.ones((1, 3), np.float32)
    kwargs = {"importance_sampling": "token", "clip_low": 0.4, "clip_high": 0.4}
    for a in (1.0, -1.0):
        loss, m, grad = _loss_and_grad(
            lp, old, np.array([a], np.float32), mask, loss_mode="gmpo", **kwargs
        )
        if a > 0:
            rho = math.exp((0.4 + 0.1 - 0.6) / 3)
            want = [0.0, -rho / 3, -rho / 3]
        else:  # A < 0 clips the lower side: token 2 -> −0.4, token 0 kept
            rho = math.exp((0.6 + 0.1 - 0.4) / 3)
            want = [rho / 3, rho / 3, 0.0]
        assert loss == pytest.approx(-a * rho, rel=1e-6)
        np.testing.assert_allclose(grad[0], want, rtol=1e-5)
        assert m["limited_frac"] == pytest.approx(1 / 3)


def test_dppo_masks_at_their_boundaries():
    # p_old = 0.5 everywhere, δ = 0.1 (TV). p − p_old ∈ {+0.099, +0.101, −0.099, −0.101}.
    p = np.array([[0.599, 0.601, 0.401, 0.399]])
    lp = np.log(p).astype(np.float32)
    old = np.log(np.full((1, 4), 0.5)).astype(np.float32)
    mask = np.ones((1, 4), np.float32)
    kwargs = {"importance_sampling": "token", "clip_low": 0.2, "clip_high": 0.2}
    kwargs.update(dppo_delta_low=0.1, dppo_delta_high=0.1, dppo_max_weight=10.0)
    kwargs["loss_agg_mode"] = "token-mean"

    def keep(adv, mode="dppo_tv", **extra):
        _, m, grad = _loss_and_grad(
            lp, old, np.array([[adv] * 4], np.float32), mask, loss_mode=mode, **kwargs | extra
        )
        return (grad[0] != 0).astype(int).tolist(), m

    # A > 0: only the token that rose by more than δ_high is masked.
    assert keep(1.0)[0] == [1, 0, 1, 1]
    # A < 0: only the token that fell by more than δ_low is masked.
    assert keep(-1.0)[0] == [1, 1, 1, 0]
    _, m = keep(-1.0)
    assert m["weight_mean"] == 0.75 and m["limited_frac"] == 0.25
    # KL variant: KL(0.5 ‖ 0.601) = 0.020830, KL(0.5 ‖ 0.599) = 0.019997 (and the same below
    # 0.5 by symmetry): δ = 0.0204 separates them.
    assert ref._binary_kl(0.5, 0.601) == pytest.approx(0.020830, abs=1e-6)
    assert ref._binary_kl(0.5, 0.599) == pytest.approx(0.019997, abs=1e-6)
    assert keep(1.0, "dppo_kl", dppo_delta_high=0.0204)[0] == [1, 0, 1, 1]
    assert keep(-1.0, "dppo_kl", dppo_delta_high=0.0204)[0] == [1, 1, 1, 0]
    # The weight cap: r = 1.202 > W = 1.1 -> weight 1.1 (limited, kept).
    _, m, grad = _loss_and_grad(
        lp,
        old,
        np.ones((1, 4), np.float32),
        mask,
        loss_mode="dppo_tv",
        **kwargs | {"dppo_max_weight": 1.1, "dppo_delta_high": 1.0},
    )
    np.testing.assert_allclose(grad[0], -np.minimum(p[0] / 0.5, 1.1) / 4, rtol=1e-5)
    assert m["limited_frac"] == 0.5  # 0.601 and 0.599 capped; 0.401 and 0.399 not


def test_opsm_masks_negative_sequences_beyond_delta_only():
    # 4 sequences of 2 tokens, π_θ = π_old; mean(log μ − log π_θ) = gap_b; δ = 0.1.
    #   row 0: A < 0, gap 0.2  -> masked     row 1: A > 0, gap 0.2 -> kept (A > 0)
    #   row 2: A < 0, gap 0.05 -> kept       row 3: A < 0, gap 0.15 but one token padding
    gaps = np.array([0.2, 0.2, 0.05, 0.15])
    lp = np.full((4, 2), -1.0, np.float32)
    mu = (lp + np.array([[g - 0.05, g + 0.05] for g in gaps])).astype(np.float32)
    mask = np.ones((4, 2), np.float32)
    mask[3, 1] = 0.0
    mu[3, 0] = lp[3, 0] + 0.15  # row 3's gap over its one valid token: 0.15 -> masked
    mu[3, 1] = np.nan
    adv = np.array([-1.0, 1.0, -1.0, -1.0], np.float32)
    for mode in ("clip", "sapo", "cispo", "dppo_tv"):
        kwargs = {"importance_sampling": "token", "clip_low": 0.2, "clip_high": 0.2}
        _, m, grad = _loss_and_grad(
            lp, lp, adv, mask, loss_mode=mode, opsm_delta=0.1, sampler_logprobs=mu, **kwargs
        )
        assert (grad[[0, 3]] == 0).all() and (grad[[1, 2]] != 0).all(), mode
        assert m["opsm_masked_frac"] == 0.5 and m["limited_frac_seq"] == 0.5, mode
        if mode == "clip":
            assert m["clipfrac"] == 0.0  # OPSM is not the clip: clipfrac keeps its meaning


def test_clip_mode_is_the_default_bit_for_bit():
    lp, old, adv, mask, _ = _random_batch(3)
    kwargs = {"importance_sampling": "seq", "clip_low": 0.1, "clip_high": 0.15}
    loss, m, grad = _loss_and_grad(lp, old, adv, mask, **kwargs)
    loss2, m2, grad2 = _loss_and_grad(lp, old, adv, mask, loss_mode="clip", **kwargs)
    assert loss == loss2 and m == m2 and (grad == grad2).all()
    assert m["limited_frac"] == m["clipfrac"] and m["weight_mean"] == 1.0 - m["clipfrac"]


# ---------------------------------------------------------------------------------------------
# Micro-batching.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_mode,importance_sampling", CASES[::2] + (("gmpo", "token"),))
def test_micro_batch_split_with_global_denominators_is_invariant(loss_mode, importance_sampling):
    lp, old, adv, mask, mu = _random_batch(11, num_b=8, num_t=5)
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    for agg in AGG_MODES:
        kwargs = dict(PARAMS, loss_mode=loss_mode, importance_sampling=importance_sampling)
        kwargs.update(loss_agg_mode=agg, opsm_delta=0.05)
        loss_full, _, grad_full = _loss_and_grad(lp, old, adv, mask, sampler_logprobs=mu, **kwargs)
        loss_sum, grads = 0.0, []
        for sl in [slice(i, i + 2) for i in range(0, 8, 2)]:
            loss_i, _, grad_i = _loss_and_grad(
                lp[sl],
                old[sl],
                adv[sl],
                mask[sl],
                sampler_logprobs=mu[sl],
                num_valid_tokens=n_tok,
                num_valid_seqs=n_seq,
                **kwargs,
            )
            loss_sum += loss_i
            grads.append(grad_i)
        np.testing.assert_allclose(loss_sum, loss_full, rtol=1e-5, atol=1e-7, err_msg=agg)
        np.testing.assert_allclose(np.concatenate(grads), grad_full, rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------------------------


def test_bad_loss_mode_arguments_are_one_line_errors_naming_the_field():
    x = jnp.zeros((2, 3))
    base = {"importance_sampling": "token", "clip_low": 0.1, "clip_high": 0.1}

    def call(**kwargs):
        obj.policy_loss(x, x, jnp.zeros(2), x, **(base | kwargs))

    cases = [
        ({"loss_mode": "ppo"}, r"unknown loss_mode 'ppo'; valid: .*'sapo'"),
        ({"loss_mode": "sapo", "sapo_tau_pos": 0.0}, r"sapo_tau_pos must be > 0"),
        ({"loss_mode": "sapo", "sapo_tau_neg": -1.0}, r"sapo_tau_neg must be > 0"),
        ({"loss_mode": "cispo", "clip_high": 0.0}, r"clip_high must be > 0 with loss_mode='cispo'"),
        ({"loss_mode": "dppo_kl", "dppo_delta_high": 0.0}, r"dppo_delta_high must be > 0"),
        (
            {"loss_mode": "gmpo", "importance_sampling": "seq"},
            r"loss_mode='gmpo' needs token log-ratios: importance_sampling must be 'token'",
        ),
        ({"opsm_delta": 0.1}, r"opsm_delta .* needs sampler_logprobs"),
        ({"loss_mode": "sapo", "dual_clip_loss": True}, r"dual_clip_loss applies to"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            call(**kwargs)
        assert "\n" not in str(info.value), kwargs


def test_the_registry_holds_the_family_and_a_later_mode_is_valid_in_a_config():
    assert set(obj.LOSS_MODES) == {"clip", "sapo", "cispo", "gmpo", "dppo_tv", "dppo_kl"}
    assert [n for n, m in obj.LOSS_MODES.items() if m.token_ratio] == ["gmpo"]
    from configs import base
    from gspo_jax.config.validate import validate

    @obj.register_loss_mode("test_plain_pg")
    def _plain(x):  # −A·r, nothing limited
        flags = {k: jnp.zeros_like(x.valid) for k in ("low", "high", "range")}
        return -x.adv * x.ratio, {**flags, "weight": jnp.where(x.valid, 1.0, 0.0)}

    try:
        c = base.get_config()
        c.loss_mode = "test_plain_pg"
        validate(c)
        lp, old, adv, mask, _ = _random_batch(5)
        _, m, _ = _loss_and_grad(
            lp,
            old,
            adv,
            mask,
            loss_mode="test_plain_pg",
            importance_sampling="token",
            clip_low=0.2,
            clip_high=0.2,
        )
        assert m["limited_frac"] == 0.0 and m["weight_mean"] == 1.0
    finally:
        obj.LOSS_MODES.remove("test_plain_pg")
