"""The RL loop's pieces on their own: setup -> RunState -> rollouts.collect -> train_on, and the
checkpoint of a RunState (docs/architecture.md, "One RL step")."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from gspo_jax.rollout import stage as rollout
from gspo_jax.train_step import batch_ndims
from gspo_jax.trainer import loop, setup
from gspo_jax.trainer.io import checkpoint


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    config = tiny_config(root / "data")
    config.checkpoint.async_save = False
    trainer = setup.setup(config, str(root / "run"))
    # The config, for the tests' own arithmetic (the Trainer keeps none).
    yield _WithConfig(trainer, config)
    trainer.close()


class _WithConfig:
    """A Trainer with its config beside it (the tests' own expectations read it)."""

    def __init__(self, trainer, config):
        self._trainer, self.config = trainer, config

    def __getattr__(self, name):
        return getattr(self._trainer, name)


@pytest.fixture(scope="module")
def first(trainer):
    """The initial state and the first rollout collected from it."""
    state = loop.init_or_restore(trainer)
    return state, trainer.rollouts.collect(state, next(trainer.train_iter))


def test_collect_returns_the_declared_train_batch(trainer, first):
    state, out = first
    c = trainer.config
    n, g = c.rollout_batch_size, c.num_return_sequences_in_group
    assert state.step == 0 and state.origin.startswith("scratch initialisation + 3")
    assert set(out.batch) == set(batch_ndims(trainer.step_config))
    tokens = out.batch["tokens"]
    assert tokens.shape[0] == n * g and out.batch["response_mask"].shape == (n * g, 12)
    for name, array in out.batch.items():
        assert array.sharding == trainer.rollouts.batch_shardings[name], name
    # The G responses of a prompt share its (left-padded) prompt columns.
    prompt_len = tokens.shape[1] - c.response_length
    prompts = np.asarray(tokens[:, :prompt_len]).reshape(n, g, prompt_len)
    assert (prompts == prompts[:, :1]).all()
    # Group z-scores: every group's valid advantages sum to 0.
    adv = np.asarray(out.batch["advantages"]).reshape(n, g)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)
    assert len(out.completions) == n * g and out.rewards.shape == (n * g,)
    for key in ("reward/mean", "response/length_mean", "time/sample_s"):
        assert np.isfinite(out.host_metrics[key]), key
    # The sampler's useful share: response tokens over the decode rows it computed. One
    # slot per sequence and no drain (fewer than 64 rows): every row until the longest ends.
    mask_BT = np.asarray(out.batch["response_mask"])
    frac = out.host_metrics["rollout/useful_row_frac"]
    assert 0 < frac <= 1 and out.host_metrics["rollout/preemptions"] == 0
    assert frac == pytest.approx(mask_BT.sum() / (n * g * mask_BT.sum(axis=1).max()), rel=1e-9)
    # The sampler's log-probs of its own tokens: log-probabilities, 0 past the end token.
    logp, mask = np.asarray(out.batch["sampler_logprobs"]), np.asarray(out.batch["response_mask"])
    assert np.all(logp[mask > 0] <= 0) and np.all(logp[mask == 0] == 0)


def test_collect_is_a_function_of_the_state_and_the_prompts(trainer, first):
    state, out = first
    # The same state and prompts draw the same responses (the key is fold_in(rng, step)).
    again = trainer.rollouts.collect(state, _first_batch(trainer))
    np.testing.assert_array_equal(again.batch["tokens"], out.batch["tokens"])
    # Another RL step of the same state draws other responses.
    other = trainer.rollouts.collect(state.replace(step=1), _first_batch(trainer))
    assert not np.array_equal(other.batch["tokens"], out.batch["tokens"])


def _first_batch(trainer):
    """The train iterator's first batch, read again from a fresh iterator of its data."""
    it = trainer.train_iter.data.iterator(trainer.train_iter.batch_size, seed=trainer.config.seed)
    return next(it)


