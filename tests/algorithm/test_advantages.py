"""Specifications of gspo_jax.advantages: GRPO group z-scores, Dr. GRPO's mean-only
baseline, RLOO's leave-one-out baseline, reward normalisation modes,
order of operations, masking, running moments, token-level returns; parity with
tests/np_reference.py."""

import functools
import itertools

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from gspo_jax import advantages as adv_lib
from gspo_jax.advantages import compute_advantages

S3 = 3**0.5


def _adv(rewards, **kwargs):
    kwargs.setdefault("adv_estimator", "reinforce")
    out, running = compute_advantages(jnp.asarray(rewards, jnp.float32), **kwargs)
    return np.asarray(out), running


def test_registries():
    assert set(adv_lib.ADV_ESTIMATORS) == {"grpo", "reinforce", "rloo"}
    assert adv_lib.REWARD_NORMS == (None, "batch", "group", "running")


def test_grpo_hand_example():
    # Group 0 = [1, 0, 0, 1]: mean 0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.5773503
    #   -> ±0.5/0.5773503 = ±0.8660254 (= √3/2).
    # Group 1 = [3, 1, 2, 2]: mean 2, deviations [1, −1, 0, 0], var = 2/3, std = 0.8164966
    #   -> [1.2247449, −1.2247449, 0, 0].
    out, _ = _adv([1, 0, 0, 1, 3, 1, 2, 2], group_size=4, adv_estimator="grpo")
    s, t = 0.5773503 + 1e-6, 0.8164966 + 1e-6
    np.testing.assert_allclose(
        out, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 1 / t, -1 / t, 0, 0], rtol=1e-6
    )
    np.testing.assert_allclose(out[:4], [S3 / 2, -S3 / 2, -S3 / 2, S3 / 2], rtol=1e-5)


def test_identical_rewards_give_exactly_zero_never_nan():
    # 0.1 is not exact in binary: a naive mean (0.1+0.1+0.1)/3 != 0.1 would leave ~1e-8/1e-6.
    rewards = [0.1, 0.1, 0.1, 7.0, 7.0, 7.0, -3.3, -3.3, -3.3]
    for kwargs in (
        {"adv_estimator": "grpo"},
        {"adv_estimator": "grpo", "whiten_advantages": True},
        {"adv_estimator": "grpo", "reward_norm": "batch", "reward_clip": 1.0},
        {"adv_estimator": "grpo", "reward_norm": "group"},
        {"adv_estimator": "reinforce", "reward_norm": "group"},
    ):
        out, _ = _adv(rewards, group_size=3, **kwargs)
        assert (out == 0.0).all(), kwargs
    # A whole batch of identical rewards, whitened and batch-normalised.
    out, _ = _adv([0.3] * 6, group_size=3, reward_norm="batch", whiten_advantages=True)
    assert (out == 0.0).all()


def test_single_valid_member_and_empty_groups_are_zero_not_nan():
    # Group 0 has one valid member (std := 0 -> advantage 0); group 1 has none.
    rewards = [5.0, np.nan, np.nan, np.inf, 2.0, 3.0]
    mask = jnp.array([1, 0, 0, 0, 0, 0])
    for estimator in ("grpo", "reinforce"):
        for norm in adv_lib.REWARD_NORMS:
            out, _ = _adv(
                rewards,
                group_size=3,
                adv_estimator=estimator,
                mask=mask,
                reward_norm=norm,
                whiten_advantages=True,
            )
            assert (out == 0.0).all(), (estimator, norm)
    out, running = _adv(rewards, group_size=3, mask=jnp.zeros(6), reward_norm="running")
    assert (out == 0.0).all() and int(running.count) == 0 and float(running.mean) == 0.0


def test_mask_excludes_entries_from_statistics():
    # Group 0 = [1, 0, (NaN), (5)]: only [1, 0] count: mean 0.5, std = √0.5 = 0.7071068
    #   -> ±0.5/0.7071068 = ±0.7071068. Group 1 fully valid [2, 4, 6, 8]: mean 5,
    #   var = (9+1+1+9)/3 = 20/3, std = 2.5819889 -> [−3, −1, 1, 3]/2.5819889.
    rewards = [1.0, 0.0, np.nan, 5.0, 2.0, 4.0, 6.0, 8.0]
    mask = jnp.array([1, 1, 0, 0, 1, 1, 1, 1])
    out, _ = _adv(rewards, group_size=4, adv_estimator="grpo", mask=mask)
    t = 2.5819889 + 1e-6
    np.testing.assert_allclose(
        out, [0.5 / 0.7071078, -0.5 / 0.7071078, 0, 0, -3 / t, -1 / t, 1 / t, 3 / t], rtol=1e-5
    )
    # Masked entries change nothing when their value changes.
    out2, _ = _adv(
        [1.0, 0.0, -100.0, 1e9, 2.0, 4.0, 6.0, 8.0], group_size=4, adv_estimator="grpo", mask=mask
    )
    np.testing.assert_array_equal(out, out2)


