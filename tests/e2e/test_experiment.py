"""The experiment's own pieces (experiments.gspo_vs_grpo); the whole command runs
in tests/e2e/test_notebooks.py (colabs/gspo_vs_grpo.ipynb, --quick)."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from experiments import gspo_vs_grpo
from gspo_jax import models

DENSE = "tests/fixtures/models/qwen3"


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_upcycled_moe_computes_the_dense_function_at_noise_0(tmp_path, noise):
    """8 copies of every MLP, top-2 gates renormalised to sum to 1: the same logits as the
    dense model (noise 0); the noise is what makes the experts differ."""
    out = gspo_vs_grpo.upcycle(DENSE, str(tmp_path / "moe"), noise=noise)
    with open(tmp_path / "moe" / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3_moe"
    dense_cfg, dense = models.load_pretrained(DENSE)
    moe_cfg, moe = models.load_pretrained(out)
    assert (moe_cfg.num_experts, moe_cfg.num_experts_per_tok) == (8, 2)
    assert moe_cfg.moe_intermediate_size == dense_cfg.intermediate_size
    tokens = np.random.default_rng(0).integers(3, dense_cfg.vocab_size, (2, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    a = np.asarray(models.forward(dense_cfg, dense, tokens, mask))
    b = np.asarray(models.forward(moe_cfg, moe, tokens, mask))
    if noise == 0:
        np.testing.assert_allclose(b, a, atol=1e-5)
    else:
        assert np.abs(b - a).max() > 1e-3


def test_upcycle_refuses_a_non_dense_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="model_type 'qwen3_moe'"):
        gspo_vs_grpo.upcycle("tests/fixtures/models/qwen3_moe", str(tmp_path / "x"))


def _stats(**per_seed):
    """arm_stats-shaped entries from per-seed values."""
    from experiments.gspo_vs_grpo import stats

    return {k: (*stats.mean_sd(v), list(map(float, v))) for k, v in per_seed.items()}


def test_verdicts_follow_the_intervals():
    """Dense: GSPO +0.1 on every seed -> consistent; 50x the clipping -> consistent against
    10x. MoE: GSPO vs GRPO + RR equal on every problem -> CI [0, 0], not distinguishable;
    5x the clipping -> not reproduced on this test bed; expert change ~10% -> consistent;
    GRPO + RR below GRPO on every seed -> not reproduced."""
    n = 6
    seedwise = np.linspace(0.0, 0.02, n)
    base = {
        "reward_mean": 0.1 + seedwise,
        "gap_mean": np.zeros(n),
        "eval_start": 0.3 + 0 * seedwise,
    }
    stats = {
        "dense/gspo": _stats(clipfrac_tok=0.2 + seedwise, eval_end=0.4 + seedwise, **base),
        "dense/grpo": _stats(clipfrac_tok=0.004 + 0 * seedwise, eval_end=0.3 + seedwise, **base),
        "moe/gspo": _stats(
            clipfrac_tok=0.05 + 0 * seedwise,
            eval_end=0.3 + seedwise,
            expert_change_1=0.1 + seedwise,
            **base,
        ),
        "moe/grpo_rr": _stats(clipfrac_tok=0.01 + 0 * seedwise, eval_end=0.3 + seedwise, **base),
        "moe/grpo": _stats(
            clipfrac_tok=0.01 + 0 * seedwise,
            eval_end=0.35 + seedwise,
            expert_change_1=0.1 + seedwise,
            expert_change_3=0.2 + seedwise,
            **{**base, "eval_start": np.array([0.5, 0.5, 0.3, 0.3, 0.3, 0.3])},  # 0, 1 collapse
        ),
    }
    same = (np.random.default_rng(0).random((n, 30)) < 0.3).astype(float)
    problems = {"moe/gspo": same, "moe/grpo_rr": same}
    got = {claim: (v, nums) for claim, v, nums in gspo_vs_grpo.verdicts(stats, [], problems)}

    def find(start):
        return next(v for c, v in got.items() if c.startswith(start))

    verdict, numbers = find("§5.2 (dense): GSPO trains")
    assert verdict == "consistent with the claim in this run (Δ = +0.100, 95 % CI [+0.100, +0.100])"
    assert "paired bootstrap over 6 seeds, 10,000 resamples" in numbers
    verdict, _ = find("§5.2 (dense): GSPO clips")
    assert verdict.startswith("consistent with the claim (ratio = 52x, 95 % CI [")
    verdict, numbers = find("§5.2 (moe): GSPO trains")
    assert verdict == (
        "not distinguishable at n = 6 (Δ = +0.000, 95 % CI [+0.000, +0.000] contains the null)"
    )
    assert "6 seeds × 30 problems" in numbers
    assert find("§5.2 (moe): GSPO clips")[0] == (
        "not reproduced on this test bed (ratio = 5x, 95 % CI [5x, 5x])"
    )
    assert find("§5.3: ~10%")[0].startswith("consistent with the claim (GRPO = 11.00%")
    verdict, numbers = find("§5.3: GRPO on an MoE")  # and its collapses (> 0.10 below start)
    assert verdict == "not reproduced on this test bed (Δ = -0.050, 95 % CI [-0.050, -0.050])"
    assert "against GRPO + RR: not behind (Δ = +0.000" in numbers
    assert "below the run's start): GRPO 2/6, GRPO + RR 0/6, GSPO 0/6" in numbers


def test_an_efficiency_verdict_says_when_its_training_reward_points_the_other_way():
    """GSPO +0.1 held out on every seed but 0.01 lower training reward on every seed: the
    verdict is "consistent ... in this run" and names the secondary's interval below 0."""
    from experiments.gspo_vs_grpo import analysis

    n = 5
    s = np.linspace(0.0, 0.02, n)
    stats = {
        "dense/gspo": _stats(eval_end=0.4 + s, reward_mean=0.19 + s),
        "dense/grpo": _stats(eval_end=0.3 + s, reward_mean=0.20 + s),
    }
    _, said, _ = analysis._efficiency_verdict("dense", stats, {}, "dense/gspo", "dense/grpo")
    assert said == (
        "consistent with the claim in this run (Δ = +0.100, 95 % CI [+0.100, +0.100]); its "
        "secondary, training reward, is lower under GSPO (Δ = -0.010, 95 % CI [-0.010, -0.010])"
    )