def test_rl_step_applies_the_mini_batch_updates(trainer, first):
    state, out = first
    # The train step donates the state it is given: give it a copy (the fixture is shared).
    state = state.replace(train=jax.tree.map(jnp.copy, state.train))
    # A 3-step warm start scores 0 everywhere (all advantages 0): train_on takes any rollout,
    # so give this one advantages that move the policy.
    num_rows = out.batch["advantages"].shape[0]
    advantages = np.where(np.arange(num_rows) % 2, 1.0, -1.0).astype(np.float32)
    advantages = jax.device_put(advantages, trainer.rollouts.batch_shardings["advantages"])
    out = dataclasses.replace(out, batch={**out.batch, "advantages": advantages})
    before = jax.tree.map(np.asarray, state.train.params)
    new, metrics = loop.train_on(trainer, state, out)
    minis = trainer.config.num_mini_batches
    assert new.step == 1 and int(new.train.step) == minis
    assert float(metrics["policy/optimizer_step"]) == minis
    assert float(metrics["policy/skipped_updates"]) == 0
    after = jax.tree.leaves(new.train.params)
    assert (
        max(np.max(np.abs(np.asarray(a) - b)) for a, b in zip(after, jax.tree.leaves(before))) > 0
    )
    assert new.running is out.running
    for key in ("policy/loss", "policy/clipfrac", "reward/mean", "time/train_s"):
        assert np.isfinite(float(metrics[key])), key
    # π_old recomputed by the step itself: its first update is exactly on-policy (f32 here),
    # and the f32 sampler agrees with the trainer.
    assert float(metrics["policy/ratio_noise_floor"]) == 0
    assert float(metrics["sampler/logprob_gap_max"]) < 1e-4
    assert metrics["updates/ratio_max"].shape == (minis,)
    flat = loop.flat_metrics(jax.device_get(metrics))
    assert flat["updates/ratio_max/0"] == 1.0 and f"updates/clipfrac/{minis - 1}" in flat


def test_run_state_checkpoint_round_trip(trainer, tmp_path):
    state = loop.init_or_restore(trainer).replace(step=7, data='{"x": 1}', origin="test")
    manager = checkpoint.make_manager(str(tmp_path / "ckpt"), async_save=False)
    checkpoint.save(manager, state)
    restored = checkpoint.restore_latest(manager, trainer.abstract_state())
    manager.close()
    assert restored.step == 7 and restored.data == '{"x": 1}'
    assert restored.origin.startswith("checkpoint 7 in ")
    assert jax.tree.structure(state) == jax.tree.structure(restored.replace(origin="test"))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(a, b)
        assert a.sharding == b.sharding


def test_checkpoints_with_per_process_data_positions(trainer, tmp_path):
    """The format before global prompt batches kept one data position per process: one
    process's resumes (its order was the global one), several are refused by name."""
    import orbax.checkpoint as ocp

    state = loop.init_or_restore(trainer)
    position = json.dumps(trainer.train_iter.get_state())
    for step, positions in ((1, [position]), (2, [position, position])):
        manager = checkpoint.make_manager(str(tmp_path / str(step)), async_save=False)
        meta = {**state.meta(), "step": step, "data": positions}
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state.arrays()), meta=ocp.args.JsonSave(meta)
            ),
        )
        if len(positions) == 1:
            restored = checkpoint.restore_latest(manager, trainer.abstract_state())
            assert restored.data == position and restored.step == 1
        else:
            with pytest.raises(ValueError, match="holds one data position per process .2 of"):
                checkpoint.restore_latest(manager, trainer.abstract_state())
        manager.close()


@pytest.mark.parametrize("num_prompts, batch_size", [(10, 8), (3, 64), (20, 5)])
def test_evaluation_scores_exactly_the_first_num_prompts(trainer, num_prompts, batch_size):
    """Whatever the batch size (and so the padding of the last call): the first num_prompts
    of the split, each once. The accuracy reward here is the reference itself, so the
    per-problem scores (eval.save_per_problem) are the references in split order."""
    import gspo_jax.rewards.testing  # noqa: F401  (registers test_const)
    from gspo_jax.rewards import build_reward
    from gspo_jax.trainer import evaluation

    seen = []

    def sample_greedy(tokens, mask):
        seen.append(np.asarray(tokens).shape[0])
        rows = np.asarray(tokens).shape[0]
        return types.SimpleNamespace(tokens=np.zeros((rows, 2), np.int32), mask=np.ones((rows, 2)))

    scorer = rollout.Scorer(build_reward("test_const"), "zero")
    per_problem = []
    got = evaluation.greedy_accuracy(
        sample_greedy,
        trainer.evaluator.eval_data,
        trainer.tokenizer,
        scorer,
        trainer.mesh,
        num_prompts=num_prompts,
        batch_size=batch_size,
        buckets=trainer.config.sampling.prompt_buckets,
        per_problem=per_problem,
    )
    references = trainer.evaluator.eval_data.arrays["reference"][:num_prompts].astype(float)
    np.testing.assert_array_equal(np.concatenate([i for i, _ in per_problem]), range(num_prompts))
    np.testing.assert_allclose(np.concatenate([s for _, s in per_problem]), references)
    assert got["eval/num_prompts"] == num_prompts
    np.testing.assert_allclose(got["eval/accuracy"], references.mean(), rtol=1e-6)
    assert got["eval/length_mean"] == 2
    # Each call a whole number of rows per data-parallel device (8), at most batch_size.
    assert all(n % 8 == 0 or n == batch_size for n in seen) and sum(seen) >= num_prompts


