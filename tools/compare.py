"""Put runs side by side: one PNG of their curves and a markdown table of where they ended.

    python -m tools.compare workdirs/default workdirs/grpo
    python -m tools.compare gspo=/tmp/e/gspo_s0,/tmp/e/gspo_s1 grpo=/tmp/e/grpo_s0,/tmp/e/grpo_s1 \\
        --out=compare.png

Each argument is a run's workdir (labelled by its folder name) or `LABEL=DIR[,DIR...]`: the
workdirs of one label are seeds of the same arm, drawn as their mean with a 95 % t interval
(a band) where there are two or more. The PNG has four panels, each against the RL step:
held-out accuracy (`eval/accuracy`), training reward (`reward/mean`), the clipped fractions
(`policy/clipfrac` of tokens, solid, and `policy/clipfrac_seq` of sequences, dashed, with
markers so that neither hides the other) and the approximate KL to π_old
(`policy/approx_kl`); the training panels are trailing moving averages over `--smooth`
steps (10; 1 plots every step). The table (stdout, and `--table=FILE`) gives per label the held-out
accuracy at the first and last evaluation and the best one, the mean training reward and
clipped fraction, and, against the first label, the paired difference of final held-out
accuracy with its 95 % bootstrap interval where every run saved per-problem scores
(`eval.save_per_problem`) for the same problems: the seeds are paired by position and the
problems by index, as `experiments/gspo_vs_grpo` pairs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.gspo_vs_grpo import stats
from gspo_jax.trainer.io.writers import read_metrics

PANELS = (
    ("held-out accuracy (greedy)", ("eval/accuracy",)),
    ("training reward", ("reward/mean",)),
    (
        "clipped fraction (tokens solid, sequences dashed)",
        ("policy/clipfrac", "policy/clipfrac_seq"),
    ),
    ("approx. KL(π_old ‖ π_θ)", ("policy/approx_kl",)),
)
# t quantiles (two-sided 95 %) for n - 1 degrees of freedom, n = 2..30; 1.96 beyond.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)
_T95 += (2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064)
_T95 += (2.060, 2.056, 2.052, 2.048, 2.045)


@dataclasses.dataclass
class Arm:
    """One label: its workdirs (seeds) and each one's metrics rows."""

    label: str
    workdirs: list[str]
    rows: list[list[dict]]


