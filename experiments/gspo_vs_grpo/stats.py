"""The experiment's statistics: mean and sample std over seeds, and paired bootstrap 95 %
intervals (with a two-sided p-value) of arm differences, GSPO − GRPO.

Pairing: runs of the two arms with the same seed index share the seed's warm start, data
order and sampling stream, so their difference is the unit resampled. Two designs:

  seeds           d [S]: one number per seed (a training metric, a final accuracy).
                  Each resample draws S seeds with replacement: mean of d over them.
  seeds×problems  d [S, P]: per-problem held-out correctness of the same P problems by
                  both arms' seed-s runs. Each resample draws S seeds and, independently,
                  P problems with replacement (a two-way bootstrap: the seed and the
                  problem set are both sources of variation): mean of d over the S×P
                  cells drawn. With counts c (seeds) and w (problems) of one resample,
                  that mean is c·D·w / (S·P), one matrix product per batch of resamples.

Interval: the percentile interval (alpha/2 and 1 − alpha/2 quantiles of the resampled
statistic, numpy's "linear" quantile). p-value: two-sided, from the same resamples,
    p = min(1, 2 · (min(#{θ* ≤ 0}, #{θ* ≥ 0}) + 1) / (R + 1)),
the smallest alpha at which the percentile interval would exclude 0 (+1: a resampled
p is never 0). A difference that is 0 for every pair gives θ* = 0 throughout: interval
[0, 0], p = 1. Ratios (GSPO's clipped fraction over GRPO's) are tested as log ratios of
the resampled means: the interval is exponentiated, p is for log ratio = 0.

Percentile intervals from few seeds are too narrow (at n seeds the bootstrap's spread is
sqrt((n − 1)/n) of the sample's); the results say n beside every interval.
"""

from __future__ import annotations

import dataclasses

import numpy as np

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class Interval:
    """A paired comparison: the point estimate, its percentile interval and p-value."""

    estimate: float
    low: float
    high: float
    p: float
    n_seeds: int
    n_problems: int = 0  # 0: resampled over seeds only

    @property
    def design(self) -> str:
        seeds = f"{self.n_seeds} seed{'s' if self.n_seeds != 1 else ''}"
        if self.n_problems:
            return f"paired bootstrap over {seeds} × {self.n_problems} problems"
        return f"paired bootstrap over {seeds}"


def mean_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; nan for fewer than 2 values)."""
    v = np.asarray(values, float)
    sd = float(v.std(ddof=1)) if v.size > 1 else float("nan")
    return float(v.mean()), sd


def resample_counts(rng: np.random.Generator, n: int, resamples: int) -> np.ndarray:
    """[resamples, n] how often each of n units is drawn in n draws with replacement
    (indices drawn uniformly, then counted: the same draws as index resampling)."""
    idx_RN = rng.integers(0, n, size=(resamples, n))
    flat = (idx_RN + n * np.arange(resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=resamples * n).reshape(resamples, n)


def bootstrap_means(
    x, *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, batch: int = 1000
) -> np.ndarray:
    """[resamples] bootstrap means of x: [S] over seeds, or [S, P] over seeds × problems
    (module docstring). The seed counts are drawn first, then the problem counts."""
    x = np.asarray(x, float)
    if x.ndim not in (1, 2) or x.shape[0] < 1 or (x.ndim == 2 and x.shape[1] < 1):
        raise ValueError(f"bootstrap needs a [seeds] or [seeds, problems] array, got {x.shape}")
    rng = np.random.default_rng(seed)
    c_RS = resample_counts(rng, x.shape[0], resamples)
    if x.ndim == 1:
        return c_RS @ x / x.shape[0]
    w_RP = resample_counts(rng, x.shape[1], resamples)
    out = np.empty(resamples)
    for lo in range(0, resamples, batch):  # [batch, P] at a time: bounded memory
        hi = min(lo + batch, resamples)
        out[lo:hi] = np.sum((c_RS[lo:hi] @ x) * w_RP[lo:hi], axis=1)
    return out / x.size


def percentile_interval(stats_R, estimate: float, alpha: float = ALPHA, **kw) -> Interval:
    """The percentile interval and two-sided p of resampled statistics `stats_R` (kw:
    n_seeds, n_problems)."""
    stats_R = np.asarray(stats_R, float)
    low, high = np.quantile(stats_R, [alpha / 2, 1 - alpha / 2])
    tail = min(np.sum(stats_R <= 0), np.sum(stats_R >= 0))
    p = min(1.0, 2 * (tail + 1) / (stats_R.size + 1))
    return Interval(float(estimate), float(low), float(high), float(p), **kw)


def undefined(estimate: float, n_seeds: int) -> Interval:
    """A bootstrap over fewer than 2 seeds (and no problems): every resample is the one
    seed again, a zero-width interval and p = 2/(R + 1) that mean nothing. Neither is
    given (nan); `ci_text` says so."""
    return Interval(float(estimate), float("nan"), float("nan"), float("nan"), n_seeds)


def ci_text(iv: Interval, fmt: str = "{:+.3f}", p_label: str = "p") -> str:
    """ "95 % CI [a, b], p = x", or what stands in for them at one seed."""
    if np.isnan(iv.p):
        return f"no interval or p from {iv.n_seeds} seed"
    return f"95 % CI [{fmt.format(iv.low)}, {fmt.format(iv.high)}], {p_label} = {iv.p:.3g}"


def paired_difference(a, b, *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED):
    """Interval of mean(a − b), a and b [S] or [S, P] paired by seed (and problem); over
    seeds alone, one seed gives none (`undefined`)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ValueError(f"paired arms need equal shapes, got {a.shape} and {b.shape}")
    d = a - b
    if d.ndim == 1 and d.shape[0] < 2:
        return undefined(d.mean(), d.shape[0])
    stats_R = bootstrap_means(d, resamples=resamples, seed=seed)
    n_problems = d.shape[1] if d.ndim == 2 else 0
    return percentile_interval(stats_R, d.mean(), n_seeds=d.shape[0], n_problems=n_problems)


