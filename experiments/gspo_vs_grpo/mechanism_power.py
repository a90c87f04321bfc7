"""The power analysis of the §5.2 mechanism test (docs/mechanism_plan.md, "Power: seeds"):
the power of its two-sided one-sample t test (noncentral t), the seeds a given sd needs, the
sd a published interval implies, and the table printed by
`python -m experiments.gspo_vs_grpo.mechanism --power`; `seeds_needed` is also the
seed-adding rule's look (`--sd_only`)."""

from __future__ import annotations

import os

import numpy as np

from experiments.gspo_vs_grpo import forest, stats

DELTA = 0.02  # the smallest interaction of interest (training reward, area per step)
POWER = 0.8
PILOT = os.path.join("docs", "mechanism", "pilot_reward_family_4seeds.csv")


def power(n: int, sd: float, delta: float = DELTA, alpha: float = stats.ALPHA / 2) -> float:
    """Power of the two-sided one-sample t test of mean(I) = 0 at n seeds when the true
    mean is `delta` and the per-seed sd is `sd` (noncentral t). alpha defaults to 0.025:
    Holm's first step over the two lengths."""
    from scipy import stats as st

    df, nc = n - 1, delta * np.sqrt(n) / sd
    q = st.t.ppf(1 - alpha / 2, df)
    lower = np.nan_to_num(st.nct.cdf(-q, df, nc), nan=0.0)  # nan where it underflows
    return float(st.nct.sf(q, df, nc) + lower)


def seeds_needed(sd: float, delta: float = DELTA, target: float = POWER, cap: int = 1000) -> int:
    """The smallest n >= 3 whose power reaches `target` (cap + 1 when none up to cap)."""
    for n in range(3, cap + 1):
        if power(n, sd, delta) >= target:
            return n
    return cap + 1


def sd_from_interval(low: float, high: float, n: int) -> float:
    """The per-seed sd a published percentile bootstrap interval over n seeds implies: its
    half-width is ~1.96 · sd · sqrt((n − 1)/n) / sqrt(n) (the bootstrap's spread of a mean)."""
    return (high - low) / (2 * forest.Z975) * np.sqrt(n) / np.sqrt((n - 1) / n)


def pilot_sd(path: str = PILOT) -> tuple[float, int]:
    """(sd over seeds of the GSPO − GRPO training-reward area, seeds) from the committed
    per-step rewards of the family run (docs/findings.md: mb = 4, lr 1e-4, 50 steps)."""
    rows = np.genfromtxt(path, delimiter=",", names=True, dtype=None, encoding="utf-8")
    if rows.size == 0:
        raise ValueError(f"{path}: no rows")
    area = {}
    for algo in ("gspo", "grpo"):
        sel = rows[rows["arm"] == algo]
        seeds = sorted(set(sel["seed"].tolist()))
        area[algo] = np.array([sel["reward"][sel["seed"] == s].mean() for s in seeds])
    d = area["gspo"] - area["grpo"]
    return float(d.std(ddof=1)), d.size


def power_table() -> str:
    """The plan's power analysis, from the committed pilot file and published intervals."""
    sd_pilot, n_pilot = pilot_sd()
    sources = [
        (f"{PILOT} (short, mb 4, lr 1e-4, {n_pilot} seeds, one warm start)", sd_pilot),
        (
            "docs/results.md dense training-reward Δ [-0.004, +0.004], 10 seeds (short, mb 4)",
            sd_from_interval(-0.004, 0.004, 10),
        ),
        (
            "docs/results_scratchpad.md training-reward Δ [-0.054, +0.032], 6 seeds (long, mb 4)",
            sd_from_interval(-0.054, 0.032, 6),
        ),
    ]
    lines = [
        (
            "| sd source | sd of I_s | n for Δ = 0.01 | n for Δ = 0.02 | n for Δ = 0.05 "
            "| smallest Δ at 80 % power, n = 10 | n = 20 |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name, sd in sources:
        ns = [seeds_needed(sd, d) for d in (0.01, 0.02, 0.05)]
        mde = [_detectable(sd, n) for n in (10, 20)]
        lines.append(
            f"| {name} | {sd:.4f} | "
            + " | ".join(map(str, ns))
            + " | "
            + " | ".join(f"{m:.3f}" for m in mde)
            + " |"
        )
    return "\n".join(lines)


def _detectable(sd: float, n: int) -> float:
    """The smallest Δ (to 0.001) with power >= POWER at n seeds."""
    for delta in np.arange(0.001, 1.0, 0.001):
        if power(n, sd, float(delta)) >= POWER:
            return float(delta)
    return float("nan")
