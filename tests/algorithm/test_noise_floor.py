"""The importance ratio's noise floor: at learning rate 0 the policy never changes, so every
ratio must be 1 and nothing may clip, also with bf16 compute at GSPO's ε = 3e-4 / 4e-4.

π_old is the train step's own forward pass on the micro-batches its updates use
(old_logprobs_source="recompute"): bit for bit what the updates recompute. The old way, one
whole-batch pass in the rollout, differs in bf16 by more than ε (checked here too, so the
first test could fail), and the sampler's log-probs carry the train/inference mismatch,
which the step reports (paper §5.4).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspo_jax.rewards.testing  # noqa: F401  (registers test_checksum)
from configs import gspo_paper
from gspo_jax.train_step import make_train_step
from gspo_jax.trainer import loop, setup

EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # configs/gspo_paper.py


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """The paper's GSPO config on the Qwen3 fixture in bf16 (f32 master weights, full
    remat, as configs/common.use_hf_model_on_gsm8k), lr 0, 4 mini-batches of 2
    micro-batches, over the 8 test devices."""
    root = tmp_path_factory.mktemp("noise_floor")
    c = gspo_paper.get_config()
    assert (c.importance_sampling, c.clip_low, c.clip_high) == ("seq", EPS_LOW, EPS_HIGH)
    c.model.hf_path = "tests/fixtures/models/qwen3"
    c.model.tokenizer_path = "tests/fixtures/models/tokenizer"
    c.model.param_dtype, c.model.dtype, c.model.remat = "float32", "bfloat16", "full"
    c.data.data_dir = str(root / "data")
    c.rollout_batch_size, c.num_return_sequences_in_group = 16, 4  # 64 rows
    c.num_mini_batches, c.micro_batch_size = 4, 8
    c.prompt_length, c.response_length = 24, 16
    c.sampling.prompt_buckets = (24,)
    c.reward.spec = c.reward.accuracy = "test_checksum"  # non-zero advantages: clipping can act
    c.reward.num_workers = 0
    c.optim.learning_rate = 0.0
    c.warm_start.steps = 0
    c.checkpoint.async_save = False
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    trainer = setup.setup(c, str(root / "run"))
    state = loop.init_or_restore(trainer)
    rollouts = [trainer.rollouts.collect(state, next(trainer.train_iter)) for _ in range(2)]
    yield trainer, state, rollouts, c
    trainer.close()


def _step(trainer, state, out, **step_overrides):
    """`loop.train_on` with the run's train step, or one built with other StepConfig fields."""
    if step_overrides:
        sc = dataclasses.replace(trainer.step_config, **step_overrides)
        step = make_train_step(
            sc, trainer.tx, state_shardings=trainer.state_shardings.train, mesh=trainer.mesh
        )
        trainer = dataclasses.replace(trainer, step_config=sc, train_step=step)
    fresh = state.replace(train=jax.tree.map(jnp.copy, state.train))  # the step donates it
    _, metrics = loop.train_on(trainer, fresh, out)
    return loop.flat_metrics(
        jax.device_get({k: v for k, v in metrics.items() if not isinstance(v, float)})
    )


def _deviation(m, updates) -> float:
    """max |r − 1| over the given updates (sequence ratios s_i: GSPO)."""
    return max(
        max(m[f"updates/ratio_max/{u}"] - 1, 1 - m[f"updates/ratio_min/{u}"]) for u in updates
    )


def test_bf16_at_lr0_nothing_clips_and_ratios_stay_within_eps_over_10(bf16_run):
    trainer, state, rollouts, config = bf16_run
    assert trainer.model_config.dtype == "bfloat16" and config.old_logprobs_source == "recompute"
    updates = range(config.num_mini_batches)
    for out in rollouts:
        assert np.ptp(np.asarray(out.batch["advantages"])) > 0.1
        m = _step(trainer, state, out)
        for u in updates:
            assert m[f"updates/clipfrac/{u}"] == 0 and m[f"updates/clipfrac_seq/{u}"] == 0, u
        assert _deviation(m, updates) < EPS_LOW / 10
        assert m["policy/ratio_noise_floor"] == 0  # bit for bit: the same computation
        # The bf16 sampler is a different computation: it does not agree to ε here.
        assert m["sampler/logprob_gap_max"] > 1e-3


def test_a_whole_batch_pi_old_pass_in_bf16_exceeds_the_clip_range(bf16_run):
    """What π_old was before: one pass over the whole batch (other shapes than the updates'
    micro-batches). Fed to the step as given log-probs, the lr-0 ratios leave [1 − ε, 1 + ε]."""
    trainer, state, rollouts, config = bf16_run
    out = rollouts[0]
    b = out.batch
    whole = trainer.rollouts.logprobs_fn(
        state.train.params, b["tokens"], b["attention_mask"], config.response_length
    )[0]
    given = dataclasses.replace(out, batch={**b, "sampler_logprobs": whole})
    m = _step(trainer, state, given, old_logprobs_source="sampler")
    assert _deviation(m, range(config.num_mini_batches)) > EPS_HIGH
    assert max(m[f"updates/clipfrac_seq/{u}"] for u in range(4)) > 0


def test_sampler_pi_old_reports_the_train_inference_mismatch(bf16_run):
    """old_logprobs_source="sampler" (paper §5.4): the first update's ratios are
    exp(mean_t(log π_train − log π_sampler)), so the logged noise floor follows the logged
    per-sequence gap: ratio_noise_floor = max_i |exp(g_i) − 1| with |g_i| ≤ seq gap max."""
    trainer, state, rollouts, _ = bf16_run
    m = _step(trainer, state, rollouts[0], old_logprobs_source="sampler")
    gap = m["sampler/seq_logprob_gap_max"]
    assert gap > 0
    floor = m["policy/ratio_noise_floor"]
    # The floor is exp(mean) − 1 in f32: exp's result near 1 is rounded to half an ulp of
    # 1.0 (6e-8), and the gap to f32 rounding of its own mean; 2 ulps of 1.0 cover both.
    ulp = float(np.finfo(np.float32).eps)
    assert -np.expm1(-gap) * (1 - 1e-5) - 2 * ulp <= floor <= np.expm1(gap) * (1 + 1e-5) + 2 * ulp
    assert floor == pytest.approx(_deviation(m, [0]))
