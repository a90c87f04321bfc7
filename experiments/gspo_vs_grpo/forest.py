"""Every GSPO − GRPO final-accuracy comparison the repository publishes, on one forest plot
and one table (docs/forest.md, docs/forest.png):

    python -m experiments.gspo_vs_grpo.forest

Input: docs/forest/comparisons.csv, one row per published comparison (the report it comes
from, test bed, split, learning rate, num_mini_batches, steps, n, and the published
estimate, 95 % interval and p). Where the per-problem score files behind a row are
committed (column `per_problem`: "DIR:ARM_A:ARM_B:STEP", DIR under docs/forest/per_problem,
holding ARM/seed<k>/step<STEP>_p0.npz as `eval.save_per_problem` writes them), the row's
interval is recomputed from them (`stats.paired_difference`, seeds × problems) and
checked against the published one; elsewhere the table says the files are not committed
and shows the published numbers as they are.

Added statistics:
  Holm      step-down adjusted p over the family of distinct comparisons (interim looks
            at a subset of another row's seeds are left out): with p sorted ascending,
            p_adj(i) = max_{j <= i} min(1, (m − j + 1) p_(j)). A comparison published
            without a p is ranked as p = 1; Holm's adjusted p-values never fall when an
            input p rises, so that can only make the others' larger (conservative).
  t         the seed-level paired t interval: d_s = mean over problems of (a − b) for
            seed s, mean(d) ± t_{1−α/2, S−1} · sd(d, ddof = 1) / sqrt(S), two-sided p
            from the same t. Needs per-seed values, so only where files are committed.
  pooled    a fixed-effect inverse-variance mean of the rows that share a `group` (the
            same command and design, independent runs): weights 1/se², se read off each
            percentile interval as (high − low) / (2 · 1.96) (a normal approximation).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys

import numpy as np
from scipy import stats as scipy_stats

from experiments.gspo_vs_grpo import stats as stats_lib

DOCS = "docs"
CSV = os.path.join(DOCS, "forest", "comparisons.csv")
PER_PROBLEM = os.path.join(DOCS, "forest", "per_problem")
COLUMNS = [
    *("id", "source", "comparison", "test_bed", "split", "learning_rate", "num_mini_batches"),
    *("steps", "n_seeds", "n_problems", "estimate", "low", "high", "p", "design", "group"),
    *("per_problem", "note"),
]
Z975 = 1.959963984540054  # the normal 97.5 % quantile


@dataclasses.dataclass
class Row:
    """One published comparison, with what this tool recomputed."""

    fields: dict
    estimate: float
    low: float
    high: float
    p: float  # nan: not published
    recomputed: bool = False
    t: tuple | None = None  # (mean, low, high, p) seed-level t interval
    holm: float = float("nan")

    @property
    def interim(self) -> bool:
        return self.fields["note"].startswith("interim")


def _float(value: str, field: str, path: str, rid: str) -> float:
    if value.strip() == "":
        return float("nan")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{path}: row {rid!r}: field {field!r} is not a number: {value!r}")


def load(path: str = CSV) -> list[Row]:
    """The comparisons file's rows; a missing column or a non-number names the field."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}")
        rows = []
        for r in reader:
            rid = r["id"]
            est, low, high, p = (
                _float(r[k], k, path, rid) for k in ("estimate", "low", "high", "p")
            )
            if not low <= est <= high:
                raise ValueError(f"{path}: row {rid!r}: estimate {est} outside [low, high]")
            rows.append(Row(dict(r), est, low, high, p))
    return rows


def holm(p) -> np.ndarray:
    """Holm step-down adjusted p-values; nan inputs are ranked as 1 and come back nan."""
    p = np.asarray(p, float)
    filled = np.where(np.isnan(p), 1.0, p)
    order = np.argsort(filled, kind="stable")
    m = p.size
    adj_sorted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * filled[order]))
    out = np.empty(m)
    out[order] = adj_sorted
    return np.where(np.isnan(p), np.nan, out)


def t_interval(d, alpha: float = stats_lib.ALPHA) -> tuple[float, float, float, float]:
    """(mean, low, high, two-sided p for mean = 0) of the paired t interval over seeds."""
    d = np.asarray(d, float)
    if d.ndim != 1 or d.size < 2:
        raise ValueError(f"a t interval needs >= 2 per-seed differences, got shape {d.shape}")
    mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))
    if se == 0.0:
        return mean, mean, mean, 1.0 if mean == 0 else 0.0
    q = float(scipy_stats.t.ppf(1 - alpha / 2, d.size - 1))
    p = float(2 * scipy_stats.t.sf(abs(mean) / se, d.size - 1))
    return mean, mean - q * se, mean + q * se, p