def test_reward_norm_modes_and_shift_scale_flags():
    # Batch [1, 2, 3, 6]: mean 3, deviations [−2, −1, 0, 3], M2 = 14, var = 14/3,
    # std = 2.1602469.  Groups (G = 2): [1, 2]: mean 1.5, std = 0.7071068;
    # [3, 6]: mean 4.5, std = 2.1213203. reinforce leaves the processed reward as is.
    r = [1.0, 2.0, 3.0, 6.0]
    sb, sg0, sg1 = 2.1602469 + 1e-6, 0.7071068 + 1e-6, 2.1213203 + 1e-6
    cases = {
        ("batch", False, False): [-2 / sb, -1 / sb, 0, 3 / sb],
        ("batch", True, True): [-2 / sb, -1 / sb, 0, 3 / sb],
        ("batch", True, False): [-2, -1, 0, 3],
        ("batch", False, True): [1 / sb, 2 / sb, 3 / sb, 6 / sb],
        ("group", False, False): [-0.5 / sg0, 0.5 / sg0, -1.5 / sg1, 1.5 / sg1],
        ("group", True, False): [-0.5, 0.5, -1.5, 1.5],
        ("group", False, True): [1 / sg0, 2 / sg0, 3 / sg1, 6 / sg1],
        # One batch of running normalisation = batch normalisation.
        ("running", False, False): [-2 / sb, -1 / sb, 0, 3 / sb],
        ("running", True, False): [-2, -1, 0, 3],
        ("running", False, True): [1 / sb, 2 / sb, 3 / sb, 6 / sb],
        # reward_norm=None: the flags do nothing.
        (None, True, False): r,
        (None, False, True): r,
    }
    for (norm, shift, scale), expected in cases.items():
        out, _ = _adv(r, group_size=2, reward_norm=norm, reward_shift=shift, reward_scale=scale)
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7, err_msg=str(norm))


def test_order_normalise_then_clip_then_estimator_then_whiten_then_clip():
    # (1) -> (2): batch z-score of [0, 10] is ±0.7071068, then reward_clip 0.5 -> ±0.5.
    #     (Clipping first would give [0, 0.5] -> z-score ±0.7071068.)
    out, _ = _adv([0.0, 10.0], group_size=2, reward_norm="batch", reward_clip=0.5)
    np.testing.assert_allclose(out, [-0.5, 0.5], rtol=1e-6)
    # (2) -> (3): clip [0, 1, 10] to 2 -> [0, 1, 2], group z-score: mean 1, std 1 -> [−1, 0, 1].
    #     (The estimator first would give z([0, 1, 10]) = [−0.6547, −0.4911, 1.1459], then clip.)
    out, _ = _adv([0.0, 1.0, 10.0], group_size=3, adv_estimator="grpo", reward_clip=2.0)
    np.testing.assert_allclose(out, np.array([-1.0, 0.0, 1.0]) / (1 + 1e-6), rtol=1e-6)
    # (3) -> (4): grpo on two groups of 2 gives ±1/√2 each; whitening that batch:
    #     mean 0, var = 4·0.5/3 = 2/3 -> ±0.7071068/0.8164966 = ±0.8660254.
    #     (Whitening first then grpo would give ±0.7071068.)
    out, _ = _adv([0.0, 1.0, 5.0, 3.0], group_size=2, adv_estimator="grpo", whiten_advantages=True)
    np.testing.assert_allclose(out, [-S3 / 2, S3 / 2, S3 / 2, -S3 / 2], rtol=1e-5)
    # (4) -> (5): whiten [0, 0, 0, 10]: mean 2.5, M2 = 75, std 5 -> [−0.5, −0.5, −0.5, 1.5],
    #     then advantage_clip 1 -> [−0.5, −0.5, −0.5, 1]. (Clip first: [−0.5, …, 1.5].)
    out, _ = _adv([0.0, 0.0, 0.0, 10.0], group_size=2, whiten_advantages=True, advantage_clip=1.0)
    np.testing.assert_allclose(out, [-0.5, -0.5, -0.5, 1.0], rtol=1e-5)