def _fake_run(root, arm, seed, steps=4, end=0.2, start=0.1, **logged):
    from experiments.gspo_vs_grpo.arms import run_dir

    d = pathlib.Path(run_dir(str(root), arm, seed))
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": start}]
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "reward/mean": 0.1 * step,
                "policy/clipfrac": 0.01,
                "policy/clipfrac_seq": 0.02,
                "sampler/logprob_gap_mean": 1e-6,
                "policy/ratio_noise_floor": 1e-7,
                **logged,
            }
        )
    rows[-1]["eval/accuracy"] = end
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("with_noise", [False, True])
def test_results_markdown_from_its_template(tmp_path, with_noise):
    """write_results fills every placeholder of results_template.md (and the noise floor's
    section only when measured) and ends the file with one newline."""
    arms = [a for a in gspo_vs_grpo.ARMS if a.model == "dense"]
    for arm in arms:
        _fake_run(tmp_path, arm, 0)
    noise = [
        {
            "dtype": "bfloat16",
            "pi_old": "sampler",
            "max_abs_s_minus_1": 1e-2,
            "max_clipfrac_seq": 0.5,
            "sampler_gap_max": 4e-2,
        }
    ]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=4, eval_prompts=8)
    path = tmp_path / "results.md"
    gspo_vs_grpo.write_results(
        str(path), str(tmp_path), arms, [0], budget, "cmd", 60.0, noise if with_noise else [], "c"
    )
    text = path.read_text()
    assert text.startswith("# Results: GSPO vs GRPO at laptop scale\n")
    assert "$" not in text
    assert text.endswith("gap metrics.\n" if with_noise else "gspo_vs_grpo_dense.png)\n")
    assert "| GSPO (dense) | 1 | 0.100 | 0.200 |" in text
    assert ("| bfloat16 | sampler | 1.0e-02 | 50% | 4.0e-02 |" in text) == with_noise
    assert (tmp_path / "results" / "gspo_vs_grpo_dense.png").exists()


# ----------------------------------------------------------------------------- statistics