def per_problem_scores(root: str, arm: str, step: int) -> np.ndarray:
    """[seeds, problems] scores of ARM/seed<k>/step<step>_p0.npz, seeds 0, 1, ... in
    order, problems sorted by their index (the same problems in every seed)."""
    base = os.path.join(root, arm)
    seeds = sorted(
        (int(d[4:]) for d in os.listdir(base) if d.startswith("seed")),
    )
    if not seeds or seeds != list(range(len(seeds))):
        raise ValueError(f"{base}: expected seed0 ... seedN-1 folders, found seeds {seeds}")
    out, index0 = [], None
    for s in seeds:
        path = os.path.join(base, f"seed{s}", f"step{step}_p0.npz")
        with np.load(path) as z:
            if "index" not in z or "score" not in z:
                raise ValueError(f"{path}: needs arrays 'index' and 'score'")
            order = np.argsort(z["index"])
            index, score = z["index"][order], z["score"][order]
        if index0 is not None and not np.array_equal(index, index0):
            raise ValueError(f"{path}: its problems differ from seed0's")
        index0 = index
        out.append(score.astype(float))
    return np.stack(out)


def recompute(row: Row, per_problem: str = PER_PROBLEM) -> Row:
    """The row's bootstrap interval and p (seeds × problems) and its seed-level t interval
    from the committed per-problem files; the published figures are replaced."""
    name, arm_a, arm_b, step = row.fields["per_problem"].split(":")
    root = os.path.join(per_problem, name)
    a, b = per_problem_scores(root, arm_a, int(step)), per_problem_scores(root, arm_b, int(step))
    iv = stats_lib.paired_difference(a, b)
    t = t_interval((a - b).mean(axis=1))
    published = np.array([row.estimate, row.low, row.high])
    if np.nanmax(np.abs(published - [iv.estimate, iv.low, iv.high])) > 0.0015:  # 3 decimals
        raise ValueError(
            f"row {row.fields['id']!r}: recomputed {iv.estimate:+.4f} [{iv.low:+.4f}, "
            f"{iv.high:+.4f}] differs from the published {published} (files or CSV wrong)"
        )
    return dataclasses.replace(
        row, estimate=iv.estimate, low=iv.low, high=iv.high, p=iv.p, recomputed=True, t=t
    )


