"""The RL loop end to end: the main entry point, resume after a kill, reward failure rules."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from helpers import TINY_RUN, main_command, metrics_by_step, tiny_config

from configs import default
from gspo_jax.config import specs
from gspo_jax.rewards import build_reward
from gspo_jax.rollout import stage as rollout
from gspo_jax.trainer import loop

# A tiny version of the default run: 2-layer d=32 model, 4 prompts x 4 samples.
# Metrics that depend on wall time, not on the computation.
_TIMING = ("time/", "perf/")


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """`python -m gspo_jax.main` on the tiny config: the uninterrupted reference run, with RL
    step 2 profiled (`log.profile_steps`; the resumed run compared with it is not)."""
    root = tmp_path_factory.mktemp("main")
    workdir, data_dir = root / "run", root / "data"
    profile = "--config.log.profile_steps=(2,)"
    cmd = main_command(workdir, f"--config.data.data_dir={data_dir}", *TINY_RUN, profile)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir, data_dir


def test_main_entry_point_writes_everything(main_run):
    workdir, _ = main_run
    assert max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == 4
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tb"))
    assert (workdir / "curves.png").stat().st_size > 10_000
    assert (workdir / "hf" / "model.safetensors").exists()
    assert (workdir / "hf" / "tokenizer.json").exists()
    rows = metrics_by_step(workdir)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[4]
    for step in (1, 2, 3, 4):
        row = rows[step]
        for key in (
            "reward/mean",
            "policy/clipfrac",
            "policy/approx_kl",
            "policy/entropy",
            "policy/grad_norm",
            "response/length_mean",
            "time/sample_s",
        ):
            assert np.isfinite(row[key]), (step, key)
        # 2 mini-batches per RL step, none skipped: the optimizer counter advances by 2.
        assert row["policy/optimizer_step"] == 2 * step and row["policy/skipped_updates"] == 0
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["origin"].startswith("scratch initialisation + 3 supervised warm-start")
    (trace,) = (workdir / "profile").glob("plugins/profile/*/*.xplane.pb")  # one trace
    assert trace.stat().st_size > 0


def test_a_restart_with_a_config_that_changes_the_run_stops_and_keeps_the_record(main_run):
    """Before: it resumed the finished run, trained nothing, exited 0, and config.json said
    GRPO for a GSPO checkpoint. Now: one line listing the differences, nothing touched."""
    workdir, data_dir = main_run
    kept = {name: (workdir / name).read_bytes() for name in ("config.json", "metrics.jsonl")}
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={data_dir}",
        *TINY_RUN,
        "--config.importance_sampling=token",
    )
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [x for x in proc.stderr.splitlines() if x.startswith("gspo_jax: error: ")]
    assert len(error) == 1 and "importance_sampling: 'seq' -> 'token'" in error[0], proc.stderr
    assert "--allow_config_change" in error[0] and "Traceback" not in proc.stderr
    for name, content in kept.items():
        assert (workdir / name).read_bytes() == content, name


def test_exported_policy_loads_back(main_run):
    from gspo_jax import models

    workdir, _ = main_run
    cfg, _params = models.load_pretrained(workdir / "hf")
    assert cfg.num_layers == 2 and cfg.hidden_size == 32


def test_killed_run_resumes_as_if_never_stopped(main_run, tmp_path):
    ref_dir, data_dir = main_run
    config = tiny_config(data_dir)
    workdir = tmp_path / "resumed"
    first = loop.run(config, str(workdir), stop_after=2)
    assert first["stopped_after"] == 2
    # Killed after RL step 2 but before its checkpoint committed: the restart resumes from
    # checkpoint 1, and step 2's row, already written, must not appear twice.
    shutil.rmtree(workdir / "checkpoints" / "2")
    second = loop.run(config, str(workdir))
    assert second["start_step"] == 1 and second["origin"].startswith("checkpoint 1")
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4]
    ref, got = metrics_by_step(ref_dir), metrics_by_step(workdir)
    for step in (2, 3, 4):
        for key, value in ref[step].items():
            if key.startswith(_TIMING) or key == "data/epoch":
                continue
            np.testing.assert_allclose(
                got[step][key], value, rtol=1e-5, atol=1e-7, err_msg=f"{step} {key}"
            )


def test_invalid_rewards_follow_the_rule():
    import gspo_jax.rewards.testing  # noqa: F401  (registers test_chaos)

    fn = build_reward("test_chaos")
    completions = ["ok:1", "nan", "str", "raise", "ok:0", "ok:0.5"]
    kwargs = {"prompts": [""] * 6, "completions": completions, "references": [""] * 6}
    r_mask, v_mask, stats = rollout.score_responses(
        fn, invalid_reward="mask", timeout_s=None, **kwargs
    )
    np.testing.assert_array_equal(r_mask, [1, 0, 0, 0, 0, 0.5])
    np.testing.assert_array_equal(v_mask, [1, 0, 0, 0, 1, 1])
    assert stats["num_errors"] == 1 and stats["num_nonfinite"] == 1 and stats["num_nonnumeric"] == 1
    r_zero, v_zero, _ = rollout.score_responses(fn, invalid_reward="zero", timeout_s=None, **kwargs)
    np.testing.assert_array_equal(r_zero, [1, 0, 0, 0, 0, 0.5])
    assert v_zero.all()
    # "mask": invalid responses get advantage 0 and do not enter their group's statistics.
    c = default.get_config()
    c.num_return_sequences_in_group = 3
    adv, _ = rollout.make_advantage_fn(specs.advantage_spec(c))(r_mask, v_mask, None)
    adv = np.asarray(adv)
    assert adv[1] == adv[2] == adv[3] == 0
    # Group 0 has one valid member (std 0): advantage 0. Group 1: rewards (0, 0.5).
    assert adv[0] == 0
    assert adv[4] < 0 < adv[5]


def test_hanging_verifier_is_timed_out_and_counted():
    import gspo_jax.rewards.testing  # noqa: F401
    from gspo_jax.rewards import RewardPool

    fn = build_reward("test_chaos")
    with RewardPool(1) as pool:
        rewards, valid, stats = rollout.score_responses(
            fn,
            [""] * 3,
            ["ok:1", "sleep", "ok:0.25"],
            [""] * 3,
            invalid_reward="mask",
            timeout_s=0.5,
            pool=pool,
        )
    np.testing.assert_array_equal(rewards, [1, 0, 0.25])
    np.testing.assert_array_equal(valid, [1, 0, 1])
    assert stats["num_timeouts"] == 1
    metrics = rollout.reward_metrics(rewards, valid, rewards, stats, group_size=3)
    assert metrics["reward/num_timeouts"] == 1 and metrics["reward/invalid_frac"] == pytest.approx(
        1 / 3
    )


def test_bucket_prompts_trims_padding_to_a_bucket():
    tokens = np.arange(20).reshape(2, 10)
    mask = np.zeros((2, 10), np.int32)
    mask[0, -3:] = 1
    mask[1, -5:] = 1
    t, m = rollout.bucket_prompts(tokens, mask, (4, 6, 8))
    assert t.shape == (2, 6) and m.sum() == 8
    np.testing.assert_array_equal(t, tokens[:, 4:])
    t, _ = rollout.bucket_prompts(tokens, mask, (2, 3))  # no bucket fits: keep the full width
    assert t.shape == (2, 10)


def test_run_from_a_hugging_face_checkpoint_on_gsm8k(tmp_path):
    """Resume order, branch 2: no checkpoint in the workdir -> config.model.hf_path. Uses the
    fixture Qwen3 checkpoint and tokenizer, and a two-line GSM8K manual directory."""
    from configs import gspo_paper
    from gspo_jax import models

    manual = tmp_path / "gsm8k"
    manual.mkdir()
    lines = [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "A box holds 5 pens. How many pens in 2 boxes?", "answer": "5*2=10\n#### 10"},
    ]
    for split in ("train", "test"):
        (manual / f"{split}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    c = gspo_paper.get_config(f"hf_path=tests/fixtures/models/qwen3,manual_dir={manual}")
    c.model.tokenizer_path = "tests/fixtures/models/tokenizer"
    c.model.dtype = "float32"
    c.model.remat = "none"
    c.data.data_dir = str(tmp_path / "data")
    c.num_steps = 2
    c.rollout_batch_size, c.num_return_sequences_in_group = 4, 2  # 8 rows: 8 devices
    c.num_mini_batches, c.micro_batch_size = 1, None
    c.prompt_length, c.response_length = 192, 6
    c.sampling.prompt_buckets = (192,)
    c.eval.num_prompts = c.eval.batch_size = 2
    c.checkpoint.every_steps = 0
    c.reward.num_workers = 0
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    # A random tiny model scores 0 on GSM8K, so advantages are 0; weight decay still moves
    # every parameter, which is what the export check below needs.
    c.optim.learning_rate, c.optim.weight_decay = 1e-3, 0.1
    summary = loop.run(c, str(tmp_path / "run"))
    assert summary["origin"] == "Hugging Face checkpoint tests/fixtures/models/qwen3"
    rows = metrics_by_step(tmp_path / "run")
    assert rows[2]["policy/optimizer_step"] == 2 and np.isfinite(rows[2]["policy/loss"])
    assert rows[2]["sampler/logprob_gap_max"] < 1e-4  # sampler and trainer agree (paper §5.4)
    cfg, params = models.load_pretrained(tmp_path / "run" / "hf")
    ref_cfg, ref = models.load_pretrained("tests/fixtures/models/qwen3")
    assert cfg.num_layers == ref_cfg.num_layers
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(_leaves(params), _leaves(ref)))
    assert moved > 0  # the exported policy is the trained one


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]