def test_mean_sd_is_the_sample_std():
    """ddof = 1: values 1, 2, 3, 4 have variance 5/3 (squared deviations 2.25 + 0.25 +
    0.25 + 2.25 = 5, over n − 1 = 3)."""
    from experiments.gspo_vs_grpo import stats

    mean, sd = stats.mean_sd([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert sd == pytest.approx(np.sqrt(5 / 3), rel=1e-12)
    assert np.isnan(stats.mean_sd([0.3])[1])


def test_bootstrap_matches_a_slow_loop_over_the_same_draws():
    """Seeds × problems: the count-matrix form equals indexing d[seeds][:, problems] and
    averaging, resample by resample, with the same index draws (seeds first)."""
    from experiments.gspo_vs_grpo import stats

    rng = np.random.default_rng(3)
    d = rng.normal(size=(4, 7))
    fast = stats.bootstrap_means(d, resamples=300, seed=5, batch=64)
    draws = np.random.default_rng(5)
    seeds = draws.integers(0, 4, size=(300, 4))
    problems = draws.integers(0, 7, size=(300, 7))
    slow = [d[seeds[r]][:, problems[r]].mean() for r in range(300)]
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=1e-15)
    fast_1d = stats.bootstrap_means(d[:, 0], resamples=300, seed=5)
    np.testing.assert_allclose(fast_1d, [d[seeds[r], 0].mean() for r in range(300)], rtol=1e-12)


def test_percentile_interval_of_a_tiny_case_enumerated_exactly():
    """Seed differences (0, 0, 3): the bootstrap mean is k over 3 draws of {0, 0, 3}, i.e.
    k ~ Binomial(3, 1/3) times 1: P(0) = 8/27, P(1) = 12/27, P(2) = 6/27, P(3) = 1/27.
    The 2.5 % point is 0 and the 97.5 % point is 3 (1 − 1/27 < 0.975 < 1); #{θ* ≤ 0} is
    ~8/27 of the resamples, so p ≈ 2 · 8/27 = 0.593."""
    from experiments.gspo_vs_grpo import stats

    iv = stats.paired_difference([1.0, 2.0, 5.0], [1.0, 2.0, 2.0], resamples=40_000)
    assert (iv.estimate, iv.low, iv.high) == (1.0, 0.0, 3.0)
    assert iv.p == pytest.approx(2 * 8 / 27, abs=0.02)
    means = stats.bootstrap_means(np.array([0.0, 0.0, 3.0]), resamples=40_000)
    freq = [np.mean(np.isclose(means, k)) for k in range(4)]
    np.testing.assert_allclose(freq, [8 / 27, 12 / 27, 6 / 27, 1 / 27], atol=0.01)


def test_a_zero_difference_gives_an_interval_around_zero_and_p_1():
    from experiments.gspo_vs_grpo import stats

    a = np.random.default_rng(0).random((5, 20)) < 0.5
    iv = stats.paired_difference(a, a)
    assert (iv.estimate, iv.low, iv.high, iv.p) == (0.0, 0.0, 0.0, 1.0)
    assert iv.design == "paired bootstrap over 5 seeds × 20 problems"
    assert stats.verdict(iv) == "not distinguishable at n = 5"


def test_a_clear_difference_is_consistent_or_not_reproduced_by_direction():
    """Every seed +0.1 ± a little: the interval excludes 0; p is the smallest possible
    (1 + 0) · 2 / (R + 1) as no resample reaches 0."""
    from experiments.gspo_vs_grpo import stats

    b = np.linspace(0.3, 0.4, 8)
    a = b + 0.1 + np.linspace(-0.01, 0.01, 8)
    iv = stats.paired_difference(a, b)
    assert 0.09 < iv.low < iv.estimate < iv.high < 0.11
    assert iv.p == pytest.approx(2 / (stats.RESAMPLES + 1))
    assert stats.verdict(iv) == "consistent with the claim"
    assert stats.verdict(iv, direction=-1) == "not reproduced on this test bed"
    assert stats.band_verdict(stats.one_sample(a), 0.3, 0.6) == "consistent with the claim"
    assert stats.band_verdict(stats.one_sample(a), 0.6, 0.9) == "not reproduced on this test bed"


def test_ratio_interval_is_the_exponentiated_log_ratio():
    """Paired by seed with the same draws: seeds (1, 2), (2, 4), (4, 8) in (a, b) give
    mean a* / mean b* = 1/2 in every resample."""
    from experiments.gspo_vs_grpo import stats

    iv = stats.paired_ratio([1.0, 2.0, 4.0], [2.0, 4.0, 8.0])
    assert iv.estimate == pytest.approx(0.5)
    assert iv.low == pytest.approx(0.5) and iv.high == pytest.approx(0.5)
    assert iv.p == pytest.approx(2 / (stats.RESAMPLES + 1))  # against ratio 1
    assert stats.paired_ratio([1.0, 2.0, 4.0], [2.0, 4.0, 8.0], null=0.5).p == 1.0
    assert stats.verdict(iv, null=1.0, direction=-1) == "consistent with the claim"
    one = stats.paired_difference([0.5], [0.1])
    assert stats.verdict(one) == stats.band_verdict(one, 0, 1) == "not testable at n = 1 (one seed)"
    # One seed resampled is that seed every time: a zero-width interval with p = 2/(R + 1)
    # would read as significant. None is given; over problems, one seed still has both.
    for iv in (one, stats.one_sample([0.3]), stats.paired_ratio([0.4], [0.1])):
        assert np.isnan(iv.low) and np.isnan(iv.high) and np.isnan(iv.p), iv
        assert stats.ci_text(iv) == "no interval or p from 1 seed"
    assert one.estimate == pytest.approx(0.4)
    by_problem = stats.paired_difference([[1.0, 0.0, 1.0, 1.0]], [[0.0, 0.0, 1.0, 0.0]])
    assert by_problem.low < by_problem.estimate == 0.5 < by_problem.high and by_problem.p < 1
    with pytest.raises(ValueError, match="positive"):
        stats.paired_ratio([0.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="equal shapes"):
        stats.paired_difference([1.0, 2.0], [1.0])


def test_per_problem_scores_saved_by_the_loop_are_read_back_in_split_order(tmp_path):
    """loop._save_per_problem writes what the evaluator appended (batches in any order);
    final_problems reads each run's last evaluation back as [seeds, problems]."""
    from experiments.gspo_vs_grpo import analysis
    from experiments.gspo_vs_grpo.arms import run_dir
    from gspo_jax.trainer import loop

    arm = gspo_vs_grpo.ARMS[-1]
    for seed in (0, 1):
        d = run_dir(str(tmp_path), arm, seed)
        loop._save_per_problem(d, 0, [(np.arange(3), np.zeros(3, np.float32))])
        batches = [(np.array([3, 4]), np.array([seed, 1.0])), (np.arange(3), np.ones(3))]
        loop._save_per_problem(d, 10, batches)
    got = analysis.final_problems(str(tmp_path), arm, [0, 1])
    np.testing.assert_array_equal(got, [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]])
    assert analysis.final_problems(str(tmp_path), arm, [0, 1, 2]) is None


@pytest.mark.parametrize("flag", ["--seeds=0", "--moe_seeds=0", "--eval_every=-1"])
def test_a_count_flag_below_1_is_refused_by_name(flag, tmp_path):
    with pytest.raises(ValueError, match=f"{flag} must be at least 1"):
        gspo_vs_grpo.main([flag, f"--workdir={tmp_path}", "--report_only"])


# ------------------------------------------------------------------------------- sweeps


def test_vary_flags_zip_value_by_value_and_bad_ones_are_named():
    from experiments.gspo_vs_grpo import sweep

    # the plot's axis: the fields whose values differ, a field held fixed left off
    held = sweep.parse_vary(["model.dtype=bfloat16,bfloat16", "rollout_correction=none,tis"])
    title, label = sweep.axis(held)
    assert (title, [label(s) for s in held]) == ("rollout_correction", ["none", "tis"])
    title, label = sweep.axis(sweep.parse_vary(["clip_low=1e-4,3e-4", "clip_high=2e-4,4e-4"]))
    assert title == "clip_low / clip_high"
    assert label((("clip_low", "1e-4"), ("clip_high", "2e-4"))) == "1e-4\n2e-4"
    got = sweep.parse_vary(["clip_low=1e-4,3e-4", "clip_high=2e-4, 4e-4"])
    assert got == [
        (("clip_low", "1e-4"), ("clip_high", "2e-4")),
        (("clip_low", "3e-4"), ("clip_high", "4e-4")),
    ]
    for bad, match in [
        (["num_mini_batches"], "expected FIELD=V1,V2"),
        (["num_mini_batches=1,,2"], "expected FIELD=V1,V2"),
        (["a=1,2", "b=1"], r"as many values \(a: 2, b: 1\)"),
        (["a=1", "a=2"], "names 'a' twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            sweep.parse_vary(bad)


def test_a_variant_sets_its_fields_and_the_arms_own_setting_is_the_arm(tmp_path):
    """Values are cast to the field's type; a setting that changes nothing keeps the arm's
    own key and run directory (shared by every sweep of the workdir)."""
    from experiments.gspo_vs_grpo import sweep
    from experiments.gspo_vs_grpo.arms import run_dir

    arm = next(a for a in gspo_vs_grpo.ARMS if a.key == "dense/gspo")
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=2, eval_prompts=8)
    settings = sweep.parse_vary(["num_mini_batches=2,4", "optim.learning_rate=3e-4,1e-4"])
    (two,), (same,) = sweep.variants([arm], settings, budget, str(tmp_path))
    assert two.key == "dense/gspo@num_mini_batches=2,optim.learning_rate=3e-4"
    assert (
        run_dir("/w", two, 1) == "/w/dense_gspo/num_mini_batches=2,optim.learning_rate=3e-4/seed1"
    )
    c = gspo_vs_grpo.arm_config(two, 0, budget, str(tmp_path))
    assert (c.num_mini_batches, c.optim.learning_rate) == (2, 3e-4)
    assert isinstance(c.num_mini_batches, int)
    assert same == arm and run_dir("/w", same, 1) == "/w/dense_gspo/seed1"
    for bad, match in [
        (
            ["no_such.field=1"],
            "dense/gspo@no_such.field=1: the config has no field 'no_such.field'",
        ),
        (["num_mini_batches=two"], r"num_mini_batches='two' does not fit the field \(4\)"),
        (["log.plot=maybe"], "not true or false"),
        (["num_mini_batches=3"], "num_mini_batches"),  # validated: 64 rows do not split in 3
    ]:
        with pytest.raises(Exception, match=match):
            sweep.variants([arm], sweep.parse_vary(bad), budget, str(tmp_path))


def test_dev_budget_trains_and_evaluates_on_disjoint_slices_of_train(tmp_path):
    arm = gspo_vs_grpo.ARMS[-1]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=2, eval_prompts=8)
    c = gspo_vs_grpo.arm_config(arm, 0, budget, str(tmp_path))
    assert (c.data.train_split, c.data.eval_split) == ("train", "test")
    dev = dataclasses.replace(budget, dev=True)
    c = gspo_vs_grpo.arm_config(arm, 0, dev, str(tmp_path))
    assert (c.data.train_split, c.data.eval_split) == ("train[500:]", "train[:500]")


def test_sweep_report_from_runs(tmp_path):
    """Per setting and arm the final accuracy with its interval over seeds, GSPO − GRPO at
    each setting, and the best setting per arm (a description on the test split)."""
    from experiments.gspo_vs_grpo import sweep

    arms = [a for a in gspo_vs_grpo.ARMS if a.model == "dense"]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=3, prompts=4, eval_every=2, eval_prompts=8)
    settings = sweep.parse_vary(["num_mini_batches=2,4"])
    rows = sweep.variants(arms, settings, budget, str(tmp_path))
    ends = {("gspo", 2): 0.5, ("grpo", 2): 0.3, ("gspo", 4): 0.2, ("grpo", 4): 0.25}
    for setting, row in zip(settings, rows):
        for arm in row:
            for seed in range(3):
                end = ends[(arm.name, int(setting[0][1]))] + 0.01 * seed
                _fake_run(tmp_path, arm, seed, end=end)
    path = tmp_path / "docs" / "sweep.md"
    cells = sweep.write_sweep(str(path), str(tmp_path), rows, settings, budget, "cmd", "Wall.")
    text = path.read_text()
    assert len(cells) == 4 and (tmp_path / "docs" / "sweep.png").exists()
    assert (
        "| num_mini_batches = 2 | GSPO (dense) | 3 | 0.100 ± 0.000 | 0.510 [0.500, 0.520] | - |"
        in text
    )
    assert (
        "| num_mini_batches = 4 | GSPO (dense) | 3 | 0.100 ± 0.000 | 0.210 [0.200, 0.220] | -0.300 [-0.300"
        in text
    )
    assert "| num_mini_batches = 2 | dense/gspo − dense/grpo | +0.200 | [+0.200, +0.200] |" in text
    assert "| num_mini_batches = 4 | dense/gspo − dense/grpo | -0.050 |" in text
    assert "| GSPO (dense) | num_mini_batches = 2 | 0.510 [0.500, 0.520] | num_mini" in text
    assert "| GRPO (dense) | num_mini_batches = 2 | 0.310" in text
    assert "a description, not a choice" in text