def test_running_normalisation_over_a_stream_equals_batch_normalisation_of_the_stream():
    rng = np.random.default_rng(0)
    sizes = (8, 4, 12)
    batches = [rng.normal(3.0, 2.0, n).astype(np.float32) for n in sizes]
    masks = [(rng.random(n) > 0.25).astype(np.float32) for n in sizes]
    running = None
    for rewards, mask in zip(batches, masks, strict=True):
        out, running = _adv(
            rewards, group_size=4, reward_norm="running", running=running, mask=jnp.asarray(mask)
        )
    stream = np.concatenate(batches)
    valid = np.concatenate(masks) > 0
    assert int(running.count) == valid.sum()
    np.testing.assert_allclose(float(running.mean), stream[valid].mean(), rtol=1e-5)
    m2 = np.sum((stream[valid] - stream[valid].mean()) ** 2)
    np.testing.assert_allclose(float(running.m2), m2, rtol=1e-5)
    # The last batch was normalised with the final stats = batch-normalising the whole stream.
    whole, _ = _adv(stream, group_size=4, reward_norm="batch", mask=jnp.asarray(valid))
    np.testing.assert_allclose(out, whole[-sizes[-1] :], rtol=1e-5, atol=1e-6)
    # The reference, given the history explicitly, agrees.
    history = np.concatenate([b[m > 0] for b, m in zip(batches[:-1], masks[:-1], strict=True)])
    expected = ref.compute_advantages(
        batches[-1],
        group_size=4,
        adv_estimator="reinforce",
        reward_norm="running",
        mask=masks[-1],
        history=history,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # The state is a plain pytree of arrays (the trainer checkpoints it).
    leaves = jax.tree.leaves(running)
    assert len(leaves) == 3 and all(isinstance(x, jax.Array) for x in leaves)
    assert running.count.dtype == jnp.int32


def test_running_state_passes_through_other_modes_and_starts_empty():
    state = adv_lib.init_running_moments()
    _, out_state = _adv([1.0, 2.0], group_size=2, reward_norm="batch", running=state)
    assert out_state is state
    _, out_state = _adv([1.0, 2.0], group_size=2, reward_norm=None)
    assert out_state is None
    _, out_state = _adv([1.0, 2.0], group_size=2, reward_norm="running")
    assert int(out_state.count) == 2 and float(out_state.mean) == 1.5
    assert float(out_state.m2) == pytest.approx(0.5)


def test_parity_with_numpy_reference():
    rng = np.random.default_rng(1)
    combos = itertools.product(
        ("grpo", "reinforce"),
        adv_lib.REWARD_NORMS,
        ((False, False), (True, False), (False, True)),
        (False, True),
        ((None, None), (0.8, 1.2)),
    )
    for estimator, norm, (shift, scale), whiten, (r_clip, a_clip) in combos:
        rewards = rng.normal(0.5, 1.0, 12).astype(np.float32)
        mask = (rng.random(12) > 0.2).astype(np.float32)
        history = rng.normal(0.0, 2.0, 5)
        running = None
        if norm == "running":  # a state that has seen `history`
            _, running = _adv(history, group_size=5, reward_norm="running")
        kwargs = {
            "group_size": 4,
            "adv_estimator": estimator,
            "reward_norm": norm,
            "reward_shift": shift,
            "reward_scale": scale,
            "whiten_advantages": whiten,
            "reward_clip": r_clip,
            "advantage_clip": a_clip,
        }
        out, _ = _adv(rewards, mask=jnp.asarray(mask), running=running, **kwargs)
        expected = ref.compute_advantages(rewards, mask=mask, history=history, **kwargs)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5, err_msg=str(kwargs))


def test_jit_matches_eager_and_carries_running_state():
    fn = jax.jit(
        functools.partial(
            compute_advantages,
            group_size=4,
            adv_estimator="grpo",
            reward_norm="running",
            reward_clip=1.5,
            whiten_advantages=True,
        )
    )
    rng = np.random.default_rng(2)
    running_jit = running_eager = adv_lib.init_running_moments()
    for _ in range(2):
        rewards = jnp.asarray(rng.normal(size=8), jnp.float32)
        mask = jnp.asarray(rng.random(8) > 0.2)
        out_jit, running_jit = fn(rewards, mask=mask, running=running_jit)
        out_eager, running_eager = _adv(
            rewards,
            group_size=4,
            adv_estimator="grpo",
            reward_norm="running",
            reward_clip=1.5,
            whiten_advantages=True,
            mask=mask,
            running=running_eager,
        )
        np.testing.assert_allclose(np.asarray(out_jit), out_eager, rtol=1e-5, atol=1e-6)
    assert int(running_jit.count) == int(running_eager.count)
    assert float(running_jit.mean) == pytest.approx(float(running_eager.mean), rel=1e-6)


