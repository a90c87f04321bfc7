"""Issue 43: the pre-registered §5.2 mechanism test's statistics and plumbing
(experiments/gspo_vs_grpo/mechanism.py): power of the t test, the seeds it needs, the sd a
published interval implies, the committed pilot file, the interaction on fake runs."""

import json
import os

import numpy as np
import pytest

from experiments.gspo_vs_grpo import mechanism, mechanism_power
from experiments.gspo_vs_grpo.arms import run_dir


def test_power_at_no_effect_is_the_tests_size():
    """With Δ = 0 the noncentral t is the central one: P(|T| > t_{1-α/2}) = α exactly."""
    for n in (3, 10, 40):
        assert mechanism_power.power(n, 0.01, delta=0.0, alpha=0.05) == pytest.approx(
            0.05, abs=1e-9
        )


def test_power_matches_a_monte_carlo_t_test():
    """n = 8, sd 1, Δ = 1, α = 0.025: the share of 200,000 simulated two-sided t tests that
    reject agrees with the noncentral-t power to Monte Carlo error (~0.001)."""
    from scipy import stats as st

    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, size=(200_000, 8))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(8))
    rejected = np.mean(np.abs(t) > st.t.ppf(1 - 0.0125, 7))
    assert mechanism_power.power(8, 1.0, delta=1.0, alpha=0.025) == pytest.approx(
        rejected, abs=0.004
    )


def test_seeds_needed_is_the_smallest_n_with_the_power():
    n = mechanism_power.seeds_needed(0.01, 0.01)
    assert (
        mechanism_power.power(n, 0.01, 0.01)
        >= mechanism_power.POWER
        > mechanism_power.power(n - 1, 0.01, 0.01)
    )
    assert mechanism_power.seeds_needed(1.0, 0.001, cap=50) == 51  # none up to the cap


def test_sd_from_interval_inverts_the_bootstraps_half_width():
    """sd 0.01 at n = 10: half-width 1.96 · 0.01 · sqrt(9/10) / sqrt(10)."""
    z, n = mechanism_power.forest.Z975, 10
    half = z * 0.01 * np.sqrt((n - 1) / n) / np.sqrt(n)
    assert mechanism_power.sd_from_interval(-half, half, n) == pytest.approx(0.01)


def test_pilot_sd_reads_the_committed_file():
    """Recomputed here from the CSV with plain Python: per seed, the mean reward of each
    arm over its steps; the sd (ddof 1) of GSPO − GRPO over the 4 seeds."""
    sums = {}
    with open(mechanism_power.PILOT) as f:
        next(f)
        for line in f:
            algo, seed, _, reward = line.strip().split(",")
            sums.setdefault((algo, int(seed)), []).append(float(reward))
    d = [np.mean(sums["gspo", s]) - np.mean(sums["grpo", s]) for s in range(4)]
    sd, n = mechanism_power.pilot_sd()
    assert n == 4 and sd == pytest.approx(np.std(d, ddof=1))


def _fake(root, algo, mb, lr, seed, rewards):
    d = run_dir(str(root), mechanism.arm(algo, mb, lr), seed)
    os.makedirs(d)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(
            json.dumps({"step": step, "reward/mean": r}) + "\n" for step, r in enumerate(rewards, 1)
        )


def test_interaction_is_the_difference_of_differences_of_areas(tmp_path):
    """Seed 0: areas GSPO/GRPO at mb 8 = 0.5/0.3, at mb 1 = 0.2/0.2 -> I = 0.2;
    seed 1: 0.4/0.4 and 0.1/0.2 -> I = 0.1."""
    areas = {(0, "gspo", 8): 0.5, (0, "grpo", 8): 0.3, (0, "gspo", 1): 0.2, (0, "grpo", 1): 0.2}
    areas |= {(1, "gspo", 8): 0.4, (1, "grpo", 8): 0.4, (1, "gspo", 1): 0.1, (1, "grpo", 1): 0.2}
    for (seed, algo, mb), a in areas.items():
        _fake(tmp_path, algo, mb, 3e-5, seed, [a - 0.05, a + 0.05])  # mean a
    np.testing.assert_allclose(mechanism.interaction(str(tmp_path), 3e-5, [0, 1]), [0.2, 0.1])


def test_a_missing_stage_0_names_its_command(tmp_path):
    with pytest.raises(ValueError, match="--stage=dev"):
        mechanism.read_choice(str(tmp_path))
    with pytest.raises(ValueError, match="--lengths='mid'"):
        mechanism.main(["--lengths=mid"])
    with pytest.raises(ValueError, match="never publishes"):
        mechanism.main(["--smoke", "--publish"])