def parse_arms(args: list[str]) -> list[Arm]:
    arms: dict[str, list[str]] = {}
    for arg in args:
        label, _, dirs = arg.rpartition("=") if "=" in arg else ("", "", arg)
        dirs_list = [d for d in dirs.split(",") if d]
        label = label or os.path.basename(os.path.normpath(dirs_list[0]))
        arms.setdefault(label, []).extend(dirs_list)
    out = []
    for label, dirs in arms.items():
        rows = []
        for d in dirs:
            path = os.path.join(d, "metrics.jsonl")
            if not os.path.isfile(path):
                raise SystemExit(f"tools.compare: {path} does not exist (is {d} a run's workdir?)")
            rows.append(read_metrics(path))
        out.append(Arm(label, dirs, rows))
    return out


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` over one run's rows, steps where it was logged."""
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pts)
    return np.asarray(steps, float), np.asarray(values, float)


def mean_band(arm: Arm, key: str, window: int = 1):
    """(steps, mean, half-width of the 95 % t interval or None) over the arm's seeds, at the
    steps every seed logged, each seed's series first smoothed over `window` steps."""
    per_seed = [dict(zip(*series(rows, key))) for rows in arm.rows]
    common = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    if not common:
        return np.zeros(0), np.zeros(0), None
    values = np.asarray([smooth(np.asarray([s[t] for t in common]), window) for s in per_seed])
    mean = values.mean(axis=0)
    n = values.shape[0]
    if n < 2:
        return np.asarray(common), mean, None
    t = _T95[n - 2] if n - 2 < len(_T95) else 1.96
    return np.asarray(common), mean, t * values.std(axis=0, ddof=1) / math.sqrt(n)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """A trailing moving average over `window` logged points (1: the values themselves)."""
    if window <= 1 or len(values) < 2:
        return values
    cums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (cums[idx] - cums[lo]) / (idx - lo)


def plot(arms: list[Arm], out: str, window: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for i, arm in enumerate(arms):
            color = f"C{i}"
            for j, key in enumerate(keys):
                training = not key.startswith("eval/")  # per-step metrics: smoothed per seed
                steps, mean, half = mean_band(arm, key, window if training else 1)
                if not len(steps):
                    continue
                n = len(arm.workdirs)
                name = f"{arm.label} (n={n})" if j == 0 else None
                style = "-" if j == 0 else "--"
                marker = None if len(steps) > 40 else ("o" if j == 0 else "s")
                ax.plot(steps, mean, style, color=color, label=name, marker=marker, ms=3)
                if half is not None:
                    ax.fill_between(steps, mean - half, mean + half, color=color, alpha=0.2)
        training = not keys[0].startswith("eval/")
        ax.set_title(
            title + (f", {window}-step mean" if training and window > 1 else ""), fontsize=10
        )
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("runs compared (band: 95 % t interval over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def final_scores(workdir: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(problem index, score) of the run's last saved per-problem evaluation, or None."""
    d = os.path.join(workdir, "eval_problems")
    files = sorted(os.listdir(d)) if os.path.isdir(d) else []
    if not files:
        return None
    last = max(int(f[len("step") :].split("_")[0]) for f in files)
    parts = [np.load(os.path.join(d, f)) for f in files if f.startswith(f"step{last}_")]
    index = np.concatenate([p["index"] for p in parts])
    score = np.concatenate([p["score"] for p in parts])
    order = np.argsort(index)
    return index[order], score[order]


def paired_delta(arm: Arm, base: Arm) -> str:
    """The paired bootstrap interval of final held-out accuracy, arm − base, or why none."""
    if len(arm.workdirs) != len(base.workdirs):
        return f"not paired: {len(arm.workdirs)} vs {len(base.workdirs)} seeds"
    a, b = [final_scores(d) for d in arm.workdirs], [final_scores(d) for d in base.workdirs]
    if any(x is None for x in a + b):
        return "no per-problem scores (eval.save_per_problem)"
    if any(not np.array_equal(x[0], a[0][0]) for x in a + b):
        return "not paired: the runs evaluated different problems"
    iv = stats.paired_difference(np.stack([x[1] for x in a]), np.stack([x[1] for x in b]))
    return f"{iv.estimate:+.3f} ({stats.ci_text(iv)}, {iv.design})"


def table(arms: list[Arm]) -> str:
    head = (
        "| run | seeds | held-out start | held-out end | best | mean reward | mean clipfrac "
        f"| Δ final vs {arms[0].label} |\n|---|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for arm in arms:
        ends, starts, bests = [], [], []
        for rows in arm.rows:
            _, acc = series(rows, "eval/accuracy")
            if len(acc):
                starts.append(acc[0])
                ends.append(acc[-1])
                bests.append(acc.max())
        rewards = [np.mean(v) for _, v in (series(r, "reward/mean") for r in arm.rows) if len(v)]
        clips = [np.mean(v) for _, v in (series(r, "policy/clipfrac") for r in arm.rows) if len(v)]

        def fmt(x):
            return f"{np.mean(x):.3f}" if len(x) else "-"

        delta = "(reference)" if arm is arms[0] else paired_delta(arm, arms[0])
        lines.append(
            f"| {arm.label} | {len(arm.workdirs)} | {fmt(starts)} | {fmt(ends)} | {fmt(bests)} "
            f"| {fmt(rewards)} | {fmt(clips)} | {delta} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="WORKDIR or LABEL=WORKDIR[,WORKDIR...]")
    parser.add_argument("--out", default="compare.png", help="the PNG to write")
    parser.add_argument("--table", default=None, help="also write the markdown table here")
    parser.add_argument(
        "--smooth", type=int, default=10, help="moving-average window of the training panels"
    )
    args = parser.parse_args(argv)
    arms = parse_arms(args.runs)
    plot(arms, args.out, args.smooth)
    text = table(arms)
    print(text, end="")
    print(f"wrote {args.out}")
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