def test_bad_arguments_raise_clear_errors():
    r = jnp.zeros(6)
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        compute_advantages(r, group_size=4, adv_estimator="grpo")
    with pytest.raises(ValueError, match=r"adv_estimator 'gae'.*grpo.*reinforce"):
        compute_advantages(r, group_size=3, adv_estimator="gae")
    with pytest.raises(ValueError, match=r"reward_norm 'batchnorm'.*running"):
        compute_advantages(r, group_size=3, adv_estimator="grpo", reward_norm="batchnorm")
    with pytest.raises(ValueError, match="mask has shape"):
        compute_advantages(r, group_size=3, adv_estimator="grpo", mask=jnp.ones(5))
    with pytest.raises(ValueError, match=r"rewards must be \[B\]"):
        compute_advantages(jnp.zeros((2, 3)), group_size=3, adv_estimator="grpo")


# ---------------------------------------------------------------------------------------------
# Token level.
# ---------------------------------------------------------------------------------------------


def test_token_level_returns_hand_example():
    rewards = jnp.array([[1.0, 2.0, 3.0, 7.0], [1.0, 9.0, 2.0, 3.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 1, 1]])
    # γ = 1, row 0: [1+2+3, 2+3, 3, (masked) 0] = [6, 5, 3, 0].
    out = adv_lib.token_level_returns(rewards, mask, 1.0)
    np.testing.assert_allclose(np.asarray(out[0]), [6.0, 5.0, 3.0, 0.0])
    # γ = 0.5, row 0: R2 = 3, R1 = 2 + 0.5·3 = 3.5, R0 = 1 + 0.5·3.5 = 2.75.
    # Row 1 has a hole at t = 1 (no reward, no discount step): R3 = 3, R2 = 2 + 1.5 = 3.5,
    # R0 = 1 + 0.5·3.5 = 2.75, R1 = 0.
    out = adv_lib.token_level_returns(rewards, mask, 0.5)
    np.testing.assert_allclose(np.asarray(out), [[2.75, 3.5, 3.0, 0.0], [2.75, 0.0, 3.5, 3.0]])
    # Random parity with the reference (loops).
    rng = np.random.default_rng(3)
    r = rng.normal(size=(5, 7)).astype(np.float32)
    m = (rng.random((5, 7)) > 0.3).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(adv_lib.token_level_returns(jnp.asarray(r), m, 0.9)),
        ref.token_level_returns(r, m, 0.9),
        rtol=1e-5,
        atol=1e-6,
    )


def test_token_advantages_hand_example_with_in_reward_kl():
    # Sequence reward 1 on the last valid token plus per-token −β·KL = −0.1:
    # r̃ = [−0.1, −0.1, 0.9, (pad)] -> reward-to-go [0.7, 0.8, 0.9, 0].
    rewards = jnp.array([1.0, 0.0])
    token_rewards = jnp.full((2, 4), -0.1)
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    out, _ = adv_lib.compute_token_advantages(
        rewards, token_rewards, mask, group_size=2, adv_estimator="reinforce"
    )
    # Row 1: r̃ = [−0.1, −0.1] -> [−0.2, −0.1, 0, 0].
    np.testing.assert_allclose(
        np.asarray(out), [[0.7, 0.8, 0.9, 0], [-0.2, -0.1, 0, 0]], rtol=1e-6, atol=1e-7
    )
    # grpo: scores Σ r̃ = [0.7, −0.2]: mean 0.25, std = 0.6363961 -> ±0.45/0.6363961 = ±0.7071.
    out, _ = adv_lib.compute_token_advantages(
        rewards, token_rewards, mask, group_size=2, adv_estimator="grpo"
    )
    a = 0.45 / (0.6363961 + 1e-6)
    np.testing.assert_allclose(np.asarray(out), [[a, a, a, 0], [-a, -a, 0, 0]], rtol=1e-5)
    # Jittable with the static arguments closed over.
    jitted = jax.jit(
        functools.partial(
            adv_lib.compute_token_advantages, group_size=2, adv_estimator="grpo", gamma=0.9
        )
    )
    out_jit, _ = jitted(rewards, token_rewards, mask)
    np.testing.assert_allclose(np.asarray(out_jit), np.asarray(out), rtol=1e-6)


