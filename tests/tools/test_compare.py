"""tools/compare.py: runs side by side (the PNG, the table, the paired Δ)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from experiments.gspo_vs_grpo import stats
from tools import compare

ROOT = Path(__file__).resolve().parents[2]


def _run(workdir: Path, accuracies, rewards, scores=None) -> str:
    workdir.mkdir(parents=True)
    rows = []
    for step, acc in enumerate(accuracies):
        row = {"step": step * 2, "eval/accuracy": acc}
        if step:
            row |= {"reward/mean": rewards[step - 1], "policy/clipfrac": 0.1 * step}
            row |= {"policy/clipfrac_seq": 0.2, "policy/approx_kl": 1e-3}
        rows.append(row)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if scores is not None:
        (workdir / "eval_problems").mkdir()
        index = np.arange(len(scores))[::-1]  # saved out of order: paired by index
        np.savez(
            workdir / "eval_problems" / f"step{(len(accuracies) - 1) * 2}_p0.npz",
            index=index,
            score=np.asarray(scores, np.float32)[index],
        )
    return str(workdir)


def test_two_labels_with_seeds_give_a_table_a_paired_delta_and_a_plot(tmp_path):
    rng = np.random.default_rng(0)
    a_scores = rng.integers(0, 2, (3, 50)).astype(float)
    b_scores = rng.integers(0, 2, (3, 50)).astype(float)
    a = [
        _run(tmp_path / f"a{s}", [0.3, 0.4, 0.5 + s / 100], [0.2, 0.3], a_scores[s])
        for s in range(3)
    ]
    b = [_run(tmp_path / f"b{s}", [0.3, 0.35, 0.4], [0.1, 0.2], b_scores[s]) for s in range(3)]
    out, table = tmp_path / "c.png", tmp_path / "c.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.compare",
            f"gspo={','.join(a)}",
            f"grpo={','.join(b)}",
            f"--out={out}",
            f"--table={table}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 20_000
    lines = table.read_text().splitlines()
    gspo, grpo = lines[2].split("|"), lines[3].split("|")
    assert gspo[1].strip() == "gspo" and gspo[2].strip() == "3"
    assert float(gspo[3]) == 0.3 and float(gspo[4]) == round(np.mean([0.5, 0.51, 0.52]), 3)
    assert float(grpo[6]) == 0.15  # mean reward over steps, then seeds
    want = stats.paired_difference(b_scores, a_scores)
    assert grpo[8].strip().startswith(f"{want.estimate:+.3f} (95 % CI [{want.low:+.3f}")
    assert "3 seeds × 50 problems" in grpo[8]


def test_runs_without_per_problem_scores_or_with_other_seed_counts_say_why(tmp_path):
    a = compare.parse_arms([_run(tmp_path / "a", [0.1, 0.2], [0.1])])
    b = compare.parse_arms(
        [f"b={_run(tmp_path / 'b0', [0.1, 0.3], [0.1])},{_run(tmp_path / 'b1', [0.1, 0.3], [0.2])}"]
    )
    text = compare.table(a + b)
    assert "not paired: 2 vs 1 seeds" in text
    c = compare.parse_arms([_run(tmp_path / "c", [0.1, 0.2], [0.1])])
    assert "no per-problem scores" in compare.table(a + c)


def test_the_band_is_a_t_interval_over_seeds_at_the_common_steps():
    arm = compare.Arm(
        "x",
        ["s0", "s1"],
        [
            [{"step": 0, "eval/accuracy": 0.2}, {"step": 2, "eval/accuracy": 0.4}],
            [{"step": 0, "eval/accuracy": 0.4}, {"step": 4, "eval/accuracy": 0.9}],
        ],
    )
    steps, mean, half = compare.mean_band(arm, "eval/accuracy")
    assert steps.tolist() == [0] and mean.tolist() == [0.30000000000000004]
    assert np.isclose(half[0], 12.706 * np.std([0.2, 0.4], ddof=1) / np.sqrt(2))


def test_a_missing_workdir_is_named(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.compare", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert (
        proc.returncode != 0 and f"{tmp_path / 'nope'}/metrics.jsonl does not exist" in proc.stderr
    )


def test_smoothing_is_a_trailing_mean():
    assert compare.smooth(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    assert compare.smooth(np.array([1.0, 3.0]), 1).tolist() == [1.0, 3.0]