def _scripted_warm_start(trainer, accuracies, **spec):
    """warm_start.warm_start on the tiny run's pieces with a `check` that returns the given
    accuracies in turn; returns (WarmStartResult, the steps each check saw)."""
    from gspo_jax import models
    from gspo_jax.trainer import warm_start as warm_start_lib

    seen = iter(accuracies)
    params = models.init_params(trainer.model_config, jax.random.PRNGKey(0))
    _, result = warm_start_lib.warm_start(
        trainer.model_config,
        params,
        trainer.sft_source,
        trainer.tokenizer,
        trainer.mesh,
        spec=dataclasses.replace(trainer.warm_start, **spec),
        prompt=trainer.prompt,
        data_spec=trainer.data_spec,
        progress=False,
        check=lambda params: next(seen),
    )
    return result


def test_a_warm_start_trained_to_a_target_stops_at_the_first_check_that_reaches_it(trainer):
    result = _scripted_warm_start(
        trainer, [0.1, 0.2, 0.35, 0.9], steps=4, max_steps=6, check_every=1, target_accuracy=0.3
    )
    assert result.steps == 3 and result.reached is True
    assert result.checks == ((1, 0.1), (2, 0.2), (3, 0.35))
    assert "3 supervised warm-start steps (target reached: 35.0%)" == result.describe()


def test_a_warm_start_short_of_its_target_runs_to_max_steps_and_says_so(trainer, caplog):
    """Checks every check_every steps and at `steps` (the schedule's end), then at
    max_steps; it keeps what it trained and warns, naming the fields to change."""
    result = _scripted_warm_start(
        trainer, [0.0, 0.1, 0.2, 0.3], steps=3, max_steps=5, check_every=2, target_accuracy=0.5
    )
    assert result.reached is False and result.steps == 5
    assert result.checks == ((2, 0.0), (3, 0.1), (4, 0.2), (5, 0.3))
    assert "warm_start.max_steps" in caplog.text and "warm_start.target_accuracy" in caplog.text
    assert "target NOT reached" in result.describe()


def test_the_loops_warm_start_checks_the_train_split(trainer):
    """loop.warm_start builds its check from the held-out evaluator on the train split:
    with an unreachable target every check is a real greedy accuracy in [0, 1]."""
    from gspo_jax import models

    spec = dataclasses.replace(
        trainer.warm_start, steps=2, max_steps=4, check_every=2, check_prompts=8
    )
    trainer = types.SimpleNamespace(
        **{k: getattr(trainer, k) for k in ("model_config", "sft_source", "tokenizer", "mesh")},
        warm_start=dataclasses.replace(spec, target_accuracy=1.0),
        prompt=trainer.prompt,
        data_spec=trainer.data_spec,
        evaluator=trainer.evaluator,
        schedule=trainer.schedule,
        state_shardings=trainer.state_shardings,
        is_lead=False,
    )
    params = models.init_params(trainer.model_config, jax.random.PRNGKey(0))
    _, result = loop.warm_start(trainer, params)
    assert [s for s, _ in result.checks] == [2, 4] and result.reached is False
    assert all(0.0 <= a <= 1.0 for _, a in result.checks)


def test_the_warm_start_trains_a_loaded_checkpoint(trainer, tmp_path):
    """warm_start.steps > 0 with model.hf_path: the loaded weights, then supervised steps
    (how the experiment's upcycled MoE specialises its experts before RL); the origin names
    both, and the weights moved from the checkpoint's."""
    from gspo_jax import models

    params = models.init_params(trainer.model_config, jax.random.PRNGKey(3))
    hf = str(tmp_path / "hf")
    checkpoint.export_hf(trainer.model_config, trainer.tokenizer, params, hf)
    trainer = types.SimpleNamespace(
        **{
            k: getattr(trainer, k)
            for k in ("model_config", "sft_source", "tokenizer", "mesh", "prompt", "data_spec")
        },
        warm_start=dataclasses.replace(trainer.warm_start, steps=2, target_accuracy=None),
        evaluator=trainer.evaluator,
        schedule=dataclasses.replace(trainer.schedule, hf_path=hf),
        state_shardings=trainer.state_shardings,
        workdir=str(tmp_path / "run"),
        is_lead=False,
        warm_cache=None,  # trainer/warm_cache.py: off
    )
    trained, origin = loop._base_params(trainer, resume=False)
    assert origin == f"Hugging Face checkpoint {hf} + 2 supervised warm-start steps"
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), trained, params)
    assert max(jax.tree.leaves(moved)) > 0
    trainer.warm_start = dataclasses.replace(trainer.warm_start, steps=0)
    loaded, origin = loop._base_params(trainer, resume=False)
    assert origin == f"Hugging Face checkpoint {hf}"
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), loaded, params)
    assert all(jax.tree.leaves(same))