def test_task_and_scale_flags_set_every_arms_task_and_the_budget(tmp_path):
    """--scale=gpu: the same command sized for a GPU (explicit flags still win);
    --task=scratchpad: configs/scratchpad.py's task and model under every arm."""
    from experiments.gspo_vs_grpo import cli

    def budget(*flags):
        return cli._budget(cli._parser().parse_args(list(flags)))

    cpu, gpu = budget(), budget("--scale=gpu", "--seeds=4")
    assert (cpu.steps, cpu.seeds, cpu.independent_warm_starts) == (50, 3, False)
    assert (gpu.steps, gpu.seeds, gpu.prompts, gpu.eval_prompts) == (200, 4, 16, 500)
    assert gpu.independent_warm_starts and gpu.eval_every == 20
    pad = budget("--task=scratchpad", "--scale=gpu")
    for arm in gspo_vs_grpo.ARMS:
        c = gspo_vs_grpo.arm_config(arm, 3, pad, str(tmp_path))
        assert (c.data.name, c.data.config_name, c.response_length) == (
            "scratchpad",
            "pad4_10",
            256,
        )
        assert c.warm_start.target_accuracy == 0.3 and c.seed == 3
        assert c.num_steps == 200 and c.rollout_batch_size == 16
        assert (c.model.arch == "qwen3_moe") == (arm.model == "moe")
    c = gspo_vs_grpo.arm_config(gspo_vs_grpo.ARMS[-1], 0, budget("--task=scratchpad"), "/r")
    assert (c.data.config_name, c.model.hidden_size) == ("pad2_6", 128)
    with pytest.raises(SystemExit):
        budget("--task=countdown")


