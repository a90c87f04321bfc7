"""Specifications of gspo_jax.objectives: ratios, clipping, dual clip, aggregation, metrics,
micro-batch invariance, masking, KL estimators; parity with tests/np_reference.py.

Functions run eagerly (tiny shapes dispatch faster than they compile); one test checks jit.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from gspo_jax import objectives as obj

IS_MODES = ("token", "seq", "seq_token")
AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def test_registries_hold_the_documented_modes():
    assert set(obj.IMPORTANCE_SAMPLING_MODES) == set(IS_MODES)
    assert set(obj.LOSS_AGG_MODES) == set(AGG_MODES)
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(obj.KL_ESTIMATORS)
    assert obj.sequence_level_modes() == ("seq", "seq_token")


def _loss_and_grad(logprobs, old, adv, mask, **kwargs):
    """(loss, metrics, dloss/dlogprobs) of policy_loss, eagerly."""

    def f(lp):
        return obj.policy_loss(lp, old, adv, mask, **kwargs)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logprobs))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def _random_batch(seed, num_b=6, num_t=5, *, seq_shift=0.25, token_adv=False):
    """Off-policy inputs: per-sequence drift (so seq modes clip some sequences) plus per-token
    noise, ragged masks, one fully masked row, and garbage (-inf / NaN) at masked positions."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (num_b, num_t))
    shift = rng.uniform(-seq_shift, seq_shift, (num_b, 1))
    lp = old + shift + rng.normal(0.0, 0.15, (num_b, num_t))
    lengths = rng.integers(1, num_t + 1, num_b)
    mask = (np.arange(num_t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[num_b // 2] = 0.0  # a fully masked row
    adv = rng.normal(size=(num_b, num_t) if token_adv else (num_b,))
    lp[mask == 0] = -np.inf
    old[mask == 0] = np.nan
    return (
        lp.astype(np.float32),
        old.astype(np.float32),
        adv.astype(np.float32),
        mask,
    )


# ---------------------------------------------------------------------------------------------
# On-policy.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance_sampling", IS_MODES)
def test_on_policy_ratio_is_exactly_one_and_nothing_clips(importance_sampling):
    lp, _, adv, mask = _random_batch(0)
    old = lp.copy()  # identical, including -inf at masked positions (-inf - -inf = NaN)
    for agg in AGG_MODES:
        loss, m, grad = _loss_and_grad(
            lp,
            old,
            adv,
            mask,
            importance_sampling=importance_sampling,
            clip_low=0.0,  # the tightest range: any ratio != 1 would clip
            clip_high=0.0,
            dual_clip_loss=True,
            loss_agg_mode=agg,
        )
        assert m["ratio_min"] == m["ratio_max"] == m["ratio_mean"] == 1.0, (agg, m)
        assert m["clipfrac"] == m["clipfrac_seq"] == m["dual_clipfrac"] == 0.0, (agg, m)
        assert m["approx_kl"] == 0.0 and m["approx_kl_k3"] == 0.0
        assert all(math.isfinite(v) for v in m.values())
        assert np.isfinite(grad).all() and (grad[mask == 0] == 0).all()
        # On-policy the loss is the aggregate of −A (r = 1): compare with the reference.
        expected = ref.aggregate(-np.repeat(adv[:, None], lp.shape[1], 1), mask, agg)
        np.testing.assert_allclose(loss, expected, rtol=1e-6, atol=1e-7)
        # ... and its gradient is the policy gradient −A ∇logp (weighted by aggregation).
        w = ref.agg_weights(mask, agg)
        np.testing.assert_allclose(grad, -adv[:, None] * w, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# GSPO vs GSPO-token vs GRPO identities.
# ---------------------------------------------------------------------------------------------


def test_seq_and_seq_token_agree_in_value_and_gradient():
    lp, old, adv, mask = _random_batch(1, num_b=8, seq_shift=0.3)
    kwargs = {"clip_low": 0.1, "clip_high": 0.12}
    for agg in AGG_MODES:
        loss_s, m_s, grad_s = _loss_and_grad(
            lp, old, adv, mask, importance_sampling="seq", loss_agg_mode=agg, **kwargs
        )
        loss_t, m_t, grad_t = _loss_and_grad(
            lp, old, adv, mask, importance_sampling="seq_token", loss_agg_mode=agg, **kwargs
        )
        # The example must exercise both branches: some sequences clipped, some not.
        assert 0.0 < m_s["clipfrac_seq"] < 1.0
        np.testing.assert_allclose(loss_s, loss_t, rtol=1e-6)
        # With one advantage per sequence the gradients agree in every mode (paper §4.3).
        np.testing.assert_allclose(grad_s, grad_t, rtol=1e-5, atol=1e-8)
        assert m_s == pytest.approx(m_t, rel=1e-6)


def test_seq_token_differs_from_seq_with_per_token_advantages():
    # The stop-gradient form matters: with token-varying advantages GSPO-token weights each
    # token's gradient by its own advantage, GSPO by the sequence's mean weight.
    lp, old, adv, mask = _random_batch(2, token_adv=True, seq_shift=0.0)
    kwargs = {"clip_low": 0.5, "clip_high": 0.5, "loss_agg_mode": "seq-mean-token-mean"}
    loss_s, _, grad_s = _loss_and_grad(lp, old, adv, mask, importance_sampling="seq", **kwargs)
    loss_t, _, grad_t = _loss_and_grad(
        lp, old, adv, mask, importance_sampling="seq_token", **kwargs
    )
    np.testing.assert_allclose(loss_s, loss_t, rtol=1e-6)
    assert np.abs(grad_s - grad_t).max() > 1e-3


def test_token_and_seq_coincide_for_one_token_responses():
    rng = np.random.default_rng(3)
    num_b, num_t = 6, 4
    old = rng.normal(-1.0, 0.5, (num_b, num_t)).astype(np.float32)
    lp = (old + rng.normal(0.0, 0.3, (num_b, num_t))).astype(np.float32)
    mask = np.zeros((num_b, num_t), np.float32)
    mask[np.arange(num_b), rng.integers(0, num_t, num_b)] = 1.0  # one valid token, anywhere
    lp[mask == 0] = -np.inf
    adv = rng.normal(size=num_b).astype(np.float32)
    for agg in AGG_MODES:
        kwargs = {"clip_low": 0.1, "clip_high": 0.1, "loss_agg_mode": agg}
        loss_tok, m_tok, g_tok = _loss_and_grad(
            lp, old, adv, mask, importance_sampling="token", **kwargs
        )
        loss_seq, m_seq, g_seq = _loss_and_grad(
            lp, old, adv, mask, importance_sampling="seq", **kwargs
        )
        assert 0.0 < m_tok["clipfrac"] < 1.0
        np.testing.assert_allclose(loss_tok, loss_seq, rtol=1e-6)
        np.testing.assert_allclose(g_tok, g_seq, rtol=1e-6, atol=1e-8)
        assert m_tok == pytest.approx(m_seq, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Hand-computed examples.
# ---------------------------------------------------------------------------------------------


def test_gspo_and_grpo_hand_example_loss_gradient_and_clipfracs():
    # Row 0: token log-ratios [0.2, 0.0], A = +1. Row 1: log-ratio −0.6 on its only valid
    # token (the second position is padding with -inf), A = −1. ε_low = ε_high = 0.2.
    lp = np.array([[0.2, 0.0], [-0.6, -np.inf]], np.float32)
    old = np.zeros((2, 2), np.float32)
    mask = np.array([[1, 1], [1, 0]], np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    kwargs = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg_mode": "seq-mean-token-mean"}

    # GSPO: s_0 = exp((0.2 + 0)/2) = e^0.1 = 1.1051709 (< 1.2, not clipped) -> L = −s_0 on
    # both tokens; s_1 = e^−0.6 = 0.5488116 < 0.8 with A < 0 -> clipped: L = −A·0.8 = 0.8.
    # seq-mean-token-mean = (−1.1051709 + 0.8)/2 = −0.15258545.
    # d loss / d lp_{0,t} = ½ (seq mean) · ½ (token mean, both tokens) · ... summed over the 2
    # tokens of row 0: ½ · d(−s_0)/d lp_t = ½ · (−s_0 · ½) = −0.27629273; row 1 clipped: 0.
    loss, m, grad = _loss_and_grad(lp, old, adv, mask, importance_sampling="seq", **kwargs)
    assert loss == pytest.approx(-0.15258545, rel=1e-6)
    np.testing.assert_allclose(grad, [[-0.27629273, -0.27629273], [0.0, 0.0]], rtol=1e-6)
    # 1 of 3 valid tokens clipped (row 1, low side); 1 of 2 sequences.
    assert m["clipfrac"] == pytest.approx(1 / 3)
    assert m["clipfrac_low"] == pytest.approx(1 / 3) and m["clipfrac_high"] == 0.0
    assert m["clipfrac_seq"] == pytest.approx(0.5)
    assert m["clipfrac_seq_low"] == pytest.approx(0.5) and m["clipfrac_seq_high"] == 0.0
    # Sequence-level ratio stats: {1.1051709, 0.5488116}.
    assert m["ratio_min"] == pytest.approx(0.5488116, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(1.1051709, rel=1e-6)
    assert m["ratio_mean"] == pytest.approx((1.1051709 + 0.5488116) / 2, rel=1e-6)
    # approx_kl = mean(old − lp) over valid tokens = (−0.2 − 0 + 0.6)/3 = 0.13333.
    assert m["approx_kl"] == pytest.approx(0.4 / 3, rel=1e-5)
    # approx_kl_k3 = mean(e^x − 1 − x), x ∈ {0.2, 0, −0.6}
    #              = (0.0214028 + 0 + 0.1488116)/3 = 0.0567381.
    assert m["approx_kl_k3"] == pytest.approx(0.0567381, rel=1e-5)
    assert m["num_valid_tokens"] == 3.0 and m["num_valid_seqs"] == 2.0

    # GRPO (token ratio) on the same data: r = [e^0.2 = 1.2214028 > 1.2 with A > 0 -> clipped
    # to −1.2; 1.0 -> −1.0], row 1: r = 0.5488116, A < 0 -> clipped to 0.8.
    # seq-mean-token-mean = ((−1.2 − 1.0)/2 + 0.8)/2 = −0.15. Only token (0,1) is unclipped:
    # d loss/d lp_{0,1} = ½ · ½ · (−A·r) = −0.25.
    loss, m, grad = _loss_and_grad(lp, old, adv, mask, importance_sampling="token", **kwargs)
    assert loss == pytest.approx(-0.15, rel=1e-6)
    np.testing.assert_allclose(grad, [[0.0, -0.25], [0.0, 0.0]], rtol=1e-6)
    assert m["clipfrac"] == pytest.approx(2 / 3)
    assert m["clipfrac_low"] == pytest.approx(1 / 3)
    assert m["clipfrac_high"] == pytest.approx(1 / 3)
    assert m["clipfrac_seq"] == 1.0
    # Row 0 is clipped high (token 0), row 1 low: one sequence on each side.
    assert m["clipfrac_seq_low"] == pytest.approx(0.5)
    assert m["clipfrac_seq_high"] == pytest.approx(0.5)
    assert m["ratio_min"] == pytest.approx(0.5488116, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(1.2214028, rel=1e-6)
    assert m["ratio_mean"] == pytest.approx((1.2214028 + 1.0 + 0.5488116) / 3, rel=1e-6)


def test_dual_clip_caps_negative_advantages_only():
    # One token per row, ε = 0.2, dual_clip_ratio c = 3, token-mean over 3 tokens.
    #   row 0: A = −2, r = 5: max(−A·r, −A·1.2) = max(10, 2.4) = 10 -> dual: min(10, 6) = 6
    #   row 1: A = +2, r = 5: max(−10, −2.4) = −2.4 (clipped, A ≥ 0: dual clip does nothing)
    #   row 2: A = −2, r = 2: max(4, 2.4) = 4 < 6: unchanged
    lp = np.log(np.array([[5.0], [5.0], [2.0]], np.float32))
    old = np.zeros((3, 1), np.float32)
    mask = np.ones((3, 1), np.float32)
    adv = np.array([-2.0, 2.0, -2.0], np.float32)
    kwargs = {
        "importance_sampling": "token",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "loss_agg_mode": "token-mean",
    }
    loss, m, grad = _loss_and_grad(lp, old, adv, mask, dual_clip_loss=True, **kwargs)
    assert loss == pytest.approx((6.0 - 2.4 + 4.0) / 3, rel=1e-6)
    # Gradient: row 0 capped (constant) -> 0; row 1 clipped -> 0; row 2: −A·r/3 = 4/3.
    np.testing.assert_allclose(grad[:, 0], [0.0, 0.0, 4.0 / 3], rtol=1e-6, atol=1e-7)
    assert m["dual_clipfrac"] == pytest.approx(1 / 3)
    assert m["clipfrac"] == pytest.approx(1 / 3)  # only row 1 hits the ε clip

    loss, m, grad = _loss_and_grad(lp, old, adv, mask, dual_clip_loss=False, **kwargs)
    assert loss == pytest.approx((10.0 - 2.4 + 4.0) / 3, rel=1e-6)
    np.testing.assert_allclose(grad[:, 0], [10.0 / 3, 0.0, 4.0 / 3], rtol=1e-6, atol=1e-7)
    assert m["dual_clipfrac"] == 0.0

    with pytest.raises(ValueError, match="dual_clip_ratio"):
        obj.policy_loss(
            jnp.asarray(lp), old, adv, mask, dual_clip_loss=True, dual_clip_ratio=1.0, **kwargs
        )


def test_aggregation_modes_hand_example():
    # Valid per-token losses: row 0 = [1, 2, 3], row 1 = [4] (+ garbage), row 2 fully masked.
    loss = np.array([[1, 2, 3], [4, 99, np.inf], [np.nan, 5, 6]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], np.float32)

    def agg(mode, **kw):
        return float(obj.aggregate_loss(jnp.asarray(loss), mask, mode, **kw))

    assert agg("token-mean") == pytest.approx(10 / 4)  # (1+2+3+4)/4
    assert agg("seq-mean-token-sum") == pytest.approx(5.0)  # (6 + 4)/2 valid seqs
    assert agg("seq-mean-token-mean") == pytest.approx(3.0)  # (6/3 + 4/1)/2
    assert agg("seq-mean-token-sum-norm") == pytest.approx(5 / 3)  # (6 + 4)/2 / T=3
    assert agg("seq-mean-token-sum-norm", horizon=10) == pytest.approx(0.5)  # 5 / 10
    # Global denominators (what the trainer passes per micro-batch).
    assert agg("token-mean", num_valid_tokens=8) == pytest.approx(10 / 8)
    assert agg("seq-mean-token-sum", num_valid_seqs=4) == pytest.approx(10 / 4)
    assert agg("seq-mean-token-mean", num_valid_seqs=4) == pytest.approx(6 / 4)
    assert agg("seq-mean-token-sum-norm", num_valid_seqs=4, horizon=5) == pytest.approx(0.5)
    # Nothing valid: 0, not NaN.
    for mode in AGG_MODES:
        assert float(obj.aggregate_loss(jnp.asarray(loss), 0 * mask, mode)) == 0.0

    # entropy_loss aggregates the same way (garbage at masked positions ignored).
    assert float(obj.entropy_loss(jnp.asarray(loss), mask, "seq-mean-token-mean")) == 3.0


def test_paper_epsilon_clips_seq_ratio_of_1e3_but_not_1e4():
    # GSPO ε = (3e-4, 4e-4). Mean log-ratios 1e-3 (s ≈ 1.0010005 > 1.0004: clipped when A > 0)
    # and 1e-4 (s ≈ 1.0001 < 1.0004: not clipped); rows 2/3 mirror them with A < 0
    # (s ≈ 0.9990 < 0.9997: clipped; 0.9999: not). Tokens vary around the mean.
    delta = np.array([[0.5e-3, 1.5e-3], [0.0, 2e-4], [-0.5e-3, -1.5e-3], [0.0, -2e-4]], np.float32)
    old = np.full((4, 2), -2.0, np.float32)
    lp = old + delta
    mask = np.ones((4, 2), np.float32)
    adv = np.array([1.0, 1.0, -1.0, -1.0], np.float32)
    kwargs = {"clip_low": 3e-4, "clip_high": 4e-4}
    _, m, grad = _loss_and_grad(lp, old, adv, mask, importance_sampling="seq", **kwargs)
    assert m["clipfrac_seq"] == pytest.approx(0.5)
    assert m["clipfrac_high"] == pytest.approx(0.25) and m["clipfrac_low"] == pytest.approx(0.25)
    assert (grad[[0, 2]] == 0).all() and (grad[[1, 3]] != 0).all()
    # GRPO's ε = 0.2 / 0.28 clips none of them.
    _, m, _ = _loss_and_grad(
        lp, old, adv, mask, importance_sampling="token", clip_low=0.2, clip_high=0.28
    )
    assert m["clipfrac"] == 0.0


# ---------------------------------------------------------------------------------------------
# Parity with the NumPy reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance_sampling", IS_MODES)
def test_parity_with_numpy_reference(importance_sampling):
    combos = itertools.product(AGG_MODES, (False, True), (False, True), (None, "global"))
    for seed, (agg, dual, token_adv, counts) in enumerate(combos):
        lp, old, adv, mask = _random_batch(100 + seed, token_adv=token_adv)
        kwargs = {
            "importance_sampling": importance_sampling,
            "clip_low": 0.1,
            "clip_high": 0.15,
            "dual_clip_loss": dual,
            "dual_clip_ratio": 1.3,
            "loss_agg_mode": agg,
        }
        if counts == "global":  # as if this were one micro-batch of a larger mini-batch
            kwargs.update(num_valid_tokens=40.0, num_valid_seqs=11.0, horizon=7)
        loss, m, grad = _loss_and_grad(lp, old, adv, mask, **kwargs)
        r_loss, r_grad, r_m = ref.policy_loss(lp, old, adv, mask, **kwargs)
        case = (agg, dual, token_adv, counts)
        np.testing.assert_allclose(loss, r_loss, rtol=2e-5, atol=1e-7, err_msg=str(case))
        np.testing.assert_allclose(grad, r_grad, rtol=2e-5, atol=1e-7, err_msg=str(case))
        for key, value in r_m.items():
            if key != "pg_loss":
                assert m[key] == pytest.approx(value, rel=2e-5, abs=1e-7), (case, key)
        assert m["clipfrac_low"] + m["clipfrac_high"] == pytest.approx(m["clipfrac"])


def test_reference_gradient_matches_finite_differences():
    # Guards the reference itself: its analytic gradient against central differences of its
    # own loss (float64). seq_token has no finite-difference form (stop-gradient), so it is
    # covered by the value identity with seq and the analytic reference above.
    lp, old, adv, mask = _random_batch(7, num_b=4, num_t=3, token_adv=True)
    for is_mode, agg in itertools.product(("token", "seq"), AGG_MODES):
        kwargs = {"importance_sampling": is_mode, "clip_low": 0.1, "clip_high": 0.15}
        kwargs.update(dual_clip_loss=True, dual_clip_ratio=1.3, loss_agg_mode=agg)
        base = lp.astype(np.float64)
        _, grad, _ = ref.policy_loss(base, old, adv, mask, **kwargs)
        for b, t in zip(*np.nonzero(mask), strict=True):
            h = 1e-6
            up, down = base.copy(), base.copy()
            up[b, t] += h
            down[b, t] -= h
            fd = (
                ref.policy_loss(up, old, adv, mask, **kwargs)[0]
                - ref.policy_loss(down, old, adv, mask, **kwargs)[0]
            ) / (2 * h)
            assert grad[b, t] == pytest.approx(fd, rel=1e-4, abs=1e-7), (is_mode, agg, b, t)


# ---------------------------------------------------------------------------------------------
# Micro-batching and masking.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance_sampling", IS_MODES)
def test_micro_batch_split_with_global_denominators_is_invariant(importance_sampling):
    lp, old, adv, mask = _random_batch(11, num_b=8, num_t=5)
    n_tok, n_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    for agg in AGG_MODES:
        kwargs = {
            "importance_sampling": importance_sampling,
            "clip_low": 0.1,
            "clip_high": 0.15,
            "dual_clip_loss": True,
            "dual_clip_ratio": 1.3,
            "loss_agg_mode": agg,
        }
        loss_full, m_full, grad_full = _loss_and_grad(lp, old, adv, mask, **kwargs)
        loss_sum, grad_parts, local_sum = 0.0, [], 0.0
        for sl in [slice(i, i + 2) for i in range(0, 8, 2)]:  # 4 micro-batches of 2
            loss_i, _, grad_i = _loss_and_grad(
                lp[sl],
                old[sl],
                adv[sl],
                mask[sl],
                num_valid_tokens=n_tok,
                num_valid_seqs=n_seq,
                **kwargs,
            )
            loss_sum += loss_i
            grad_parts.append(grad_i)
            local_sum += _loss_and_grad(lp[sl], old[sl], adv[sl], mask[sl], **kwargs)[0]
        np.testing.assert_allclose(loss_sum, loss_full, rtol=1e-5, atol=1e-7, err_msg=agg)
        np.testing.assert_allclose(np.concatenate(grad_parts), grad_full, rtol=1e-5, atol=1e-8)
        # Sanity that the split matters: local denominators would give another number.
        assert abs(local_sum - loss_full) > 1e-3
        assert m_full["num_valid_tokens"] == n_tok and m_full["num_valid_seqs"] == n_seq


@pytest.mark.parametrize("importance_sampling", IS_MODES)
def test_fully_masked_rows_never_count(importance_sampling):
    lp, old, adv, mask = _random_batch(21, num_b=5, num_t=4)
    mask[2] = 1.0  # _random_batch masks a row; make all rows valid here
    lp[2], old[2] = -1.0, -1.1
    garbage_lp = np.array([[-np.inf, np.nan, np.inf, 0.0]], np.float32)
    lp2 = np.concatenate([lp, garbage_lp])
    old2 = np.concatenate([old, np.full((1, 4), np.nan, np.float32)])
    adv2 = np.concatenate([adv, np.array([np.nan], np.float32)])
    mask2 = np.concatenate([mask, np.zeros((1, 4), np.float32)])
    for agg in AGG_MODES:
        kwargs = {
            "importance_sampling": importance_sampling,
            "clip_low": 0.1,
            "clip_high": 0.15,
            "dual_clip_loss": True,
            "dual_clip_ratio": 1.3,
            "loss_agg_mode": agg,
        }
        loss, m, grad = _loss_and_grad(lp, old, adv, mask, **kwargs)
        loss2, m2, grad2 = _loss_and_grad(lp2, old2, adv2, mask2, **kwargs)
        assert loss2 == pytest.approx(loss, rel=1e-6, abs=1e-8), agg
        np.testing.assert_allclose(grad2[:-1], grad, rtol=1e-6, atol=1e-9)
        assert (grad2[-1] == 0).all()
        assert m2 == pytest.approx(m, rel=1e-6, abs=1e-8)


def test_extreme_log_ratio_stays_finite():
    lp = np.array([[50.0, 0.0]], np.float32)  # e^50 would make -A·r huge
    old = np.zeros((1, 2), np.float32)
    mask = np.ones((1, 2), np.float32)
    for is_mode in IS_MODES:
        loss, m, grad = _loss_and_grad(
            lp,
            old,
            np.array([-1.0], np.float32),
            mask,
            importance_sampling=is_mode,
            clip_low=0.2,
            clip_high=0.2,
        )
        assert math.isfinite(loss) and np.isfinite(grad).all()
        assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------------------------------------
# KL estimators.
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    # d = logp − ref ∈ {ln 2, −ln 2, 0}.
    ln2 = math.log(2.0)
    logp = np.array([[math.log(0.5), math.log(0.25), -1.0]], np.float32)
    ref_lp = np.array([[math.log(0.25), math.log(0.5), -1.0]], np.float32)
    k1 = np.asarray(obj.kl_penalty(logp, ref_lp, "k1"))
    k2 = np.asarray(obj.kl_penalty(logp, ref_lp, "k2"))
    k3 = np.asarray(obj.kl_penalty(logp, ref_lp, "k3"))
    np.testing.assert_allclose(k1, [[ln2, -ln2, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(k2, [[0.5 * ln2**2, 0.5 * ln2**2, 0.0]], rtol=1e-6)  # 0.2402265
    # k3(ln 2) = e^−ln2 + ln2 − 1 = 0.5 + 0.6931472 − 1 = 0.1931472;
    # k3(−ln 2) = 2 − 0.6931472 − 1 = 0.3068528.
    np.testing.assert_allclose(k3, [[0.1931472, 0.3068528, 0.0]], rtol=1e-6)
    # low_var_kl: d = −30 is clamped to −20 (k3 = e^20 − 21) and the result to 10.
    lv = obj.kl_penalty(jnp.array([[-30.0, ln2]]), jnp.zeros((1, 2)), "low_var_kl")
    np.testing.assert_allclose(np.asarray(lv), [[10.0, 0.1931472]], rtol=1e-6)
    for name in obj.KL_ESTIMATORS:
        np.testing.assert_allclose(
            np.asarray(obj.kl_penalty(logp, ref_lp, name)),
            ref.kl_penalty(logp, ref_lp, name),
            rtol=1e-5,
            atol=1e-7,
        )


def test_kl_k3_nonnegative_and_k1_k3_unbiased_on_samples():
    rng = np.random.default_rng(0)
    logits_p, logits_q = rng.normal(size=8), rng.normal(size=8)
    log_p = logits_p - np.logaddexp.reduce(logits_p)
    log_q = logits_q - np.logaddexp.reduce(logits_q)
    kl_true = float(np.sum(np.exp(log_p) * (log_p - log_q)))
    samples = rng.choice(8, size=(200, 500), p=np.exp(log_p))  # x ~ π_θ = p
    logp = jnp.asarray(log_p[samples], jnp.float32)
    ref_lp = jnp.asarray(log_q[samples], jnp.float32)
    k1 = float(jnp.mean(obj.kl_penalty(logp, ref_lp, "k1")))
    k3_BT = obj.kl_penalty(logp, ref_lp, "k3")
    assert float(jnp.min(k3_BT)) >= 0.0
    assert kl_true > 0.05
    assert k1 == pytest.approx(kl_true, abs=0.02)
    assert float(jnp.mean(k3_BT)) == pytest.approx(kl_true, abs=0.02)


def test_kl_penalty_mask_blocks_garbage():
    logp = jnp.array([[-1.0, -jnp.inf], [-0.5, jnp.nan]])
    ref_lp = jnp.array([[-1.2, -jnp.inf], [-0.7, -3.0]])
    mask = jnp.array([[1.0, 0.0], [1.0, 0.0]])
    for name in obj.KL_ESTIMATORS:

        def total(lp, name=name):
            return jnp.sum(obj.kl_penalty(lp, ref_lp, name, mask=mask))

        value, grad = jax.value_and_grad(total)(logp)
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
        assert (np.asarray(grad)[:, 1] == 0).all()


# ---------------------------------------------------------------------------------------------
# Errors and jit.
# ---------------------------------------------------------------------------------------------


def test_unknown_modes_and_bad_shapes_raise_clear_errors():
    x = jnp.zeros((2, 3))
    base = {"importance_sampling": "seq", "clip_low": 0.1, "clip_high": 0.1}
    with pytest.raises(ValueError, match=r"importance_sampling 'sequence'.*seq_token"):
        obj.policy_loss(x, x, jnp.zeros(2), x, **{**base, "importance_sampling": "sequence"})
    with pytest.raises(ValueError, match=r"loss_agg_mode 'mean'.*token-mean"):
        obj.policy_loss(x, x, jnp.zeros(2), x, **base, loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"loss_agg_mode 'sum'"):
        obj.aggregate_loss(x, x, "sum")
    with pytest.raises(ValueError, match=r"kl_estimator 'k4'.*k3"):
        obj.kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="advantages has shape"):
        obj.policy_loss(x, x, jnp.zeros(3), x, **base)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        obj.policy_loss(x, jnp.zeros((2, 4)), jnp.zeros(2), x, **base)
    with pytest.raises(ValueError, match="clip_low"):
        obj.policy_loss(x, x, jnp.zeros(2), x, **{**base, "clip_low": -0.1})


def test_jit_with_static_mode_strings_matches_eager():
    lp, old, adv, mask = _random_batch(5)
    kwargs = {"clip_low": 0.1, "clip_high": 0.15, "loss_agg_mode": "token-mean"}

    @functools.partial(jax.jit, static_argnames=("importance_sampling",))
    def loss_and_grad(lp, old, adv, mask, n_tok, importance_sampling):
        def f(x):
            return obj.policy_loss(
                x,
                old,
                adv,
                mask,
                importance_sampling=importance_sampling,
                num_valid_tokens=n_tok,  # traced global count
                **kwargs,
            )

        return jax.value_and_grad(f, has_aux=True)(lp)

    for is_mode in ("token", "seq"):
        (loss, m), grad = loss_and_grad(lp, old, adv, mask, jnp.sum(mask), is_mode)
        e_loss, e_m, e_grad = _loss_and_grad(
            lp, old, adv, mask, importance_sampling=is_mode, **kwargs
        )
        assert float(loss) == pytest.approx(e_loss, rel=1e-6)
        np.testing.assert_allclose(np.asarray(grad), e_grad, rtol=1e-5, atol=1e-8)
        assert {k: float(v) for k, v in m.items()} == pytest.approx(e_m, rel=1e-5)


@pytest.mark.parametrize("mode", ["seq", "token"])
def test_log_s_spread_by_length_matches_numpy(mode):
    """by_length/*: per response-length bucket, the count of valid sequences and the sum
    of (log s_i)², log s_i the mean token log-ratio over the sequence's valid tokens (a plain
    loop here), whatever the objective; an all-masked row counts nowhere."""
    rng = np.random.default_rng(0)
    lengths = [1, 3, 4, 7, 8, 12, 0]
    B, T = len(lengths), 12
    logp = rng.normal(size=(B, T)).astype(np.float32)
    old = (logp + 0.1 * rng.normal(size=(B, T))).astype(np.float32)
    mask = np.zeros((B, T), np.float32)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    _, m = obj.policy_loss(
        jnp.asarray(logp),
        jnp.asarray(old),
        jnp.asarray(rng.normal(size=B).astype(np.float32)),
        jnp.asarray(mask),
        importance_sampling=mode,
        clip_low=0.2,
        clip_high=0.27,
    )
    want_sq, want_n = {}, {}
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        log_s = float(np.mean(logp[i, :n].astype(np.float64) - old[i, :n]))
        name = next(b for b, lo, hi in obj.length_buckets() if lo <= n and (hi is None or n < hi))
        want_sq[name] = want_sq.get(name, 0.0) + log_s**2
        want_n[name] = want_n.get(name, 0) + 1
    assert want_n == {"1-3": 2, "4-7": 2, "8-15": 2}
    for name, _, _ in obj.length_buckets():
        assert float(m[f"by_length/seqs_{name}"]) == want_n.get(name, 0)
        np.testing.assert_allclose(
            float(m[f"by_length/log_s_sq_{name}"]), want_sq.get(name, 0.0), rtol=1e-5, atol=1e-9
        )
