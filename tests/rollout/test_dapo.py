"""DAPO's rollout options (gspo_jax/rollout/filtering.py): the soft overlong penalty, the
dead-group filter of dynamic sampling, the overlong filter, their validation, the dead-group
warning, and the loop with them on (in-process and through `python -m gspo_jax.main`)."""

import dataclasses
import json
import logging
import subprocess

import jax
import numpy as np
import pytest
from helpers import TINY_RUN, main_command, metrics_by_step, tiny_config

from configs import default
from gspo_jax import data
from gspo_jax.config.validate import ConfigError, ConfigWarning, validate
from gspo_jax.rewards import register_reward
from gspo_jax.rollout import filtering
from gspo_jax.trainer import loop, setup

# ------------------------------------------------------------------- the formulas, by hand


def test_overlong_penalty_by_hand():
    # L_max = 12, L_b = 4: no penalty up to 8, then -(L - 8) / 4 * factor, -factor at 12.
    lengths = np.array([0, 5, 8, 9, 10, 11, 12])
    got = filtering.overlong_penalty(lengths, max_length=12, buffer_len=4, factor=1.0)
    np.testing.assert_allclose(got, [0, 0, 0, -0.25, -0.5, -0.75, -1.0])
    assert got.dtype == np.float32
    got = filtering.overlong_penalty(lengths, max_length=12, buffer_len=4, factor=0.5)
    np.testing.assert_allclose(got, [0, 0, 0, -0.125, -0.25, -0.375, -0.5])
    # The buffer may span the whole response: the ramp starts at length 0.
    got = filtering.overlong_penalty([0, 3, 6, 12], max_length=12, buffer_len=12, factor=2.0)
    np.testing.assert_allclose(got, [0, -0.5, -1.0, -2.0])
    # buffer 0 or factor 0: no penalty at all (never a division by zero).
    for buffer_len, factor in ((0, 1.0), (4, 0.0)):
        got = filtering.overlong_penalty(
            lengths, max_length=12, buffer_len=buffer_len, factor=factor
        )
        np.testing.assert_array_equal(got, 0.0)


def test_zero_std_groups_and_the_selection_of_a_batch():
    g = 3
    rewards = np.array(
        [
            [1.0, 1.0, 1.0],  # dead: all equal
            [0.0, 1.0, 0.0],  # live
            [0.5, 0.5, 0.2],  # live, but dead once its odd one out is invalid (below)
            [0.0, 0.0, 0.0],  # dead
            [0.3, 0.7, 0.7],  # live, only one valid reward: dead (below)
        ]
    )
    valid = np.ones_like(rewards, bool)
    dead = filtering.zero_std_groups(rewards.reshape(-1), valid.reshape(-1), g)
    np.testing.assert_array_equal(dead, [True, False, False, True, False])
    valid[2, 2] = False
    valid[4, 1:] = False
    dead = filtering.zero_std_groups(rewards.reshape(-1), valid.reshape(-1), g)
    np.testing.assert_array_equal(dead, [True, False, True, True, True])

    # A batch of 2 from 6 sampled groups: the first two live ones, in sampling order.
    live = np.array([False, True, False, False, True, True])
    index, pad = filtering.select_groups(live, 2)
    np.testing.assert_array_equal(index, [1, 4])
    np.testing.assert_array_equal(pad, [False, False])
    # 4 wanted, 3 live: the fourth is the first dead group, marked as padding.
    index, pad = filtering.select_groups(live, 4)
    np.testing.assert_array_equal(index, [1, 4, 5, 0])
    np.testing.assert_array_equal(pad, [False, False, False, True])
    np.testing.assert_array_equal(filtering.group_rows(np.array([1, 0]), 3), [3, 4, 5, 0, 1, 2])
    with pytest.raises(ValueError, match="cannot fill 4"):
        filtering.select_groups(np.array([True, False]), 4)


