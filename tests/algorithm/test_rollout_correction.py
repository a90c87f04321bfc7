"""The rollout correction (objectives.rollout_correction_weights, policy_loss's rollout_*
arguments, the train step's wiring): a stop-gradient weight of ρ = π_old / μ kept apart from
the GSPO ratio; parity with tests/np_reference.py; extreme inputs; config validation; one
end-to-end run through `python -m gspo_jax.main`.

Functions run eagerly on tiny shapes (faster than compiling them)."""

import dataclasses
import math
import subprocess
import warnings

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TINY_MODEL, main_command, metrics_by_step

from configs import base as base_config
from gspo_jax import models
from gspo_jax import objectives as obj
from gspo_jax.config.specs import step_config
from gspo_jax.config.validate import ConfigError, ConfigWarning, validate
from gspo_jax.train_step import TrainState, make_logprobs_fn, make_train_step

IS_MODES = ("token", "seq", "seq_token")
MODES = ("tis", "mask")
LEVELS = ("token", "seq")
SHAPE = (5, 6)  # B, T of every test's inputs but one


def _weights(old, mu, mask, mode, level, threshold=2.0):
    w, m = obj.rollout_correction_weights(
        jnp.asarray(old), jnp.asarray(mu), jnp.asarray(mask), mode=mode, level=level,
        threshold=threshold,
    )  # fmt: skip
    return np.asarray(w), {k: float(v) for k, v in m.items()}