def one_sample(x, *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Interval:
    """Interval of mean(x) over seeds (p is for mean = 0)."""
    x = np.asarray(x, float)
    if x.shape[0] < 2:
        return undefined(x.mean(), x.shape[0])
    stats_R = bootstrap_means(x, resamples=resamples, seed=seed)
    return percentile_interval(stats_R, x.mean(), n_seeds=x.shape[0])


def paired_ratio(
    a, b, *, null: float = 1.0, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Interval:
    """Interval of mean(a) / mean(b) over seeds, paired by seed (the same seed draws for
    both): computed on log(mean a*/mean b*), then exponentiated; p is for ratio = null."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"a ratio needs two [seeds] arrays, got {a.shape} and {b.shape}")
    if np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("a ratio of clipped fractions needs positive values in both arms")
    if a.size < 2:
        return undefined(a.mean() / b.mean(), a.size)
    rng = np.random.default_rng(seed)
    c_RS = resample_counts(rng, a.size, resamples)
    shift = np.log(null)  # the p-value's null at 0
    log_R = np.log(c_RS @ a) - np.log(c_RS @ b) - shift
    log_R[np.abs(log_R) < 1e-12] = 0.0  # a ratio equal to the null up to rounding is the null
    log_iv = percentile_interval(log_R, np.log(a.mean() / b.mean()) - shift, n_seeds=a.size)
    return dataclasses.replace(
        log_iv,
        estimate=float(np.exp(log_iv.estimate + shift)),
        low=float(np.exp(log_iv.low + shift)),
        high=float(np.exp(log_iv.high + shift)),
    )


NOT_REPRODUCED = "not reproduced on this test bed"


def verdict(iv: Interval, *, direction: int = 1, null: float = 0.0) -> str:
    """The claim says the estimate is above `null` (direction 1) or below it (−1); the
    interval decides: "consistent with the claim" (wholly on the claim's side), "not
    distinguishable at n = k" (contains the null), NOT_REPRODUCED (wholly on the other
    side: what this test bed shows, not a refutation of the paper's model). One seed
    decides nothing."""
    if iv.n_seeds < 2:
        return "not testable at n = 1 (one seed)"
    above, below = iv.low > null, iv.high < null
    if (above and direction > 0) or (below and direction < 0):
        return "consistent with the claim"
    if above or below:
        return NOT_REPRODUCED
    return f"not distinguishable at n = {iv.n_seeds}"


def band_verdict(iv: Interval, low: float, high: float) -> str:
    """For a claim that a quantity is about a value: consistent when the whole interval
    lies in [low, high], NOT_REPRODUCED when it lies wholly outside, else not
    distinguishable. One seed decides nothing."""
    if iv.n_seeds < 2:
        return "not testable at n = 1 (one seed)"
    if low <= iv.low and iv.high <= high:
        return "consistent with the claim"
    if iv.high < low or iv.low > high:
        return NOT_REPRODUCED
    return f"not distinguishable at n = {iv.n_seeds}"