def test_dead_groups_warn_once_after_several_steps(caplog):
    watch = filtering.DeadGroupWatch(threshold=0.8, patience=3)
    seen = []
    with caplog.at_level(logging.WARNING, logger=filtering.__name__):
        for step, frac in enumerate([1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 1.0, 1.0], start=1):
            seen.append(watch.after_step(step, {"reward/frac_zero_std": frac}))
    # The streak restarts at step 3 (0.5); steps 4-6 make three in a row; then never again.
    assert [s is not None for s in seen] == [False] * 5 + [True] + [False] * 2
    assert "RL step 6" in seen[5] and "dynamic_sampling=true" in seen[5]
    assert len([r for r in caplog.records if "frac_zero_std" in r.getMessage()]) == 1
    # With dynamic sampling, what counts is the padding it could not replace.
    watch = filtering.DeadGroupWatch(threshold=0.8, patience=2, dynamic=True)
    full = {"reward/frac_zero_std": 1.0, "rollout/groups_short": 0.0, "rollout/groups_kept": 4.0}
    assert watch.after_step(1, full) is None and watch.after_step(2, full) is None
    short = {"reward/frac_zero_std": 1.0, "rollout/groups_short": 4.0, "rollout/groups_kept": 0.0}
    assert watch.after_step(3, short) is None
    assert "raise dynamic_sampling_max_rounds" in watch.after_step(4, short)


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("overlong_buffer_len", 13, r"config.overlong_buffer_len=13 must be in \[0, "),
        ("overlong_buffer_len", -1, "config.overlong_buffer_len=-1 must be a non-negative"),
        ("overlong_penalty_factor", -0.5, "config.overlong_penalty_factor=-0.5 must be"),
        ("overlong_penalty_factor", float("nan"), "config.overlong_penalty_factor=nan must"),
        ("dynamic_sampling_max_rounds", -1, "config.dynamic_sampling_max_rounds=-1 must"),
    ],
)
def test_bad_dapo_options_are_errors_naming_the_field(field, value, match):
    c = default.get_config()
    c.response_length = 12
    c[field] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_dynamic_sampling_needs_groups_and_unused_options_warn():
    c = default.get_config()
    c.dynamic_sampling, c.num_return_sequences_in_group = True, 1
    c.adv_estimator = "reinforce"  # group statistics would be refused first otherwise
    with pytest.raises(ConfigError, match="dynamic_sampling=True needs num_return_seq"):
        validate(c)
    c = default.get_config()
    c.overlong_penalty_factor = 0.5
    with pytest.warns(ConfigWarning, match="overlong_penalty_factor=0.5 has no effect.*buffer"):
        validate(c)
    c = default.get_config()
    c.dynamic_sampling_max_rounds = 5
    with pytest.warns(ConfigWarning, match="dynamic_sampling_max_rounds=5 has no effect"):
        validate(c)


# ---------------------------------------------------------------- the rollout, in-process


@register_reward("test_dapo_parity")
def parity_reward(prompt, completion, reference):
    """Dead by construction on an even reference (every response scores 1); on an odd one
    the score varies with the response (its length mod 3), so the group is usually live."""
    if int(reference) % 2 == 0:
        return 1.0
    return float(len(completion) % 3)


