"""Writing the results (docs/results.md by default): the plots next to it in results/, and
the markdown, rendered from results_template.md (and noise_floor_template.md when the noise
floor was measured) with `string.Template`. The prose lives in the templates; this module
only computes and formats what fills their $placeholders."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence

import numpy as np

from experiments.gspo_vs_grpo.analysis import (
    arm_stats,
    final_problems,
    log_s_by_length,
    over_seeds,
    pm,
    verdicts,
)
from experiments.gspo_vs_grpo.arms import EPS_GSPO, Arm, Budget, arm_config
from experiments.gspo_vs_grpo.noise_length import render as render_by_length
from experiments.gspo_vs_grpo.run import SPECIALISATION, read_ledger, warm_start_dir
from gspo_jax.objectives import length_buckets

PLOTS = (
    ("training reward", "reward/mean", True),
    ("held-out accuracy (greedy)", "eval/accuracy", False),
    ("clipped fraction of tokens", "policy/clipfrac", True),
    ("clipped fraction of sequences", "policy/clipfrac_seq", True),
    ("expert change rate after 1 update", "updates/expert_change/1", True),
    ("train/inference log-prob gap (mean |Δ|)", "sampler/logprob_gap_mean", True),
)


def plot(root: str, arms: Sequence[Arm], seeds: Sequence[int], model: str, png: str) -> str:
    """Mean over seeds (line) and min-max over seeds (band) of each PLOTS metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gspo_jax.trainer.io.writers import _ema

    fig, axes = plt.subplots(2, 3, figsize=(14, 7), squeeze=False)
    for ax, (title, key, smooth) in zip(axes.flat, PLOTS):
        for arm in arms:
            if arm.model != model:
                continue
            got = over_seeds(root, arm, seeds, key)
            if got is None:
                continue
            xs, ys = got
            if smooth and len(xs) >= 10:
                ys = np.stack([_ema(y.tolist(), 0.9) for y in ys])
            mean = ys.mean(0)
            (line,) = ax.plot(xs, mean, label=arm.label, marker="." if not smooth else None)
            ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
        ax.set_title(title + (" (EMA 0.9)" if smooth else ""), fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if "clipfrac" in key or "gap" in key:
            ax.set_yscale("symlog", linthresh=1e-5)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.axis("off")
    fig.suptitle(f"{model}: mean over {len(seeds)} seeds, band = min-max over seeds")
    fig.tight_layout()
    os.makedirs(os.path.dirname(png), exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def write_results(
    path: str,
    root: str,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    budget: Budget,
    command: str,
    wall_s: float,
    noise: list[dict],
    commit: str,
    *,
    noise_by_length: Sequence[dict] = (),
) -> dict:
    """Write the results markdown to `path` (plots into results/ beside it) from the runs
    under `root`; returns the per-arm statistics (`arm_stats`). `noise_by_length`: the rows
    of the noise floor against response length (noise_length.py), if measured."""
    here = os.path.dirname(os.path.abspath(path))
    ran = {a.key: [s for s in seeds if s in budget.seeds_of(a)] for a in arms}
    stats = {a.key: arm_stats(root, a, ran[a.key]) for a in arms}
    problems = {a.key: final_problems(root, a, ran[a.key]) for a in arms}
    by_model = {a.model: ran[a.key] for a in arms}  # the arms of a model run the same seeds
    stem = os.path.splitext(os.path.basename(path))[0]  # docs/results.md: gspo_vs_grpo_<m>
    prefix = "gspo_vs_grpo" + ("" if stem == "results" else f"_{stem}")
    pngs = [
        plot(root, arms, by_model[m], m, os.path.join(here, "results", f"{prefix}_{m}.png"))
        for m in ("moe", "dense")
        if m in by_model
    ]
    fields = {
        "command": command,
        **_wall_time(read_ledger(root), wall_s, commit),
        **_budget(arm_config(arms[0], seeds[0], budget, root), by_model, budget),
        "moe_line": _moe_line(root, budget, by_model.get("moe")),
        "verdict_rows": "\n".join(
            f"| {claim} | **{verdict}** | {numbers} |"
            for claim, verdict, numbers in verdicts(stats, noise, problems)
        ),
        "table_rows": "\n".join(_table_row(arm, stats[arm.key], ran[arm.key]) for arm in arms),
        "curves": "\n\n".join(
            f"![{os.path.basename(png)}]({os.path.relpath(png, here)})" for png in pngs
        ),
        "noise_floor": noise_floor_markdown(noise, noise_by_length),
        "by_length": by_length_markdown(root, arms, ran),
    }
    text = _template("results_template.md").substitute(fields)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")  # one final newline, with or without a noise floor
    return stats


def by_length_markdown(root: str, arms: Sequence[Arm], ran: dict) -> str:
    """The "log s_i against length, during training" section ("" when no run logged the
    by_length/* metrics): per arm and response-length bucket, log s_i's spread over the run
    (mean ± sd over seeds) and the sequences per run it rests on."""
    rows = {a.key: log_s_by_length(root, a, ran[a.key]) for a in arms if ran[a.key]}
    names = [n for n, _, _ in length_buckets() if any(n in r for r in rows.values())]
    if not names:
        return ""
    head = "| arm | " + " | ".join(f"{n} tokens" for n in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for arm in arms:
        r = rows.get(arm.key, {})
        cells = [f"{r[n][0]:.2e} ± {r[n][1]:.1e} ({r[n][2]:.0f})" if n in r else "—" for n in names]
        lines.append(f"| {arm.label} | " + " | ".join(cells) + " |")
    return (
        "## log s_i against response length, during training\n\n"
        "The spread of GSPO's log sequence ratio log s_i = mean_t(log π_θ − log π_old) over "
        "each run's sequences, by response length: sqrt(mean of (log s_i)²) over every "
        "update of every step (update 0 included: with π_old recomputed its log s_i is 0, "
        "which scales every bucket alike), mean ± sd over seeds, and in brackets the "
        "sequences per run in the bucket (`by_length/*`, gspo_jax/algorithm/objectives.py). "
        "Every "
        "objective has a log s_i, so GRPO's rows show the same quantity under GRPO's "
        "updates. Were the per-token changes independent and equally spread, the spread "
        "would fall as 1/sqrt(length).\n\n" + "\n".join(lines) + "\n"
    )


def _moe_line(root: str, budget: Budget, seeds) -> str:
    """The Task line's MoE sentence ("" without MoE arms): how the test bed was made and,
    specialised, its measures before and after (mean and range over the seeds)."""
    if not seeds:
        return ""
    bed = budget.moe
    found = []
    for seed in seeds if bed.specialise_steps else ():
        own = seed if budget.independent_warm_starts else None
        path = os.path.join(warm_start_dir("moe", budget, root, own), SPECIALISATION)
        if os.path.exists(path):
            with open(path) as f:
                found.append(json.load(f))
    line = (
        " MoE: configs/moe_tiny.py's algorithms on each seed's dense warm start upcycled to "
        f"{bed.describe(found[0]['steps'] if found else None)} (`upcycle`"
        f"{', `specialise`' if bed.specialise_steps else ''} in the experiment; --moe_testbed="
        f"{bed.name}). moe_tiny.py's own from-scratch warm start solved 0.5% of 200 held-out "
        "problems, too rare a reward for RL at this budget."
    )
    if not found:
        return line
    names = {
        "expert_spread": "expert spread",
        "load_entropy": "load entropy",
        "max_load": "max load",
    }
    parts = []
    for key, name in names.items():
        b = [m["before"][key] for m in found]
        a = [m["after"][key] for m in found]
        parts.append(
            f"{name} {np.mean(b):.3g} → {np.mean(a):.3g} (range {min(a):.3g}-{max(a):.3g})"
        )
    return line + (
        f" Specialisation, before → after the supervised steps, mean over {len(found)} warm "
        "start(s) on 256 demonstrations (experiments/gspo_vs_grpo/specialisation.py defines "
        f"them): {'; '.join(parts)}."
    )


def _template(name: str) -> string.Template:
    with open(os.path.join(os.path.dirname(__file__), name), encoding="utf-8") as f:
        return string.Template(f.read())


def _wall_time(ledger: dict, wall_s: float, commit: str) -> dict:
    """The wall-time line: every phase from the ledger (in minutes), this machine, commit."""
    runs = [v for k, v in ledger.items() if k.startswith("run/")]
    warm = sum(v for k, v in ledger.items() if k.startswith("warm_start/"))
    noise_s = sum(v for k, v in ledger.items() if k.startswith("noise_floor"))  # + by length
    return {
        "total_min": f"{sum(ledger.values()) / 60:.0f}",
        "cpus": os.cpu_count(),
        "load": f"{os.getloadavg()[2]:.1f}",
        "noise_floor_min": f"{noise_s / 60:.1f}",
        "warm_start_min": f"{warm / 60:.1f}",
        "num_runs": len(runs),
        "runs_min": f"{sum(runs) / 60:.1f}",
        "invocation_min": f"{wall_s / 60:.1f}",
        "commit": commit,
    }


def _budget(c, by_model: dict, budget: Budget) -> dict:
    """The budget line, from one arm's config `c` (every arm has the same shape) and the
    seeds each model's arms ran."""
    prompts, group = c.rollout_batch_size, c.num_return_sequences_in_group
    warm = (
        "every seed k starts from its own supervised warm start, trained with seed k "
        "(--independent_warm_starts: the warm start is a factor the seeds vary)"
        if budget.independent_warm_starts
        else "every run of a model starts from its one supervised warm start (seeds vary "
        "the RL only)"
    )
    return {
        "steps": budget.steps,
        "seeds": "; ".join(
            f"{m}: {s[0]}-{s[-1]} (n = {len(s)})" if len(s) > 1 else f"{m}: {s} (n = 1)"
            for m, s in by_model.items()
        ),
        "warm_start_design": warm,
        "prompts": prompts,
        "group": group,
        "responses": budget.steps * prompts * group,
        "warm_start_steps": (
            f"{c.warm_start.steps} supervised steps"
            if not c.warm_start.target_accuracy
            else f"supervised steps until {c.warm_start.target_accuracy:.0%} greedy accuracy on "
            f"{c.warm_start.check_prompts} train problems (checked every "
            f"{c.warm_start.check_every} steps, at most {c.warm_start.max_steps})"
        ),
        **TASKS[budget.task](budget),
        "eval_prompts": budget.eval_prompts,
        "eval_every": budget.eval_every or budget.steps,
    }


def _add2(budget: Budget) -> dict:
    return {
        "task_line": "configs/default.py (2-digit addition, warm start imitating a teacher who "
        "drops carries, then RL against the exact verifier).",
        "budget_note": " The default run (configs/default.py) uses 250 RL steps of 16 prompts on"
        " all 500 test problems; this smaller budget is what fits the whole experiment (warm "
        "starts included) into the time we had on a shared 2-core machine, so the curves show "
        "early training and small differences are within noise.",
    }


def _scratchpad(budget: Budget) -> dict:
    from configs import scratchpad

    digits, width, response = scratchpad.SCALES[budget.scale]
    return {
        "task_line": f"configs/scratchpad.py at scale={budget.scale} (scratchpad/{digits}: "
        "long additions worked column by column, responses up to "
        f"{response} tokens; a d_model {width} model; warm start imitating a teacher who drops "
        "every carry on 60 % of the problems that need one, then RL against the exact "
        "verifier).",
        "budget_note": "",
    }


TASKS = {"add2": _add2, "scratchpad": _scratchpad}


def _table_row(arm: Arm, s: dict, seeds: Sequence[int]) -> str:
    expert_change = [
        pm(s[k], "{:.2%}") if k in s else "-" for k in ("expert_change_1", "expert_change_3")
    ]
    cells = [
        arm.label,
        str(len(seeds)),
        *(pm(s[k]) for k in ("eval_start", "eval_end", "eval_best")),
        *(pm(s[k]) for k in ("reward_mean", "reward_last20")),
        *(pm(s[k], "{:.2e}") for k in ("clipfrac_tok", "clipfrac_seq")),
        *expert_change,
    ]
    return "| " + " | ".join(cells) + " |"


def noise_floor_markdown(noise: Sequence[dict], by_length: Sequence[dict]) -> str:
    """The Noise floor section: the table at one length, then the one against length
    ("" when neither was measured)."""
    parts = [_noise_floor_section(noise)] if noise else ["## Noise floor"]
    if by_length:
        parts.append(render_by_length(by_length, EPS_GSPO))
    return "\n\n".join(parts) if noise or by_length else ""


def _noise_floor_section(noise: list[dict]) -> str:
    rows = "\n".join(
        f"| {r['dtype']} | {r['pi_old']} | {r['max_abs_s_minus_1']:.1e} |"
        f" {r['max_clipfrac_seq']:.0%} | {r['sampler_gap_max']:.1e} |"
        for r in noise
    )
    return _template("noise_floor_template.md").substitute(rows=rows)