def test_a_finished_run_of_another_budget_is_refused_not_reused(tmp_path):
    """Runs are cached by directory: a finished run made with other settings (here 4 steps,
    now 5) would be reported as this budget's; the same settings are reused."""
    from experiments.gspo_vs_grpo.arms import run_dir

    arm = gspo_vs_grpo.ARMS[-1]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=2, eval_prompts=8)
    d = pathlib.Path(run_dir(str(tmp_path), arm, 0))
    d.mkdir(parents=True)
    c = gspo_vs_grpo.arm_config(arm, 0, budget, str(tmp_path), "/warm")
    (d / "config.json").write_text(c.to_json_best_effort())
    (d / "summary.json").write_text("{}")
    assert gspo_vs_grpo.run_arm(arm, 0, budget, str(tmp_path), "/warm") == {"seconds": None}
    longer = dataclasses.replace(budget, steps=5)
    with pytest.raises(ValueError, match=r"finished run of other settings \(num_steps: 4 -> 5\)"):
        gspo_vs_grpo.run_arm(arm, 0, longer, str(tmp_path), "/warm")


def test_a_sweep_reports_through_the_command_line(tmp_path):
    """`--vary ... --report_only` from finished runs: the report at --results, its plot, and
    the record of what ran kept beside the runs for the next --report_only."""
    from experiments.gspo_vs_grpo import sweep

    arms = [a for a in gspo_vs_grpo.ARMS if a.model == "dense"]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=2, prompts=4, eval_every=2, eval_prompts=8)
    settings = sweep.parse_vary(["num_mini_batches=2,4"])
    for row in sweep.variants(arms, settings, budget, str(tmp_path)):
        for arm in row:
            for seed in range(2):
                _fake_run(tmp_path, arm, seed)
    out = tmp_path / "r" / "mb.md"
    flags = ["--arms=dense/gspo,dense/grpo", "--seeds=2", "--steps=4", "--prompts=4"]
    flags += [f"--workdir={tmp_path}", f"--results={out}", "--vary=num_mini_batches=2,4"]
    got = gspo_vs_grpo.main([*flags, "--report_only"])
    assert got["cells"] == 4 and (tmp_path / "r" / "mb.png").exists()
    assert "| num_mini_batches = 4 | GRPO (dense) | 2 |" in out.read_text()
    assert json.loads((tmp_path / "sweep_mb.md.json").read_text())["invocation_s"] >= 0