def _random(seed, num_b=SHAPE[0], num_t=SHAPE[1]):
    """Sampler log-probs μ off the trainer's π_old by up to ±1 per token (so both sides of
    [1/2, 2] are hit), ragged masks, a fully masked row, NaN / -inf where masked."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (num_b, num_t))
    mu = old + rng.uniform(-1.0, 1.0, (num_b, num_t))
    lengths = rng.integers(1, num_t + 1, num_b)
    mask = (np.arange(num_t)[None] < lengths[:, None]).astype(np.float32)
    mask[2] = 0.0
    old[mask == 0] = np.nan
    mu[mask == 0] = -np.inf
    return old.astype(np.float32), mu.astype(np.float32), mask


def _pad(x, fill):
    """[b, t] -> SHAPE, padded with `fill` (every test shares one shape: eager ops compile
    once per shape)."""
    out = np.full(SHAPE, fill, np.float32)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def test_hand_computed_weights():
    # Row 0, token ρ = (3, 1/4, 1, 1.5); row 1 (2 valid tokens) ρ = (4, 1): geometric mean 2.
    log = np.log
    old = np.array([[log(3), log(0.25), 0.0, log(1.5)], [log(4), 0.0, 9.0, 9.0]], np.float32)
    old, mu = _pad(old, np.nan), _pad(np.zeros((2, 4)), 7.0)
    mask = _pad(np.array([[1, 1, 1, 1], [1, 1, 0, 0]]), 0.0)
    w, m = _weights(old, mu, mask, "tis", "token")
    np.testing.assert_allclose(w, _pad(np.array([[2, 0.25, 1, 1.5], [2, 1, 0, 0]]), 0), rtol=1e-6)
    assert m["correction/capped_frac"] == pytest.approx(2 / 6)
    assert m["correction/weight_max_raw"] == pytest.approx(4.0)
    assert m["correction/weight_min_raw"] == pytest.approx(0.25)
    assert m["correction/weight_mean_raw"] == pytest.approx((3 + 0.25 + 1 + 1.5 + 4 + 1) / 6)
    assert m["correction/weight_mean"] == pytest.approx((2 + 0.25 + 1 + 1.5 + 2 + 1) / 6)
    w, m = _weights(old, mu, mask, "mask", "token")
    np.testing.assert_allclose(w, _pad(np.array([[0, 0, 1, 1.5], [0, 1, 0, 0]]), 0), rtol=1e-6)
    assert m["correction/masked_frac"] == pytest.approx(3 / 6)
    # seq: row 0's ρ = (3 · 1/4 · 1 · 1.5)^(1/4) = 1.125^(1/4); row 1's = (4 · 1)^(1/2) = 2.
    rho0 = 1.125**0.25
    w, m = _weights(old, mu, mask, "tis", "seq", threshold=1.5)
    np.testing.assert_allclose(w, _pad(np.array([[rho0] * 4, [1.5, 1.5, 0, 0]]), 0), rtol=1e-6)
    assert m["correction/capped_frac"] == pytest.approx(0.5)  # one of two sequences
    assert m["correction/weight_mean"] == pytest.approx((rho0 + 1.5) / 2, rel=1e-6)
    w, _ = _weights(old, mu, mask, "mask", "seq", threshold=1.5)
    np.testing.assert_allclose(w, _pad(np.array([[rho0] * 4, [0, 0, 0, 0]]), 0), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_weights_match_the_numpy_reference(mode, level):
    for seed in range(3):
        old, mu, mask = _random(seed)
        w, m = _weights(old, mu, mask, mode, level)
        want, raw = ref.rollout_correction_weights(old, mu, mask, mode, level, 2.0)
        np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
        assert m["correction/weight_max_raw"] == pytest.approx(max(raw), rel=1e-5)
        assert m["correction/weight_mean_raw"] == pytest.approx(np.mean(raw), rel=1e-5)
        out = [r > 2 if mode == "tis" else not 0.5 <= r <= 2 for r in raw]
        key = "capped_frac" if mode == "tis" else "masked_frac"
        assert m[f"correction/{key}"] == pytest.approx(np.mean(out))


def test_sequence_weight_is_the_geometric_mean_not_the_product():
    """exp(sum) — TRL #5814, NeMo-RL #2269 — scales with length: a 6-token response whose
    every token has log ρ = 0.2 gets exp(1.2) = 3.3 (capped to 2), one with −0.2 gets
    exp(−1.2) = 0.30 (masked out at C = 2); a 200-token one with ±0.005 the same. The
    geometric mean gives exp(±0.2) whatever the length: 1.22 and 0.82, kept as they are."""
    per_token = np.array([0.2, -0.2, 0.2, -0.2, 0.2], np.float32)[:, None]
    old = np.broadcast_to(per_token, SHAPE).copy()
    mu, mask = np.zeros(SHAPE, np.float32), np.ones(SHAPE, np.float32)
    mask[4, 3:] = 0  # a shorter response: the same per-token drift, the same weight
    want = np.exp(per_token[:, 0])
    for mode in MODES:
        w, m = _weights(old, mu, mask, mode, "seq")
        np.testing.assert_allclose(w[:, 0], want, rtol=1e-5)
        assert m["correction/weight_max_raw"] == pytest.approx(math.exp(0.2), rel=1e-5)
        assert m[f"correction/{'capped' if mode == 'tis' else 'masked'}_frac"] == 0


def test_the_weight_carries_no_gradient():
    old, mu, mask = _random(4)
    mu = np.where(mask > 0, mu, 0.0).astype(np.float32)
    lp = np.where(mask > 0, old + 0.1, 0.0).astype(np.float32)
    adv = np.linspace(-1, 1, old.shape[0]).astype(np.float32)
    for mode in MODES:
        for level in LEVELS:

            def weights(o, u, mode=mode, level=level):
                return obj.rollout_correction_weights(
                    o, u, jnp.asarray(mask), mode=mode, level=level, threshold=2.0
                )[0].sum()

            g_old, g_mu = jax.grad(weights, argnums=(0, 1))(jnp.asarray(old), jnp.asarray(mu))
            assert not np.any(np.asarray(g_old)) and not np.any(np.asarray(g_mu))

            def loss(u, mode=mode, level=level):
                return obj.policy_loss(
                    jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                    importance_sampling="seq", clip_low=0.2, clip_high=0.2,
                    sampler_logprobs=u, rollout_correction=mode, rollout_correction_level=level,
                )[0]  # fmt: skip

            assert not np.any(np.asarray(jax.grad(loss)(jnp.asarray(mu))))


@pytest.mark.parametrize("importance_sampling", IS_MODES)
def test_corrected_loss_and_gradient_match_the_numpy_reference(importance_sampling):
    """L_t times the weight, the ratio and its clip untouched: the reference's loss and
    analytic gradient with the reference's weights as constant per-token factors."""
    old, mu, mask = _random(7)
    rng = np.random.default_rng(8)
    lp = (old + rng.normal(0, 0.2, old.shape)).astype(np.float32)
    adv = rng.normal(size=old.shape[0]).astype(np.float32)
    for mode in MODES:
        for level in LEVELS:
            kwargs = {"importance_sampling": importance_sampling, "clip_low": 0.1, "clip_high": 0.1}

            def f(x, mode=mode, level=level, kwargs=kwargs):
                return obj.policy_loss(
                    x, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), **kwargs,
                    sampler_logprobs=jnp.asarray(mu), rollout_correction=mode,
                    rollout_correction_level=level,
                )  # fmt: skip

            (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
            w, _ = ref.rollout_correction_weights(old, mu, mask, mode, level, 2.0)
            want, want_grad, want_m = ref.policy_loss(lp, old, adv, mask, **kwargs, weights=w)
            assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
            np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
            # The clip statistics are the uncorrected ratio's.
            for key in ("clipfrac", "ratio_max", "ratio_min"):
                assert float(metrics[key]) == pytest.approx(want_m[key], rel=1e-5), key


@pytest.mark.parametrize("importance_sampling", IS_MODES)
def test_no_cap_and_a_matching_sampler_give_the_uncorrected_loss_exactly(importance_sampling):
    old, _, mask = _random(11)
    rng = np.random.default_rng(12)
    lp = (np.nan_to_num(old) + rng.normal(0, 0.3, old.shape)).astype(np.float32)
    adv = rng.normal(size=old.shape[0]).astype(np.float32)
    args = [jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)]
    kwargs = {"importance_sampling": importance_sampling, "clip_low": 0.1, "clip_high": 0.1}

    def f(x, **extra):
        return obj.policy_loss(x, *args, **kwargs, **extra)[0]

    base_loss, base_grad = jax.value_and_grad(f)(jnp.asarray(lp))
    for mode in MODES:
        for level in LEVELS:
            loss, grad = jax.value_and_grad(f)(
                jnp.asarray(lp), sampler_logprobs=jnp.asarray(old), rollout_correction=mode,
                rollout_correction_level=level, rollout_correction_threshold=math.inf,
            )  # fmt: skip
            assert float(loss) == float(base_loss), (mode, level)
            np.testing.assert_array_equal(np.asarray(grad), np.asarray(base_grad))