def pooled(rows: list[Row]) -> dict[str, tuple[float, float, float, int]]:
    """group -> (estimate, low, high, rows) fixed-effect pools of groups with >= 2 rows."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r.fields["group"]:
            groups.setdefault(r.fields["group"], []).append(r)
    out = {}
    for g, rs in groups.items():
        if len(rs) < 2:
            continue
        se = np.array([(r.high - r.low) / (2 * Z975) for r in rs])
        w = 1 / se**2
        est = float(np.sum(w * [r.estimate for r in rs]) / w.sum())
        half = Z975 / np.sqrt(w.sum())
        out[g] = (est, est - half, est + half, len(rs))
    return out


def analyse(rows: list[Row], per_problem: str = PER_PROBLEM) -> list[Row]:
    """Recompute where files exist, then Holm over the distinct (non-interim) rows."""
    rows = [recompute(r, per_problem) if r.fields["per_problem"] else r for r in rows]
    family = [i for i, r in enumerate(rows) if not r.interim]
    adj = holm([rows[i].p for i in family])
    for i, a in zip(family, adj):
        rows[i].holm = float(a)
    return rows


def side(r: Row) -> str:
    """Which arm the 95 % interval favours, or neither."""
    if r.low > 0:
        return "GSPO"
    if r.high < 0:
        return "GRPO"
    return "neither"


def _num(x: float, fmt: str = "{:+.3f}") -> str:
    return "—" if np.isnan(x) else fmt.format(x)


def _p(x: float) -> str:
    return "not published" if np.isnan(x) else f"{x:.3g}"


def table(rows: list[Row]) -> str:
    """The markdown table: one line per comparison."""
    head = (
        "| id | comparison | test bed | split | lr | mini-batches | steps | n (seeds × problems) "
        "| Δ final accuracy | bootstrap 95 % CI | p | Holm p | favours | t 95 % CI (seeds) | t p "
        "| source | per-problem files |\n|" + "---|" * 17
    )
    lines = [head]
    for r in rows:
        f = r.fields
        files = (
            f"committed (`{PER_PROBLEM}/{f['per_problem'].split(':')[0]}`), recomputed: "
            "matches the published figures to their 3 decimals"
            if r.recomputed
            else "not committed: published figures shown"
        )
        t_ci = f"[{_num(r.t[1])}, {_num(r.t[2])}]" if r.t else "needs per-seed values"
        holm_p = "interim, not in the family" if r.interim else _p(r.holm)
        lines.append(
            f"| {f['id']} | {f['comparison']} | {f['test_bed']} | {f['split']} "
            f"| {f['learning_rate']} | {f['num_mini_batches']} | {f['steps']} "
            f"| {f['n_seeds']} × {f['n_problems']} | {_num(r.estimate)} "
            f"| [{_num(r.low)}, {_num(r.high)}] | {_p(r.p)} | {holm_p} | {side(r)} | {t_ci} "
            f"| {_p(r.t[3]) if r.t else '—'} | {f['source']} | {files}. {f['note']} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], pools: dict, png: str) -> str:
    """One forest plot: each comparison's Δ and 95 % interval (t interval in grey beside
    it where computable), and each pool as a diamond."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(r.fields["id"], r) for r in rows] + [(f"pooled: {g}", p) for g, p in pools.items()]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(items) + 1.2))
    for y, (label, r) in enumerate(reversed(items)):
        if isinstance(r, Row):
            colour = {"GSPO": "tab:blue", "GRPO": "tab:red"}.get(side(r), "black")
            ax.errorbar(
                r.estimate,
                y,
                xerr=[[r.estimate - r.low], [r.high - r.estimate]],
                fmt="o",
                color=colour,
                capsize=3,
                mfc="white" if r.interim else colour,
            )
            if r.t:
                ax.plot([r.t[1], r.t[2]], [y - 0.25] * 2, color="grey", lw=2)
            text = f"{label} (lr {r.fields['learning_rate']}, n = {r.fields['n_seeds']})"
        else:
            est, low, high, k = r
            ax.fill([low, est, high, est], [y, y + 0.3, y, y - 0.3], color="tab:purple")
            text = f"{label} ({k} runs)"
        ax.text(1.02, y, text, transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks([])
    ax.set_xlabel("GSPO − GRPO, final held-out greedy accuracy (95 % interval)")
    ax.set_title("Every published GSPO − GRPO comparison (grey: seed-level t interval)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def markdown(rows: list[Row], pools: dict, png: str) -> str:
    """docs/forest.md's text."""
    family = [r for r in rows if not r.interim]
    count = {s: sum(side(r) == s for r in family) for s in ("GSPO", "GRPO", "neither")}
    n_holm = sum(r.holm < 0.05 for r in family)
    pool_lines = [
        f"- {g}: Δ = {e:+.3f}, 95 % CI [{lo:+.3f}, {hi:+.3f}] over {k} runs of one design"
        for g, (e, lo, hi, k) in pools.items()
    ]
    intro = (
        f"Generated by `python -m experiments.gspo_vs_grpo.forest` from `{CSV}` (do not "
        "edit by hand). Each row is one comparison a report in this repository publishes: "
        "GSPO's final held-out greedy accuracy minus GRPO's (GRPO + Routing Replay's on the "
        "MoE), paired bootstrap 95 % interval over seeds × problems. The statistics are "
        "defined in `experiments/gspo_vs_grpo/forest.py`."
    )
    summary = (
        f"Of the {len(family)} distinct comparisons, the interval favours GSPO in "
        f"{count['GSPO']}, GRPO in {count['GRPO']} and neither in {count['neither']}. After "
        f"Holm's adjustment over all {len(family)}, {n_holm} keep an adjusted p below 0.05."
    )
    pool_head = (
        "Pooled estimates (only where runs share a design: the same command, independent "
        "runs; fixed-effect, inverse-variance, se read off each interval). The two runs "
        "pooled below share seeds, data order and command and differ only in the CPU's "
        "numerics, so they are not fully independent and the pooled interval is too narrow:"
    )
    t_note = (
        "Seed-level t intervals need each seed's final accuracy, which the reports do not "
        "print; only rows whose per-problem files are committed have one. Rows without "
        "committed files show their report's figures: the runs' workdirs were not kept, so "
        "they cannot be recomputed here."
    )
    return "\n".join(
        ["# Every GSPO − GRPO comparison, on one plot", "", intro, "", summary, ""]
        + [f"![forest plot]({os.path.basename(png)})", "", table(rows), "", pool_head, ""]
        + (pool_lines or ["- none"])
        + ["", t_note, ""]
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_md = argv[0] if argv else os.path.join(DOCS, "forest.md")
    rows = analyse(load())
    pools = pooled([r for r in rows if not r.interim])
    png = os.path.splitext(out_md)[0] + ".png"
    plot(rows, pools, png)
    with open(out_md, "w", encoding="utf-8") as f:
        f.write(markdown(rows, pools, png))
    print(f"wrote {out_md} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