def test_specialisation_measures_by_hand():
    """expert_spread: experts c·u with c = 1 and 3 sit at distance |u| from their mean 2u:
    0.5 each. The load: all tokens on one expert of 4 is entropy 0, max load 4; three
    valid tokens on three experts is log 3 / log 4 and 4/3 (the masked token not counted)."""
    from experiments.gspo_vs_grpo import specialisation

    u = np.arange(1.0, 7.0).reshape(1, 1, 2, 3)  # [M, 1, D, F]
    experts = np.concatenate([u, 3 * u], axis=1)  # [M, E=2, D, F]
    params = {
        "layers": {
            "moe": {
                "gate_proj": experts,
                "up_proj": experts,
                "down_proj": np.swapaxes(experts, -1, -2),
            }
        }
    }
    assert specialisation.expert_spread(params) == pytest.approx(0.5)
    copies = {"layers": {"moe": {k: np.concatenate([u, u], 1) for k in params["layers"]["moe"]}}}
    assert specialisation.expert_spread(copies) == 0.0

    one = specialisation.routing_measures(np.zeros((1, 1, 4, 1), int), np.ones((1, 4)), 4)
    assert one == {"load_entropy": 0.0, "max_load": 4.0}
    routing = np.arange(4).reshape(1, 1, 4, 1)
    three = specialisation.routing_measures(routing, np.array([[1, 1, 1, 0]]), 4)
    assert three["load_entropy"] == pytest.approx(np.log(3) / np.log(4))
    assert three["max_load"] == pytest.approx(4 / 3)