@pytest.mark.parametrize("importance_sampling", IS_MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_huge_log_ratios_and_nan_at_masked_positions_stay_finite(importance_sampling, level):
    """±1e4 per token (a sum over 6 tokens would be ±6e4: exp overflows), NaN / ±inf where
    masked, in π_θ, π_old and μ: loss and gradient finite, for every correction."""
    sign = np.array([1.0, -1.0, 1.0, -1.0, 1.0])[:, None]
    mask = np.array([[1] * 6, [1] * 6, [1, 1, 1, 0, 0, 0], [0] * 6, [1, 0, 0, 0, 0, 0]], np.float32)
    lp = np.where(mask > 0, sign * 1e4, np.nan).astype(np.float32)
    old = np.where(mask > 0, 0.0, np.inf).astype(np.float32)
    mu = np.where(mask > 0, -sign * 1e4, np.nan).astype(np.float32)
    adv = np.array([1.0, -1.0, 2.0, 1.0, -3.0], np.float32)
    for mode in ("none", *MODES):
        extra = {} if mode == "none" else {"sampler_logprobs": jnp.asarray(mu)}

        def f(x, mode=mode, extra=extra):
            return obj.policy_loss(
                x, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                importance_sampling=importance_sampling, clip_low=3e-4, clip_high=4e-4,
                rollout_correction=mode, rollout_correction_level=level, **extra,
            )  # fmt: skip

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
        assert np.isfinite(float(loss)), mode
        assert np.all(np.isfinite(np.asarray(grad))), mode
        assert all(np.isfinite(float(v)) for v in metrics.values()), mode


def test_bad_arguments_name_themselves():
    x = jnp.zeros(SHAPE)
    kwargs = {"importance_sampling": "seq", "clip_low": 0.1, "clip_high": 0.1}
    with pytest.raises(ValueError, match="rollout_correction='tis' needs sampler_logprobs"):
        obj.policy_loss(x, x, x[:, 0], x + 1, **kwargs, rollout_correction="tis")
    with pytest.raises(ValueError, match="sampler_logprobs given with rollout_correction='none'"):
        obj.policy_loss(x, x, x[:, 0], x + 1, **kwargs, sampler_logprobs=x)
    with pytest.raises(ValueError, match=r"rollout_correction='clip' is not one of"):
        obj.policy_loss(x, x, x[:, 0], x + 1, **kwargs, rollout_correction="clip")
    with pytest.raises(ValueError, match=r"rollout_correction_level='sequence' is not one of"):
        obj.rollout_correction_weights(x, x, x, mode="tis", level="sequence", threshold=2.0)
    with pytest.raises(ValueError, match="rollout_correction_threshold must be > 1, got 1.0"):
        obj.rollout_correction_weights(x, x, x, mode="mask", level="token", threshold=1.0)


def _config(**fields):
    c = base_config.get_config()
    for key, value in fields.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"rollout_correction": "icepop"}, r"config.rollout_correction='icepop' is not one of"),
        ({"rollout_correction_level": "sequence"}, r"rollout_correction_level='sequence' is no"),
        ({"rollout_correction_threshold": 1.0}, r"rollout_correction_threshold=1.0 must be"),
        ({"rollout_correction_threshold": math.nan}, r"rollout_correction_threshold=nan must"),
        (
            {"rollout_correction": "tis", "sampling.temperature": 0.0},
            r"rollout_correction='tis' needs sampling.temperature > 0",
        ),
    ],
)
def test_config_errors_name_the_field(fields, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ConfigError, match=match):
            validate(_config(**fields))