@pytest.fixture(scope="module")
def dapo(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapo")
    config = tiny_config(root / "data")
    config.checkpoint.async_save = False
    config.reward.num_workers = 0
    config.warm_start.steps = 0  # a random policy samples varied responses; no SFT compile
    config.reward.spec = config.reward.accuracy = "test_dapo_parity"
    config.dynamic_sampling, config.dynamic_sampling_max_rounds = True, 3
    config.overlong_filter, config.overlong_buffer_len = True, 4
    trainer = setup.setup(config, str(root / "run"))
    with jax.set_mesh(trainer.mesh):
        yield trainer, loop.init_or_restore(trainer)
    trainer.close()


def _collect(trainer, state, **spec_changes):
    rollouts = trainer.rollouts
    if spec_changes:
        rollouts = dataclasses.replace(
            rollouts, spec=dataclasses.replace(rollouts.spec, **spec_changes)
        )
    return rollouts.collect(
        state, next(trainer.train_iter), more_prompts=lambda: next(trainer.train_iter)
    )


def test_dynamic_sampling_keeps_live_groups_and_masks_the_padding(dapo):
    trainer, state = dapo
    g, n = 4, 4
    eos = list(data.stop_token_ids(trainer.tokenizer))
    shapes = None
    for max_rounds in (3, 0):  # enough rounds to fill the batch (likely); none: padding
        served = trainer.train_iter.get_state()["batches_served"]
        out = _collect(trainer, state, dynamic_sampling_max_rounds=max_rounds)
        m = out.host_metrics
        rounds = int(m["rollout/dynamic_rounds"])
        assert rounds <= max_rounds
        assert trainer.train_iter.get_state()["batches_served"] == served + 1 + rounds
        assert m["rollout/groups_sampled"] == n * (1 + rounds)
        live = round(m["rollout/groups_sampled"] * (1 - m["reward/frac_zero_std"]))
        assert m["rollout/groups_kept"] == min(n, live)
        assert m["rollout/groups_kept"] + m["rollout/groups_short"] == n
        # Same shapes whatever was kept: the jitted train step never recompiles.
        batch_shapes = {k: v.shape for k, v in out.batch.items()}
        assert shapes is None or batch_shapes == shapes
        shapes = batch_shapes
        rewards = out.rewards.reshape(n, g)
        mask = np.asarray(out.batch["response_mask"]).reshape(n, g, -1)
        adv = np.asarray(out.batch["advantages"]).reshape(n, g)
        kept = int(m["rollout/groups_kept"])
        # Kept groups are live; the padding (dead groups at the end) has no loss, no
        # advantage. A truncated response keeps its advantage but loses its loss.
        assert all(np.ptp(r) > 0 for r in rewards[:kept])
        assert all(np.ptp(r) == 0 for r in rewards[kept:])
        assert (mask[kept:] == 0).all() and (adv[kept:] == 0).all()
        assert (np.abs(adv[:kept]).sum(axis=1) > 0).all()
        # Truncated: no end token among the response's tokens (the attention mask keeps
        # every response token; only the loss mask is zeroed).
        t = mask.shape[-1]
        response = np.asarray(out.batch["tokens"])[:, -t:]
        generated = np.asarray(out.batch["attention_mask"])[:, -t:] > 0
        ends = np.isin(response, eos) & generated
        truncated = ~ends.any(axis=1).reshape(n, g)
        loss_rows = mask.sum(axis=-1) > 0
        np.testing.assert_array_equal(loss_rows[:kept], ~truncated[:kept])
        filtered = truncated[:kept].sum() / (n * g)
        assert m["response/filtered_frac"] == pytest.approx(filtered)
    assert rounds == 0 and m["rollout/groups_short"] == max(n - live, 0)


def test_a_resumed_position_repeats_the_step_exactly(dapo, monkeypatch):
    """The loop saves the data position after a step's extra rounds: a run resumed from it
    (the iterator set to it, the same state) draws exactly the same rollout. (The train
    step is a function of that rollout; the end-to-end test below runs it.)"""
    trainer, state = dapo
    rollouts = []

    def train_on(trainer, state, rollout):  # the loop's bookkeeping, without the train step
        rollouts.append(rollout)
        return state.replace(step=state.step + 1), dict(rollout.host_metrics)

    monkeypatch.setattr(loop, "train_on", train_on)
    start = json.dumps(trainer.train_iter.get_state())
    positions = []
    for _ in range(2):
        trainer.train_iter.set_state(start)
        positions.append(loop.rl_step(trainer, state)[0].data)
    assert positions[0] == positions[1] == json.dumps(trainer.train_iter.get_state()) != start
    a, b = rollouts
    served = json.loads(positions[0])["batches_served"] - json.loads(start)["batches_served"]
    assert served == 1 + a.host_metrics["rollout/dynamic_rounds"]
    for key, value in a.batch.items():
        np.testing.assert_array_equal(b.batch[key], value, err_msg=key)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    for key, value in a.host_metrics.items():
        if not key.startswith(("time/", "perf/")):
            assert b.host_metrics[key] == value, key


# ------------------------------------------------------------------------- end to end


def test_main_with_dapo_options(tmp_path):
    workdir, data_dir = tmp_path / "run", tmp_path / "data"
    flags = [
        *(f for f in TINY_RUN if not f.startswith("--config.warm_start.steps=")),
        "--config.warm_start.steps=0",
        "--config.num_steps=2",
        "--config.eval.every_steps=0",
        "--config.checkpoint.export_hf=false",
        "--config.log.plot=false",
        "--config.dynamic_sampling=true",
        "--config.dynamic_sampling_max_rounds=1",
        "--config.overlong_filter=true",
        "--config.overlong_buffer_len=4",
        "--config.overlong_penalty_factor=0.5",
    ]
    cmd = main_command(workdir, f"--config.data.data_dir={data_dir}", *flags)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_by_step(workdir)
    for step in (1, 2):
        row = rows[step]
        assert row["rollout/dynamic_rounds"] in (0, 1)
        assert row["rollout/groups_kept"] + row["rollout/groups_short"] == 4
        assert 0 <= row["reward/frac_zero_std"] <= 1
        assert -0.5 <= row["reward/overlong_penalty_mean"] <= 0
        # Filtered: truncated rows of the train batch (16), among those of every round.
        truncated_rows = row["response/truncated_frac"] * row["rollout/groups_sampled"] * 4
        assert 0 <= row["response/filtered_frac"] * 16 <= truncated_rows + 1e-6
        assert row["policy/optimizer_step"] == 2 * step and np.isfinite(row["policy/loss"])