def test_moe_testbeds_and_their_flag(tmp_path):
    """--moe_testbed picks how the MoE arms' model is made; the specialised bed is the
    issue's (>= 16 experts, top-k >= 4, trained), the copied one docs/results_moe.md's."""
    from experiments.gspo_vs_grpo import cli

    bed = gspo_vs_grpo.MOE_TESTBEDS["specialised"]
    assert bed.num_experts >= 16 and bed.top_k >= 4 and bed.specialise_steps > 0
    args = cli._parser().parse_args(["--moe_testbed=copied", f"--workdir={tmp_path}"])
    assert cli._budget(args).moe == gspo_vs_grpo.MOE_TESTBEDS["copied"]
    assert "experts stay copies" in gspo_vs_grpo.MOE_TESTBEDS["copied"].describe()
    assert "then 3 supervised steps" in bed.describe(3)
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["--moe_testbed=random"])


def test_the_deep_moe_testbed_is_an_8_layer_model_with_load_balancing(tmp_path):
    """--moe_testbed=deep: the dense warm start (and so the dense arms) is 8 layers of MLP
    width 128, the MoE arms train with router_aux_loss_coef 0.01 (specialisation included:
    it is built from the MoE arm's config), and its warm starts live in their own
    directories, so a workdir of the 3-layer beds is never reused for it."""
    from experiments.gspo_vs_grpo import cli, run

    args = cli._parser().parse_args(["--moe_testbed=deep", f"--workdir={tmp_path}"])
    budget = cli._budget(args)
    dense, moe = (next(a for a in gspo_vs_grpo.ARMS if a.model == m) for m in ("dense", "moe"))
    warm = run.arm_config(dense, 0, budget, str(tmp_path))
    assert (warm.model.num_layers, warm.model.intermediate_size) == (8, 128)
    rl = run.arm_config(moe, 0, budget, str(tmp_path), warm=str(tmp_path / "hf"))
    assert rl.model.router_aux_loss_coef == 0.01
    assert rl.model.hf_path == str(tmp_path / "hf")
    root = str(tmp_path)
    assert run.warm_start_dir("dense", budget, root, 3).endswith("warm_start_dense_deep_seed3")
    assert run.warm_start_dir("moe", budget, root, 3).endswith("warm_start_moe_deep_seed3")
    described = budget.moe.describe()
    assert "(the dense warm start's num_layers 8, intermediate_size 128)" in described
    assert "a load-balancing loss (0.01)" in described
    default = cli._budget(cli._parser().parse_args([f"--workdir={tmp_path}"]))
    assert run.arm_config(dense, 0, default, root).model.num_layers == 3  # unchanged
    assert run.arm_config(moe, 0, default, root, warm=root).model.router_aux_loss_coef == 0
    assert run.warm_start_dir("moe", default, root, 3).endswith("warm_start_moe_specialised_seed3")
    assert run.warm_start_dir("dense", default, root, 3).endswith("warm_start_dense_seed3")


def test_a_moe_sweep_reports_expert_change_and_collapses(tmp_path):
    """MoE cells: the expert change after 1 update with its interval over seeds, after 3,
    and the runs whose final accuracy fell more than 0.10 below their start."""
    from experiments.gspo_vs_grpo import sweep

    arms = [a for a in gspo_vs_grpo.ARMS if a.key == "moe/grpo"]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=2, prompts=4, eval_every=2, eval_prompts=8)
    settings = sweep.parse_vary(["optim.learning_rate=1e-4,1e-2"])
    rows = sweep.variants(arms, settings, budget, str(tmp_path))
    for setting, row in zip(settings, rows):
        high = float(setting[0][1]) > 1e-3
        for seed in range(2):
            change = {"updates/expert_change/1": 0.1 if high else 0.002 + 0.002 * seed}
            change["updates/expert_change/3"] = 3 * change["updates/expert_change/1"]
            end = 0.05 if high and seed == 0 else 0.2  # 0.25 below its start: a collapse
            _fake_run(tmp_path, row[0], seed, end=end, start=0.3 if high else 0.1, **change)
    path = tmp_path / "sweep.md"
    sweep.write_sweep(str(path), str(tmp_path), rows, settings, budget, "cmd", "Wall.")
    text = path.read_text()
    assert (
        "| optim.learning_rate = 1e-4 | GRPO (MoE) | 2 | 0.30% [0.20%, 0.40%] | 0.90% ± 0.42% | 0/2 |"
        in text
    )
    assert "| optim.learning_rate = 1e-2 | GRPO (MoE) | 2 | 10.00% [10.00%, 10.00%] |" in text
    assert "| 10.00% [10.00%, 10.00%] | 30.00% ± 0.00% | 1/2 |" in text


