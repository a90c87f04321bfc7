"""--vary: one factor swept over values for the chosen arms, every value run with the same
seeds and warm starts, and its report. The sweeps a reviewer of the comparison asks for, one
command each:

  off-policy dose-response   --vary num_mini_batches=1,2,4,8   (updates per rollout)
  learning rate per arm      --vary optim.learning_rate=3e-5,1e-4,3e-4 --dev
  GSPO's ε                   --vary clip_low=1e-4,3e-4,1e-3 --vary clip_high=1.33e-4,4e-4,1.33e-3
  §5.4 where the floor < ε   --vary old_logprobs_source=recompute,sampler   (f32)

Several --vary flags zip value by value (one setting per position). A setting equal to the
arm's own config is the arm itself: its runs live in <workdir>/<model>_<arm>/seed<k>/ and
are shared by every sweep of the workdir; a variant's in <model>_<arm>/<field>=<value>/.

The report (markdown and a plot): per value and arm, the final held-out accuracy with its
95 % bootstrap interval over seeds, the training reward and the clipped fractions (binding,
out of range, binding over updates >= 1); GSPO − GRPO at each value (paired bootstrap over
seeds x problems, as the main results); and the value each arm ends best at, which is a
choice only on a dev split (--dev), never on the test split it would then be scored on."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from experiments.gspo_vs_grpo import stats as stats_lib
from experiments.gspo_vs_grpo.analysis import (
    COLLAPSE_DROP,
    arm_stats,
    collapses,
    final_accuracy_difference,
    final_problems,
)
from experiments.gspo_vs_grpo.arms import DEV_PROBLEMS, Arm, Budget, arm_config
from experiments.gspo_vs_grpo.report import TASKS

Setting = tuple[tuple[str, str], ...]  # ((field, value), ...): one position of the sweep


def parse_vary(specs: Sequence[str]) -> list[Setting]:
    """--vary flags ("field=v1,v2,...") -> one setting per position, the flags zipped."""
    fields, columns = [], []
    for spec in specs:
        field, sep, values = spec.partition("=")
        field, items = field.strip(), [v.strip() for v in values.split(",")]
        if not sep or not field or not all(items):
            raise ValueError(
                f"--vary={spec!r}: expected FIELD=V1,V2,... (e.g. num_mini_batches=1,2,4)"
            )
        if field in fields:
            raise ValueError(f"--vary names {field!r} twice")
        fields.append(field)
        columns.append(items)
    if len({len(c) for c in columns}) != 1:
        sizes = ", ".join(f"{f}: {len(c)}" for f, c in zip(fields, columns))
        raise ValueError(f"--vary flags zip value by value, so they need as many values ({sizes})")
    return [tuple(zip(fields, values)) for values in zip(*columns)]


def variants(arms: Sequence[Arm], settings: Sequence[Setting], budget: Budget, root: str):
    """[setting][arm]: each arm under each setting, its config built and validated now (a bad
    field or value fails before any run). Overrides that leave the arm's config as it is
    are dropped, so the arm's own setting is the arm itself."""
    from gspo_jax.config import validate as config_lib

    out = []
    for setting in settings:
        row = []
        for arm in arms:
            base = arm_config(arm, 0, budget, root)
            varied = arm_config(dataclasses.replace(arm, overrides=setting), 0, budget, root)
            config_lib.validate(varied)
            kept = tuple((f, v) for f, v in setting if _get(varied, f) != _get(base, f))
            row.append(dataclasses.replace(arm, overrides=kept))
        out.append(row)
    return out


def _get(c, field: str):
    for name in field.split("."):
        c = c[name]
    return c


def label(setting: Setting) -> str:
    return ", ".join(f"{f} = {v}" for f, v in setting)


def default_results(settings: Sequence[Setting], dev: bool, task: str = "") -> str:
    """docs/sweeps/<field>[+<field>][_<task>][_dev].md."""
    name = "+".join(f for f, _ in settings[0]).replace(".", "_")
    return os.path.join("docs", "sweeps", f"{name}{task}{'_dev' if dev else ''}.md")


# -------------------------------------------------------------------------------- report


def summarize(root: str, rows, settings: Sequence[Setting], budget: Budget) -> list[dict]:
    """One dict per (setting, arm): its `arm_stats`, the interval of its final accuracy over
    seeds, its paired difference to the same arm under the first setting (the effect of
    the factor: "vs_first"), and (for GSPO) to GRPO under the same setting ("vs")."""
    out = []
    first = {}  # arm name -> (stats, problems) under the first setting
    for setting, row in zip(settings, rows):
        stats, problems = {}, {}
        for arm in row:
            seeds = budget.seeds_of(arm)
            stats[_name(arm)] = arm_stats(root, arm, seeds)
            problems[_name(arm)] = final_problems(root, arm, seeds)
            first.setdefault(_name(arm), (stats[_name(arm)], problems[_name(arm)]))
        for arm in row:
            s = stats[_name(arm)]
            cell = {"setting": setting, "arm": arm, "stats": s}
            cell["final_ci"] = stats_lib.one_sample(s["eval_end"][2])
            if setting is not settings[0]:
                base_stats, base_problems = first[_name(arm)]
                both = {"a": s, "b": base_stats}, {"a": problems[_name(arm)], "b": base_problems}
                cell["vs_first"] = final_accuracy_difference(*both, "a", "b")
            other = f"{arm.model}/" + ("grpo_rr" if arm.model == "moe" else "grpo")
            if arm.name == "gspo" and other in stats:
                iv = final_accuracy_difference(stats, problems, _name(arm), other)
                cell["vs"] = (other, iv)
            out.append(cell)
    return out