def test_the_short_length_alone_needs_no_stage_0(tmp_path, capsys):
    """--lengths=short runs (here: the variance-only look) without <workdir>/dev/choice.json;
    I = 0.2 and 0.1 as above, so sd = 0.0707."""
    root = mechanism.root_of(str(tmp_path), "short")
    areas = {(0, "gspo", 8): 0.5, (0, "grpo", 8): 0.3, (0, "gspo", 1): 0.2, (0, "grpo", 1): 0.2}
    areas |= {(1, "gspo", 8): 0.4, (1, "grpo", 8): 0.4, (1, "gspo", 1): 0.1, (1, "grpo", 1): 0.2}
    for (seed, algo, mb), a in areas.items():
        _fake(root, algo, mb, mechanism.SHORT_LR, seed, [a])
    mechanism.main(["--lengths=short", "--sd_only", "--seeds=2", f"--workdir={tmp_path}"])
    assert "short: sd of I over 2 seeds = 0.0707" in capsys.readouterr().out
    assert mechanism._long_meta({}, ["short"], False) == "long: not run (below)."


def test_seeds_are_one_count_or_one_per_length():
    assert mechanism.seeds_of(None, ["short", "long"], "cpu") == {"short": 10, "long": 10}
    assert mechanism.seeds_of("12", ["short"], "cpu") == {"short": 12}
    got = mechanism.seeds_of("short:10,long:16", ["short", "long"], "gpu")
    assert got == {"short": 10, "long": 16}
    assert mechanism.seeds_of("long:16", ["short", "long"], "gpu") == {"short": 20, "long": 16}
    assert mechanism.seeds_of("7", ["long"], "cpu", smoke=True) == {"long": 1}
    for bad in ("0", "mid:3", "short:x", "short:0"):
        with pytest.raises(ValueError, match="--seeds="):
            mechanism.seeds_of(bad, ["short"], "cpu")


def test_welch_matches_scipy():
    from scipy import stats as st

    rng = np.random.default_rng(1)
    x, y = rng.normal(0.02, 0.01, 7), rng.normal(0.0, 0.03, 11)
    d, lo, hi = mechanism.welch(x, y)
    ref = st.ttest_ind(x, y, equal_var=False).confidence_interval(0.95)
    assert d == pytest.approx(x.mean() - y.mean())
    assert (lo, hi) == pytest.approx((ref.low, ref.high), rel=1e-10)


def test_the_primary_verdict_needs_the_interval_above_0_and_holm():
    from experiments.gspo_vs_grpo import stats

    above = stats.Interval(0.03, 0.01, 0.05, 0.03, 10)
    assert mechanism.verdict(above, 0.03) == "consistent with §5.2's mechanism"
    assert mechanism.verdict(above, 0.06) == (
        "not distinguishable at n = 10 after Holm's adjustment"
    )
    below = stats.Interval(-0.03, -0.05, -0.01, 0.01, 10)
    assert mechanism.verdict(below, 0.02) == "not reproduced on this test bed"
    assert mechanism.verdict(stats.undefined(0.1, 1), float("nan")) == "no verdict at n = 1"


def test_a_length_not_run_counts_as_p_1_in_holm_and_gets_no_verdict():
    from experiments.gspo_vs_grpo import stats

    inter = np.array([0.01, 0.02, -0.005, 0.03])
    boot = stats.one_sample(inter)
    one = {"n": 4, "I": inter, "boot": boot, "t": None, "control": boot, "secondary": []}
    one["clip8"] = {"gspo": (0.2, 0.1), "grpo": (0.004, 0.001)}
    text = mechanism.report({"short": one}, "cmd", "meta")
    assert f"| {boot.p:.3g} | {2 * boot.p:.3g} |" in text  # Holm over two: 2p
    assert "Not run in this invocation: the long length, so no verdict" in text
    assert "GRPO above 0.35 % as at mb 4 on the default task: reached" in text  # 0.4 %
    one["clip8"]["grpo"] = (0.0022, 0.0002)
    text = mechanism.report({"short": one}, "cmd", "meta")
    assert "GRPO above 0.35 % as at mb 4 on the default task: not reached" in text