def test_specialise_trains_the_upcycled_moe_and_measures_it(tmp_path, monkeypatch):
    """The specialised bed's second half on the default task's warm-start fixture:
    supervised steps of the upcycled MoE (3 under --quick) move its weights, the export
    keeps 16 experts top-4, and the measures before and after are written beside it."""
    from experiments.gspo_vs_grpo import run

    bed = gspo_vs_grpo.MOE_TESTBEDS["specialised"]
    up = gspo_vs_grpo.upcycle(
        "tests/fixtures/models/default_warm_start",
        str(tmp_path / "up"),
        num_experts=bed.num_experts,
        top_k=bed.top_k,
        noise=bed.noise,
    )
    budget = gspo_vs_grpo.Budget(
        steps=1, seeds=1, prompts=8, eval_every=0, eval_prompts=8, quick=True
    )
    config_of = run.arm_config

    def over_8_devices(*args, **kwargs):  # the tests' 8 CPU devices: 8-row micro-batches
        c = config_of(*args, **kwargs)
        c.micro_batch_size = 8
        return c

    monkeypatch.setattr(run, "arm_config", over_8_devices)
    hf = str(tmp_path / "warm_start_moe_specialised" / "hf")
    measures = run.specialise(up, hf, budget, str(tmp_path), seed=0)
    assert measures["steps"] == 3
    with open(tmp_path / "warm_start_moe_specialised" / run.SPECIALISATION) as f:
        assert json.load(f) == measures
    for when in ("before", "after"):
        m = measures[when]
        assert 0.0 < m["load_entropy"] <= 1.0 and 1.0 <= m["max_load"] <= bed.num_experts
    assert measures["before"]["expert_spread"] == pytest.approx(bed.noise, rel=0.2)
    assert measures["after"]["expert_spread"] != measures["before"]["expert_spread"]
    cfg, params = models.load_pretrained(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (bed.num_experts, bed.top_k)
    _, before = models.load_pretrained(up)
    moved = np.max(
        np.abs(
            params["layers"]["moe"]["router"]["kernel"]
            - before["layers"]["moe"]["router"]["kernel"]
        )
    )
    assert moved > 0


def test_the_gspo_family_arms_are_their_presets_and_run_only_when_named(tmp_path):
    """dense/ and moe/ sapo, cispo, gmpo, luspo, dppo: each its configs/<name>.py (the MoE
    ones on configs/moe_tiny.py's model) under the experiment's budget; the default arm set
    stays GSPO vs GRPO."""
    from experiments.gspo_vs_grpo import cli
    from gspo_jax.config.validate import validate

    keys = {a.key for a in gspo_vs_grpo.FAMILY_ARMS}
    assert keys == {f"{m}/{n}" for m in ("dense", "moe") for n in gspo_vs_grpo.arms.FAMILY}
    assert not keys & {a.key for a in gspo_vs_grpo.ARMS}
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=2, eval_prompts=8)
    modes = {"sapo": "sapo", "cispo": "cispo", "gmpo": "gmpo", "luspo": "clip", "dppo": "dppo_tv"}
    for arm in gspo_vs_grpo.FAMILY_ARMS:
        c = gspo_vs_grpo.arm_config(arm, 0, budget, str(tmp_path))
        assert c.loss_mode == modes[arm.name], arm.key
        assert (c.model.arch == "qwen3_moe") == (arm.model == "moe"), arm.key
        validate(c, num_devices=1)
    with pytest.raises(ValueError, match=r"unknown arm\(s\) \[.dense/ppo.\]; the arms are"):
        cli.main(["--arms=dense/ppo", f"--workdir={tmp_path}"])


def test_a_family_arm_gets_a_row_in_the_results(tmp_path):
    """--arms=dense/gspo,dense/sapo,dense/grpo: the SAPO arm's runs are read back and
    reported beside GSPO's and GRPO's (same table, plot and paired statistics)."""
    keys = ("dense/gspo", "dense/sapo", "dense/grpo")
    arms = [a for a in gspo_vs_grpo.ALL_ARMS if a.key in keys]
    for arm in arms:
        _fake_run(tmp_path, arm, 0)
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=4, eval_prompts=8)
    path = tmp_path / "results.md"
    gspo_vs_grpo.write_results(str(path), str(tmp_path), arms, [0], budget, "cmd", 60.0, [], "c")
    text = path.read_text()
    assert "| SAPO (dense) | 1 | 0.100 | 0.200 |" in text and "$" not in text