def test_correction_options_without_the_switch_warn():
    with pytest.warns(ConfigWarning, match="rollout_correction_level='seq' has no effect"):
        validate(_config(rollout_correction_level="seq"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        validate(_config(rollout_correction="mask", rollout_correction_level="seq"))


# ------------------------------------------------------------------------- the train step

N, G, P, T = 2, 4, 5, 6
B = N * G


@pytest.fixture(scope="module")
def step_setup():
    """The fixture model, a batch whose sampler log-probs are the trainer's shifted per row
    (so ρ spans both sides of [1/C, C]), and the trainer's own log-probs of it."""
    cfg, params = models.load_pretrained("tests/fixtures/models/qwen3")
    sc = step_config(base_config.get_config(), cfg)
    sc = dataclasses.replace(sc, shared_prompt=False, packing=False)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (B, P + T)).astype(np.int32)
    resp = (np.arange(T)[None] < rng.integers(2, T + 1, B)[:, None]).astype(np.float32)
    attn = np.concatenate([np.ones((B, P), np.int32), resp.astype(np.int32)], axis=1)
    trainer, _, _ = make_logprobs_fn(sc)(params, tokens, attn, T)
    # log ρ_i = per-row shift (+ token noise): some sequences beyond log 2, most within.
    shift = np.linspace(-1.2, 1.2, B)[:, None]
    noise = rng.uniform(-0.1, 0.1, (B, T))
    batch = {
        "tokens": jnp.asarray(tokens),
        "attention_mask": jnp.asarray(attn),
        "response_mask": jnp.asarray(resp),
        "sampler_logprobs": trainer - jnp.asarray(shift + noise, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
    }
    return sc, params, batch, np.asarray(trainer)


def _run_step(sc, params, batch):
    import optax

    tx = optax.sgd(1.0)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    new_state, metrics = make_train_step(sc, tx, donate=False)(state, batch)
    return new_state.params, jax.device_get(metrics)


def test_train_step_keeps_the_mismatch_out_of_the_ratio(step_setup):
    """old_logprobs_source="sampler" with TIS at sequence level, 2 mini-batches of 2
    micro-batches: the ratio's π_old is the trainer's own (update 0's ratios are exactly 1,
    though μ is off by up to ±1.3 per token), and the weights are NumPy's ρ of trainer vs
    sampler, per mini-batch."""
    sc, params, batch, trainer = step_setup
    sc = dataclasses.replace(
        sc, old_logprobs_source="sampler", rollout_correction="tis",
        rollout_correction_level="seq", num_mini_batches=2, micro_batch_size=2, horizon=T,
    )  # fmt: skip
    _, m = _run_step(sc, params, batch)
    assert m["ratio_noise_floor"] == 0.0 and m["updates/clipfrac"][0] == 0.0
    assert m["sampler/logprob_gap_max"] > 0.5  # the mismatch is there, in the weight only
    mask = np.asarray(batch["response_mask"])
    sampler = np.asarray(batch["sampler_logprobs"])
    w, raw = ref.rollout_correction_weights(trainer, sampler, mask, "tis", "seq", 2.0)
    raw, w = np.asarray(raw), w[:, 0]
    # Mini-batch m holds rows m, m+2, ...: each metric is the mean over the two updates.
    for key, values in (("weight_mean_raw", raw), ("weight_mean", w), ("capped_frac", raw > 2)):
        want = np.mean([np.mean(values[u::2]) for u in range(2)])
        assert m[f"correction/{key}"] == pytest.approx(want, rel=1e-4, abs=1e-6), key
    assert m["correction/weight_max_raw"] == pytest.approx(raw.max(), rel=1e-4)
    assert 0 < m["correction/capped_frac"] < 1


# ------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_main_runs_with_the_sampler_pi_old_and_a_correction(tmp_path):
    """Two RL steps of `python -m gspo_jax.main` with the sampler's log-probs as π_old and
    the sequence-level mask on: the ratio is against the trainer's π_old (noise floor 0), the
    correction metrics are logged and finite."""
    workdir = tmp_path / "run"
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={tmp_path / 'data'}",
        *TINY_MODEL,
        "--config.num_steps=2",
        "--config.rollout_batch_size=4",
        "--config.num_return_sequences_in_group=4",
        "--config.num_mini_batches=2",
        "--config.eval.every_steps=0",
        "--config.eval.num_prompts=8",
        "--config.eval.batch_size=8",
        "--config.log.plot=false",
        "--config.log.tensorboard=false",
        "--config.warm_start.steps=0",
        "--config.checkpoint.every_steps=0",
        "--config.checkpoint.export_hf=false",
        "--config.old_logprobs_source=sampler",
        "--config.rollout_correction=mask",
        "--config.rollout_correction_level=seq",
        "--config.rollout_correction_threshold=1.5",
    )
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_by_step(workdir)
    for step in (1, 2):
        row = rows[step]
        assert row["policy/ratio_noise_floor"] == 0.0  # π_old is the trainer's own
        for key in ("correction/weight_mean", "correction/weight_max_raw", "policy/loss"):
            assert np.isfinite(row[key]), (step, key)
        assert 0 <= row["correction/masked_frac"] <= 1
        assert 0 <= row["correction/weight_mean"] <= 1.5