def _name(arm: Arm) -> str:
    return f"{arm.model}/{arm.name}"


def markdown(cells: list[dict], settings, budget: Budget, command: str, wall: str, png: str):
    split = (
        f"the dev split (train[:{DEV_PROBLEMS}]; training on train[{DEV_PROBLEMS}:], the test "
        "split never read)"
        if budget.dev
        else "the test split"
    )
    fields = ", ".join(f for f, _ in settings[0])
    lines = [
        f"# Sweep: {fields}",
        "",
        (
            "Generated by the command below (do not edit by hand: rerun it). Every number "
            "here was measured by that run."
        ),
        "",
        "```",
        command,
        "```",
        "",
        f"- {wall}",
        f"- Task: {TASKS[budget.task](budget)['task_line']}",
        f"- Budget: {budget.steps} RL steps per run, {budget.prompts} prompts x G responses "
        f"per rollout, held-out greedy accuracy on {budget.eval_prompts} problems of {split} "
        + (f"every {budget.eval_every} steps" if budget.eval_every else "at the start and end")
        + "; each seed k starts every arm and value from "
        + (
            "its own warm start (--independent_warm_starts)."
            if budget.independent_warm_starts
            else "one shared warm start."
        ),
        (
            "- Final accuracy: mean over seeds with its 95 % percentile bootstrap interval "
            "over seeds (10,000 resamples); ± elsewhere is the sample std over seeds (ddof = "
            "1). Clipped fractions: binding (policy/clipfrac), out of range "
            "(policy/clipfrac_range), binding over updates >= 1 (update 0 is on-policy)."
        ),
        "",
        (
            "| setting | arm | n | start acc. | final acc. (95 % CI) | Δ vs the first setting "
            "(paired 95 % CI) | best acc. | reward (mean over run) | clipped tokens, binding | "
            "out of range | binding, updates >= 1 | clipped sequences |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        s, iv = c["stats"], c["final_ci"]
        ci = f"[{iv.low:.3f}, {iv.high:.3f}]" if iv.n_seeds > 1 else "(one seed)"
        lines.append(
            f"| {label(c['setting'])} | {c['arm'].label} | {len(s['eval_end'][2])} | "
            f"{_pm(s, 'eval_start')} | {iv.estimate:.3f} {ci} | {_delta(c.get('vs_first'))} | {_pm(s, 'eval_best')} | "
            f"{_pm(s, 'reward_mean')} | "
            f"{_pm(s, 'clipfrac_tok', '{:.2e}')} | {_pm(s, 'clipfrac_range', '{:.2e}')} | "
            f"{_pm(s, 'clipfrac_after0', '{:.2e}')} | {_pm(s, 'clipfrac_seq', '{:.2e}')} |"
        )
    lines += _expert_change_lines(cells, label)
    pairs = [c for c in cells if "vs" in c]
    if pairs:
        lines += [
            "",
            "## GSPO − the GRPO arm at each setting (final held-out accuracy)",
            "",
            "| setting | model | Δ | 95 % CI | p | verdict | test |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in pairs:
            other, iv = c["vs"]
            lines.append(
                f"| {label(c['setting'])} | {c['arm'].model}/gspo − {other} | {iv.estimate:+.3f} "
                f"| [{iv.low:+.3f}, {iv.high:+.3f}] | {iv.p:.3g} | "
                f"{stats_lib.verdict(iv).split(' (')[0]} | {iv.design} |"
            )
    lines += ["", "## Best setting per arm", ""]
    if not budget.dev:
        lines.append(
            "Read off the test split: a description, not a choice (a choice made here would "
            "be scored on the problems it was chosen on; rerun with --dev to choose)."
        )
        lines.append("")
    lines += ["| arm | best setting | final acc. (95 % CI) | next best |", "|---|---|---|---|"]
    for key in dict.fromkeys(c["arm"].label for c in cells):
        mine = sorted(
            (c for c in cells if c["arm"].label == key), key=lambda c: -c["final_ci"].estimate
        )
        best, iv = mine[0], mine[0]["final_ci"]
        nxt = (
            f"{label(mine[1]['setting'])}: {mine[1]['final_ci'].estimate:.3f}"
            if len(mine) > 1
            else "-"
        )
        ci = f"[{iv.low:.3f}, {iv.high:.3f}]" if iv.n_seeds > 1 else "(one seed)"
        edge = best["setting"] in (settings[0], settings[-1]) and len(settings) > 2
        where = " (an end of the sweep: the best may lie beyond it)" if edge else ""
        lines.append(
            f"| {key} | {label(best['setting'])}{where} | {iv.estimate:.3f} {ci} | {nxt} |"
        )
    lines += ["", f"![{os.path.basename(png)}]({png})", ""]
    return "\n".join(lines)


def _expert_change_lines(cells, label) -> list[str]:
    """The MoE cells' §5.3 measures ([] without MoE cells): expert change after 1 and 3
    updates with its 95 % bootstrap interval over seeds, and the runs that collapsed."""
    moe = [c for c in cells if "expert_change_1" in c["stats"]]
    if not moe:
        return []
    lines = [
        "",
        "## MoE: experts changed per update (paper §5.3: ~10 %), and collapses",
        "",
        (
            "Expert change: the fraction of activated (token, layer, top-k) experts the router "
            "picks differently after 1 (3) updates, averaged over the run "
            "(updates/expert_change); 95 % bootstrap interval over seeds. Collapse: final "
            f"held-out accuracy more than {COLLAPSE_DROP:.2f} below the run's start."
        ),
        "",
        "| setting | arm | n | after 1 update (95 % CI) | after 3 updates | collapses |",
        "|---|---|---|---|---|---|",
    ]
    for c in moe:
        s = c["stats"]
        iv = stats_lib.one_sample(s["expert_change_1"][2])
        ci = f"[{iv.low:.2%}, {iv.high:.2%}]" if iv.n_seeds > 1 else "(one seed)"
        down, n = collapses(s["eval_start"], s["eval_end"])
        lines.append(
            f"| {label(c['setting'])} | {c['arm'].label} | {n} | {iv.estimate:.2%} {ci} | "
            f"{_pm(s, 'expert_change_3', '{:.2%}')} | {down}/{n} |"
        )
    return lines


def _delta(iv) -> str:
    if iv is None:
        return "-"
    if iv.n_seeds < 2:
        return f"{iv.estimate:+.3f}"
    return f"{iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"


def _pm(s: dict, key: str, fmt: str = "{:.3f}") -> str:
    if key not in s:
        return "-"
    mean, sd, _ = s[key]
    return fmt.format(mean) if np.isnan(sd) else f"{fmt.format(mean)} ± {fmt.format(sd)}"


def axis(settings: Sequence[Setting]):
    """(the plot's axis title, a setting's tick label): the --vary fields whose values
    differ between settings (all of them the same: the first), their values one per line
    in the title's order."""
    fields = [f for f, _ in settings[0]]
    varying = [i for i in range(len(fields)) if len({s[i][1] for s in settings}) > 1] or [0]

    def label(setting: Setting) -> str:
        return "\n".join(setting[i][1] for i in varying)

    return " / ".join(fields[i] for i in varying), label


def plot(cells: list[dict], settings: Sequence[Setting], png: str) -> str:
    """Final held-out accuracy (mean, 95 % CI over seeds), training reward and the binding
    clipped-token fraction against the swept values (`axis`), per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    field, label = axis(settings)
    values = [label(s) for s in settings]
    try:
        xs = [float(v) for v in values]
        numeric = True
    except ValueError:
        xs, numeric = list(range(len(values))), False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key in dict.fromkeys(c["arm"].label for c in cells):
        mine = [c for c in cells if c["arm"].label == key]
        at = [xs[values.index(label(c["setting"]))] for c in mine]
        acc = np.array(
            [[c["final_ci"].estimate, c["final_ci"].low, c["final_ci"].high] for c in mine]
        )
        err = np.abs(acc[:, 1:].T - acc[:, 0])
        axes[0].errorbar(at, acc[:, 0], yerr=err, marker="o", capsize=3, label=key)
        axes[1].plot(at, [c["stats"]["reward_mean"][0] for c in mine], marker="o", label=key)
        axes[2].plot(at, [c["stats"]["clipfrac_tok"][0] for c in mine], marker="o", label=key)
    for ax, title in zip(
        axes,
        ("final held-out accuracy (95 % CI)", "training reward (mean over run)", "clipped tokens"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(field)
        ax.grid(alpha=0.3)
        if numeric and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2 if all(float(x).is_integer() for x in xs) else 10)
        if not numeric:
            ax.set_xticks(xs, values)
        ax.legend(fontsize=7)
    # a fraction spanning 0 to ~0.3: linear below 1e-4 (so 0 shows), log above, no
    # negative half (matplotlib's symlog would otherwise mirror the axis below 0)
    axes[2].set_yscale("symlog", linthresh=1e-4)
    axes[2].set_ylim(0, 1)
    axes[2].set_ylabel("fraction of tokens (symlog: linear below 1e-4)", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def write_sweep(path: str, root: str, rows, settings, budget: Budget, command: str, wall: str):
    """The sweep's markdown at `path`, its plot beside it (<name>.png); returns the cells."""
    cells = summarize(root, rows, settings, budget)
    png = os.path.splitext(path)[0] + ".png"
    plot(cells, settings, png)
    text = markdown(cells, settings, budget, command, wall, os.path.basename(png))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return cells