def test_publish_exports_the_curves_and_the_per_problem_scores(tmp_path):
    """The CSV holds every (cell, seed, step)'s reward; the copied scores read back through
    forest.per_problem_scores unchanged; compute_line sums seconds.json's phases."""
    from experiments.gspo_vs_grpo import forest, mechanism_files

    root, cells = tmp_path / "runs", mechanism._cells(3e-5)
    for (algo, mb), a in cells.items():
        _fake(root, algo, mb, 3e-5, 0, [0.25, 0.5])
        d = os.path.join(run_dir(str(root), a, 0), "eval_problems")
        os.makedirs(d)
        np.savez(os.path.join(d, "step2_p0.npz"), index=np.array([1, 0]), score=[mb, 0.0])
    with open(root / "seconds.json", "w") as f:
        json.dump({"warm_start/dense/seed0": 60.0, "run/a": 30.0, "run/b": 90.0}, f)
    out = tmp_path / "out"
    text = mechanism_files.publish({"short": str(root)}, {"short": cells}, {"short": [0]}, str(out))
    assert "docs/mechanism/short_test_rewards.csv" in text
    with open(out / "docs/mechanism/short_test_rewards.csv") as f:
        rows = f.read().splitlines()
    assert rows[0] == "algo,mb,seed,step,reward,clipfrac" and len(rows) == 1 + 4 * 2
    assert rows[-1].startswith("grpo,8,0,2,0.5,")
    base = out / "docs/forest/per_problem/mechanism_short"
    np.testing.assert_array_equal(forest.per_problem_scores(str(base), "gspo_mb8", 2), [[0, 8]])
    line = mechanism_files.compute_line({"short": str(root)})
    assert "short: 1 warm starts 1.0 min, 2 RL runs 2.0 min" in line


def test_the_long_lengths_sapo_cell_is_compared_with_both_arms_at_mb_8(tmp_path):
    """Areas at mb 8: SAPO 0.6/0.5, GSPO 0.5/0.4, GRPO 0.3/0.4 (seeds 0/1) -> SAPO − GRPO
    = +0.3/+0.1 (mean +0.2), SAPO − GSPO = +0.1/+0.1; held-out scores at step 2: SAPO
    solves both problems, the others one -> +0.5 against each."""
    areas = {("sapo", 8): (0.6, 0.5), ("gspo", 8): (0.5, 0.4), ("grpo", 8): (0.3, 0.4)}
    areas |= {("gspo", 1): (0.2, 0.1), ("grpo", 1): (0.2, 0.2)}
    for (algo, mb), per_seed in areas.items():
        for seed, a in enumerate(per_seed):
            _fake(tmp_path, algo, mb, 1e-4, seed, [a])
            d = os.path.join(
                run_dir(str(tmp_path), mechanism.arm(algo, mb, 1e-4), seed), "eval_problems"
            )
            os.makedirs(d)
            score = [1.0, 1.0] if algo == "sapo" else [1.0, 0.0]
            np.savez(os.path.join(d, "step2_p0.npz"), index=np.array([0, 1]), score=score)
    assert mechanism.EXTRA["long"] == (("sapo", 8),) and mechanism.EXTRA["short"] == ()
    out = mechanism.analyse(str(tmp_path), 1e-4, [0, 1], mechanism.EXTRA["long"])
    (e,) = out["extra"]
    assert e["grpo"][0].estimate == pytest.approx(0.2)
    assert e["gspo"][0].estimate == pytest.approx(0.1)
    assert e["grpo"][1].estimate == pytest.approx(0.5) and e["step"] == 2
    text = "\n".join(mechanism._extra_lines({"long": out}, ["long"]))
    assert "long, SAPO at mb 8" in text and "SAPO − GRPO: area +0.2000" in text
    assert set(mechanism._cells(1e-4, "long")) == set(areas)


def test_shared_seeds_run_once_each_and_wait_for_the_others(tmp_path, monkeypatch):
    """--share_seeds: a seed another process claimed is skipped here, and run_cells returns
    only once that seed's runs are finished; a claim is exclusive."""
    from experiments.gspo_vs_grpo import run

    ran = []

    def fake_run(a, seed, b, root, warm):
        ran.append((a.name, a.overrides[0][1], seed))
        d = run_dir(root, a, seed)
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, "summary.json"), "w").close()

    monkeypatch.setattr(run, "run_arm", fake_run)
    monkeypatch.setattr(run, "warm_start", lambda *a: "warm")
    root = mechanism.root_of(str(tmp_path), "long")
    assert mechanism.claim(root, 0) and not mechanism.claim(root, 0)  # "another process"
    polls = []

    def other_process_finishes(_):  # the claimant of seed 0 finishes while we wait
        polls.append(1)
        for g, m in [(g, m) for g in mechanism.ALGOS for m in (1, 8)] + [("sapo", 8)]:
            fake_run(mechanism.arm(g, m, 3e-5), 0, None, root, None)

    monkeypatch.setattr("time.sleep", other_process_finishes)
    mechanism.run_cells(str(tmp_path), "long", "cpu", [0, 1], [3e-5], (1, 8), share=True)
    mine = [r for r in ran if r[2] == 1]
    assert len(mine) == 5 and len(polls) == 1  # seed 1's four cells and SAPO; one wait
    assert ("sapo", 8, 1) in mine and os.path.exists(os.path.join(root, "claims", "seed1"))