def test_token_advantages_without_token_rewards_equal_sequence_advantages():
    rng = np.random.default_rng(4)
    rewards = jnp.asarray(rng.normal(size=8), jnp.float32)
    mask_BT = jnp.asarray(np.arange(5)[None, :] < rng.integers(1, 6, 8)[:, None])
    kwargs = {"group_size": 4, "reward_norm": "batch", "reward_clip": 1.0, "advantage_clip": 1.5}
    for estimator in ("grpo", "reinforce"):
        seq, _ = compute_advantages(rewards, adv_estimator=estimator, **kwargs)
        tok, _ = adv_lib.compute_token_advantages(
            rewards, jnp.zeros((8, 5)), mask_BT, adv_estimator=estimator, **kwargs
        )
        expected = np.where(np.asarray(mask_BT), np.asarray(seq)[:, None], 0.0)
        np.testing.assert_allclose(np.asarray(tok), expected, rtol=1e-6, atol=1e-7)
    # Whitening in the token variant is over valid tokens.
    tok, _ = adv_lib.compute_token_advantages(
        rewards,
        jnp.zeros((8, 5)),
        mask_BT,
        adv_estimator="reinforce",
        group_size=4,
        whiten_advantages=True,
    )
    values = np.asarray(tok)[np.asarray(mask_BT)]
    assert values.mean() == pytest.approx(0.0, abs=1e-6)
    assert values.std(ddof=1) == pytest.approx(1.0, rel=1e-4)


def test_rloo_hand_example():
    # Group [1, 0, 0, 1]: baselines are the other three's means [1/3, 2/3, 2/3, 1/3]
    #   -> [2/3, −2/3, −2/3, 2/3] (= 4/3 · (r − 0.5)).
    # Group [3, 1, 2, nan(masked)]: n = 3, others' means [1.5, 2.5, 2] -> [1.5, −1.5, 0], 0.
    rewards = [1, 0, 0, 1, 3, 1, 2, np.nan]
    mask = jnp.array([1, 1, 1, 1, 1, 1, 1, 0], jnp.float32)
    out, _ = _adv(rewards, group_size=4, adv_estimator="rloo", mask=mask)
    np.testing.assert_allclose(out, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0, 0], rtol=1e-6)
    # A member alone in its group has no baseline: 0, never NaN.
    out, _ = _adv([5.0, 7.0], group_size=2, adv_estimator="rloo", mask=jnp.array([1.0, 0.0]))
    assert out.tolist() == [0.0, 0.0]
    # Identical rewards: exactly 0.
    out, _ = _adv([0.3] * 4, group_size=4, adv_estimator="rloo")
    assert (out == 0).all()


def test_dr_grpo_hand_example():
    # norm_adv_by_std_in_grpo=False: group mean only. [1, 0, 0, 1] -> ±0.5; [3, 1, 2, 2] ->
    # [1, −1, 0, 0]; the z-score would give ±0.866 and ±1.2247 (test_grpo_hand_example).
    out, _ = _adv(
        [1, 0, 0, 1, 3, 1, 2, 2], group_size=4, adv_estimator="grpo", norm_adv_by_std_in_grpo=False
    )
    np.testing.assert_allclose(out, [0.5, -0.5, -0.5, 0.5, 1, -1, 0, 0], rtol=1e-6)
    # Only "grpo" reads the flag.
    a, _ = _adv([1.0, 0.0, 0.0, 2.0], group_size=4, adv_estimator="rloo")
    b, _ = _adv(
        [1.0, 0.0, 0.0, 2.0], group_size=4, adv_estimator="rloo", norm_adv_by_std_in_grpo=False
    )
    assert (a == b).all()


def test_rloo_and_dr_grpo_parity_with_numpy_reference():
    rng = np.random.default_rng(0)
    for seed, g in enumerate((2, 3, 4, 8)):
        rewards = rng.normal(size=4 * g).astype(np.float32)
        valid = rng.random(4 * g) > 0.2
        mask = jnp.asarray(valid.astype(np.float32))
        got, _ = _adv(rewards, group_size=g, adv_estimator="rloo", mask=mask)
        np.testing.assert_allclose(
            got, ref.rloo_advantages(rewards, g, valid), rtol=1e-5, atol=1e-6
        )
        got, _ = _adv(
            rewards, group_size=g, adv_estimator="grpo", mask=mask, norm_adv_by_std_in_grpo=False
        )
        want = ref.dr_grpo_advantages(rewards, g, valid)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(seed))
    # Token-level form (in-reward KL): Dr. GRPO's baseline on the summed token score too.
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
    out, _ = adv_lib.compute_token_advantages(
        rewards,
        jnp.zeros((4, 2)),
        jnp.ones((4, 2)),
        group_size=4,
        adv_estimator="grpo",
        norm_adv_by_std_in_grpo=False,
    )
    np.testing.assert_allclose(np.asarray(out), [[0.5] * 2, [-0.5] * 2, [-0.5] * 2, [0.5] * 2])
