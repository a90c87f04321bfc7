"""The files the §5.2 mechanism test's published numbers rest on, copied out of its
workdir by `python -m experiments.gspo_vs_grpo.mechanism --publish` (they are KB each):

- docs/mechanism/<length>_test_rewards.csv: every run's per-step training reward
  (`reward/mean`, the primary's areas) and binding clipped-token fraction
  (`policy/clipfrac`), one row per (algo, mb, seed, step);
- docs/forest/per_problem/mechanism_<length>/<algo>_mb<mb>/seed<k>/step<S>_p0.npz: the
  held-out greedy score of every problem at every evaluation, the arrays `index` and
  `score` exactly as the run saved them (`eval.save_per_problem`), compressed; the layout
  experiments/gspo_vs_grpo/forest.py reads.

`compute_line` reads back each length's timed phases (`<root>/seconds.json`) for the
results file's compute line.
"""

from __future__ import annotations

import csv
import json
import os

import numpy as np

from experiments.gspo_vs_grpo.analysis import series
from experiments.gspo_vs_grpo.arms import run_dir

CURVES = os.path.join("docs", "mechanism", "{length}_test_rewards.csv")
PER_PROBLEM = os.path.join("docs", "forest", "per_problem", "mechanism_{length}")


def arm_name(algo: str, mb: int) -> str:
    """The per-problem folder of one cell: gspo_mb8, grpo_mb1, ..."""
    return f"{algo}_mb{mb}"


def export(root: str, length: str, cells: dict, seeds, out: str = ".") -> list[str]:
    """Write the two kinds of files for one length; `cells` maps (algo, mb) -> Arm. Returns
    the paths written (relative to `out`)."""
    written = []
    curves = CURVES.format(length=length)
    os.makedirs(os.path.join(out, os.path.dirname(curves)), exist_ok=True)
    with open(os.path.join(out, curves), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["algo", "mb", "seed", "step", "reward", "clipfrac"])
        for (algo, mb), a in cells.items():
            for s in seeds:
                steps, reward = series(run_dir(root, a, s), "reward/mean")
                clip = dict(zip(*series(run_dir(root, a, s), "policy/clipfrac")))
                for t, r in zip(steps.tolist(), reward.tolist()):
                    w.writerow([algo, mb, s, t, repr(r), repr(clip.get(t, float("nan")))])
    written.append(curves)
    base = PER_PROBLEM.format(length=length)
    for (algo, mb), a in cells.items():
        for s in seeds:
            src = os.path.join(run_dir(root, a, s), "eval_problems")
            dst = os.path.join(out, base, arm_name(algo, mb), f"seed{s}")
            os.makedirs(dst, exist_ok=True)
            for name in sorted(os.listdir(src)):
                with np.load(os.path.join(src, name)) as z:
                    np.savez_compressed(os.path.join(dst, name), index=z["index"], score=z["score"])
    written.append(base)
    return written


def publish(roots: dict, cells: dict, seeds, out: str = ".") -> str:
    """Export every length's files (roots, cells, seeds: length -> its root, its (algo, mb)
    -> Arm, its seeds) into docs/ and say where they are, for the results file."""
    paths = [p for k, root in roots.items() for p in export(root, k, cells[k], seeds[k], out)]
    return (
        "The files these numbers rest on (experiments/gspo_vs_grpo/mechanism_files.py): "
        + ", ".join(f"`{p}`" for p in paths)
        + " (per-step training reward and clipped fraction of every run; every held-out "
        "problem's greedy score at every evaluation)."
    )


def compute_line(roots: dict) -> str:
    """Each length's timed phases from <root>/seconds.json, and the machine's load."""
    parts = []
    for length, root in roots.items():
        path = os.path.join(root, "seconds.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            sec = json.load(f)
        warm = [v for k, v in sec.items() if k.startswith("warm_start/")]
        runs = [v for k, v in sec.items() if k.startswith("run/")]
        parts.append(
            f"{length}: {len(warm)} warm starts {sum(warm) / 60:.1f} min, "
            f"{len(runs)} RL runs {sum(runs) / 60:.1f} min"
        )
    load = os.getloadavg()[2] if hasattr(os, "getloadavg") else float("nan")
    return (
        "Compute (each phase timed when it ran; a rerun reuses finished runs): "
        + ("; ".join(parts) or "no timings recorded")
        + f". Load average over the 15 minutes before this file was written: {load:.1f} "
        f"on {os.cpu_count()} CPUs (shared with other jobs)."
    )
