"""`python -m experiments.gspo_vs_grpo [flags]`: the flags, the budget they set, and the two
ways through: run everything (cached phases reused) then write the results, or
--report_only (rewrite the results from a finished workdir)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from experiments.gspo_vs_grpo import sweep
from experiments.gspo_vs_grpo.arms import ALL_ARMS, ARMS, DEV_PROBLEMS, MOE_TESTBEDS, Arm, Budget
from experiments.gspo_vs_grpo.noise_length import (
    LENGTHS,
    cached_rows,
    noise_floor_lengths,
    parse_lengths,
)
from experiments.gspo_vs_grpo.report import noise_floor_markdown, write_results
from experiments.gspo_vs_grpo.run import (
    noise_floor,
    read_ledger,
    record_seconds,
    run_arm,
    warm_start,
)

log = logging.getLogger("experiments")
RESULTS = "docs/results.md"


def results_path(args, budget) -> str:
    """Where the results go: --results; with --publish the published file under docs/
    (docs/results[_<task>].md, a sweep's docs/sweeps/<field>.md); else beside the runs, in
    <workdir>/ under the same name. Nothing is written under docs/ unless asked, and a
    --quick smoke test never publishes."""
    if args.results is not None:
        return args.results
    settings = sweep.parse_vary(args.vary) if args.vary else None
    task = "" if budget.task == "add2" else f"_{budget.task}"
    published = (
        sweep.default_results(settings, budget.dev, task)
        if settings
        else RESULTS.replace(".md", f"{task}.md")
    )
    if args.publish:
        if args.quick:
            raise ValueError("--quick is a smoke test: it never publishes (drop --publish)")
        return published
    return os.path.join(args.workdir, os.path.basename(published))


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse `argv` (default sys.argv[1:]), run the experiment (or only its report), write
    the results; returns the summary (<workdir>/summary.json's content)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    _refuse_conflicts(args)
    budget = _budget(args)
    arms = _arms(args.arms)
    seeds = list(range(max(len(budget.seeds_of(a)) for a in arms)))
    if budget.task != "add2":  # its own data, model, warm starts and runs
        args.workdir = os.path.join(args.workdir, f"{budget.task}_{budget.scale}")
    if budget.dev:  # its own data split, so its own warm starts and runs
        args.workdir = os.path.join(args.workdir, "dev")
    args.results = results_path(args, budget)
    os.makedirs(args.workdir, exist_ok=True)
    import jax

    # Seeds of an arm compile the same programs: XLA's persistent cache skips the repeats.
    jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    command = "python -m experiments.gspo_vs_grpo " + " ".join(
        a for a in (sys.argv[1:] if argv is None else argv) if a != "--report_only"
    )
    if args.vary:
        return _sweep(args, arms, seeds, budget, command)
    if args.report_only:
        return _report_only(args, arms, seeds, budget, command)
    if args.noise_floor_only:
        return _noise_floor_only(args, budget)
    return _run(args, arms, seeds, budget, command)


def _arms(text: str) -> list[Arm]:
    """The arms --arms names (all when empty), in ARMS' order; an unknown or empty name is
    an error listing the valid ones (it used to be dropped while another name matched)."""
    if not text:
        return list(ARMS)
    keys = [k.strip() for k in text.split(",")]
    valid = [a.key for a in ALL_ARMS]  # the GSPO family's arms run when named
    unknown = [k for k in keys if k not in valid]
    if unknown:
        raise ValueError(f"--arms={text!r}: unknown arm(s) {unknown}; the arms are {valid}")
    return [a for a in ALL_ARMS if a.key in keys]


# Flags that choose what a run does, and the flags each one ignores: given together, one of
# them would be dropped silently.
_CONFLICTS = (
    ("report_only", "noise_floor_only"),
    ("vary", "noise_floor_only"),
    ("no_noise_floor", "noise_floor_only"),
    ("quick", "eval_every"),  # --quick evaluates only at the start and the end
)


def _refuse_conflicts(args) -> None:
    for a, b in _CONFLICTS:
        if getattr(args, a) not in (None, False, []) and getattr(args, b) not in (None, False, []):
            raise ValueError(f"--{a} and --{b} cannot be used together: one would be ignored")


def _parser() -> argparse.ArgumentParser:
    package_doc = sys.modules[__package__].__doc__
    p = argparse.ArgumentParser(
        prog="python -m experiments.gspo_vs_grpo",
        description=package_doc.split("\n\n")[0],
        allow_abbrev=False,  # --step is not --steps: a flag is spelled out or refused
    )
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 50)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default 8)")
    p.add_argument("--eval_prompts", type=int, default=None, help="held-out (default 200)")
    p.add_argument("--eval_every", type=int, default=None, help="default: steps // 2")
    p.add_argument("--moe_seeds", type=int, default=None, help="MoE arms (default --seeds)")
    p.add_argument(
        "--moe_testbed",
        default="specialised",
        choices=sorted(MOE_TESTBEDS),
        help="the MoE arms' model: "
        + "; ".join(f"{name}: {bed.describe()}" for name, bed in MOE_TESTBEDS.items()),
    )
    p.add_argument(
        "--independent_warm_starts",
        action="store_true",
        help="seed k's runs start from a warm start trained with seed k (default: one shared)",
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke test (no result)")
    p.add_argument("--workdir", default="/tmp/gspo_vs_grpo", help="runs go here")
    p.add_argument(
        "--results",
        default=None,
        help="the markdown written (default: <workdir>/results.md, or with --publish "
        f"{RESULTS}; a sweep's: docs/sweeps/<field>.md)",
    )
    p.add_argument(
        "--publish",
        action="store_true",
        help=f"write the results to the published file under docs/ ({RESULTS}, "
        "docs/results_<task>.md, docs/sweeps/<field>.md)",
    )
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="FIELD=V1,V2,...",
        help="sweep a config field over values for the --arms (e.g. num_mini_batches=1,2,4,8;"
        " repeat to vary several fields together, zipped): runs and a sweep report instead of"
        " the results (no noise floor); with --report_only, only the report",
    )
    p.add_argument(
        "--dev",
        action="store_true",
        help=f"train on train[{DEV_PROBLEMS}:] and evaluate on train[:{DEV_PROBLEMS}] (a dev "
        "split for choosing hyperparameters: the test split is never read), in <workdir>/dev",
    )
    p.add_argument(
        "--task",
        default="add2",
        choices=("add2", "scratchpad"),
        help="add2: configs/default.py's task (16-token answers); scratchpad: "
        "configs/scratchpad.py (long worked additions, a larger model) for every arm, in "
        "<workdir>/scratchpad_<scale>, results by default in docs/results_scratchpad.md",
    )
    p.add_argument(
        "--scale",
        default="cpu",
        choices=("cpu", "gpu"),
        help="cpu: the defaults below; gpu: the same command sized for one GPU (10 seeds "
        "with independent warm starts, 200 steps of 16 prompts, 500 held-out problems every "
        "20 steps; the scratchpad task at 4-10 digits and 2.9M parameters): run it under "
        "jax[cuda], explicit flags still win",
    )
    p.add_argument(
        "--arms",
        default="",
        help="comma-separated arms, e.g. dense/gspo (default: the GSPO and GRPO arms); the "
        "GSPO family's dense/ and moe/ sapo, cispo, gmpo, luspo, dppo (docs/objectives.md)",
    )
    p.add_argument(
        "--no_noise_floor",
        action="store_true",
        help="skip the noise floor (and the one against length, unless --noise_floor_lengths)",
    )
    p.add_argument(
        "--noise_floor_lengths",
        default=None,
        help="response lengths of the §5.4 noise floor against length, comma-separated "
        f"(default {','.join(map(str, LENGTHS))}; none with --quick; '' skips it)",
    )
    p.add_argument(
        "--noise_floor_only",
        action="store_true",
        help="measure the noise floors only (cached in --workdir) and print their markdown "
        "section (no training, --results untouched)",
    )
    p.add_argument(
        "--report_only",
        action="store_true",
        help="rewrite --results from the finished runs in --workdir (no training)",
    )
    return p


def _budget(args) -> Budget:
    """The flags' budget: --quick's smoke test, else the published run's defaults."""
    for name in ("steps", "seeds", "moe_seeds", "prompts", "eval_prompts", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be at least 1")
    if args.quick:
        return Budget(
            steps=args.steps or 2,
            seeds=args.seeds or 1,
            prompts=args.prompts or 4,
            eval_every=0,
            eval_prompts=args.eval_prompts or 8,
            quick=True,
            dev=args.dev,
            task=args.task,
            scale=args.scale,
            independent_warm_starts=args.independent_warm_starts,
            moe_seeds=args.moe_seeds,
            moe_testbed=args.moe_testbed,
        )
    gpu = args.scale == "gpu"
    steps = args.steps or (200 if gpu else 50)
    return Budget(
        steps=steps,
        seeds=args.seeds or (10 if gpu else 3),
        prompts=args.prompts or (16 if gpu else 8),
        eval_every=args.eval_every or (20 if gpu else max(1, steps // 2)),
        eval_prompts=args.eval_prompts or (500 if gpu else 200),
        dev=args.dev,
        independent_warm_starts=args.independent_warm_starts or gpu,
        moe_seeds=args.moe_seeds,
        task=args.task,
        scale=args.scale,
        moe_testbed=args.moe_testbed,
    )


def _run(args, arms: list[Arm], seeds: list[int], budget: Budget, command: str) -> dict:
    """Noise floor, warm starts, every arm and seed (seeds outermost: an interrupted run
    still has whole seeds), then the results and <workdir>/summary.json."""
    commit = _commit()  # the code this run imports (before anything else can move HEAD)
    lengths = _noise_floor_lengths(args, budget)  # a bad flag fails before any work
    t0 = time.perf_counter()
    noise = [] if args.no_noise_floor else noise_floor(args.workdir, budget.quick)
    by_length = noise_floor_lengths(args.workdir, lengths, rollouts=1 if budget.quick else 2)
    timings = {}
    for seed in seeds:
        for arm in arms:
            if seed not in budget.seeds_of(arm):
                continue
            own = seed if budget.independent_warm_starts else None
            warm = warm_start(arm.model, budget, args.workdir, own)  # cached after the first
            timings[f"{arm.key}/seed{seed}"] = run_arm(arm, seed, budget, args.workdir, warm)
    wall = time.perf_counter() - t0
    stats = write_results(
        args.results,
        args.workdir,
        arms,
        seeds,
        budget,
        command.strip(),
        wall,
        noise,
        commit,
        noise_by_length=by_length,
    )
    summary = {
        "wall_s": wall,
        "command": command.strip(),
        "commit": commit,
        "runs": timings,
        "stats": stats,
        "noise_floor": noise,
        "noise_floor_lengths": by_length,
    }
    with open(os.path.join(args.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    log.info("wrote %s in %.1f min", args.results, wall / 60)
    return summary


def _sweep(args, arms: list[Arm], seeds: list[int], budget: Budget, command: str) -> dict:
    """--vary: every arm under every setting for every seed (warm starts shared with the
    workdir's other runs), then the sweep's report; --report_only: the report alone."""
    settings = sweep.parse_vary(args.vary)
    if budget.dev and budget.eval_prompts > DEV_PROBLEMS:
        raise ValueError(f"--eval_prompts={budget.eval_prompts}: the dev split has {DEV_PROBLEMS}")
    rows = sweep.variants(arms, settings, budget, args.workdir)  # fails before any run
    commit = _commit()
    t0 = time.perf_counter()
    timings = {}
    if not args.report_only:
        for seed in seeds:
            for row in rows:
                for arm in row:
                    if seed not in budget.seeds_of(arm) or f"{arm.key}/seed{seed}" in timings:
                        continue
                    own = seed if budget.independent_warm_starts else None
                    warm = warm_start(arm.model, budget, args.workdir, own)
                    timings[f"{arm.key}/seed{seed}"] = run_arm(
                        arm, seed, budget, args.workdir, warm
                    )
    # What ran: its commit and time, kept for --report_only (which runs no code worth naming).
    record = os.path.join(args.workdir, f"sweep_{os.path.basename(args.results)}.json")
    if args.report_only and os.path.exists(record):
        with open(record) as f:
            ran = json.load(f)
    else:
        ran = {"commit": commit, "invocation_s": time.perf_counter() - t0}
        with open(record, "w") as f:
            json.dump(ran, f)
    ledger = read_ledger(args.workdir)
    wall = _sweep_wall(ledger, rows, seeds, budget, ran["invocation_s"])
    cells = sweep.write_sweep(
        args.results,
        args.workdir,
        rows,
        settings,
        budget,
        command.strip(),
        f"{wall} {ran['commit']}.",
    )
    log.info("wrote %s", args.results)
    return {"runs": timings, "cells": len(cells), "results": args.results}


def _sweep_wall(ledger: dict, rows, seeds, budget: Budget, invocation_s: float) -> str:
    """The sweep's wall-time line from the workdir's ledger."""
    keys = {f"run/{a.key}/seed{s}" for row in rows for a in row for s in budget.seeds_of(a)}
    runs = [ledger[k] for k in keys if k in ledger]
    warm = sum(v for k, v in ledger.items() if k.startswith("warm_start/"))
    return (
        f"Wall time: the sweep's {len(keys)} runs took {sum(runs) / 60:.1f} min ({len(runs)} "
        f"timed; a run with a setting equal to its arm's own config is shared with the "
        f"workdir's other sweeps), the warm starts {warm / 60:.1f} min; this invocation "
        f"{invocation_s / 60:.1f} min, on {os.cpu_count()} CPU cores (load average "
        f"{os.getloadavg()[2]:.1f}). Code at commit"
    )


def _report_only(args, arms: list[Arm], seeds: list[int], budget: Budget, command: str) -> dict:
    """Rewrite the results from <workdir>: its summary.json, else (an interrupted
    invocation) its ledger and cached noise floor. Returns what it read."""
    path = os.path.join(args.workdir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            done = json.load(f)
    else:  # an interrupted invocation: the ledger and the cached measurement
        with open(os.path.join(args.workdir, "noise_floor.json")) as f:
            noise_rows = json.load(f)
        done = {"wall_s": 0.0, "runs": {}, "noise_floor": noise_rows}
    noise = [] if args.no_noise_floor else done["noise_floor"]
    # A summary from before the sweep existed: whatever lengths the workdir has cached.
    wanted = _noise_floor_lengths(args, budget)
    by_length = done.get("noise_floor_lengths") or cached_rows(args.workdir)
    by_length = [r for r in by_length if r["length"] in wanted]
    ledger = read_ledger(args.workdir)
    for key, timing in done["runs"].items():  # runs timed by the invocation that ran them
        if timing.get("seconds") and f"run/{key}" not in ledger:
            record_seconds(args.workdir, f"run/{key}", timing["seconds"])
    write_results(
        args.results,
        args.workdir,
        arms,
        seeds,
        budget,
        done.get("command", command.strip()),
        done["wall_s"],
        noise,
        done.get("commit", "unknown"),
        noise_by_length=by_length,
    )
    return done


def _noise_floor_only(args, budget: Budget) -> dict:
    """The noise floor (unless --no_noise_floor) and the one against length, measured or
    read from the workdir's cache; prints their section of the results. Returns the rows."""
    lengths = _noise_floor_lengths(args, budget)
    noise = [] if args.no_noise_floor else noise_floor(args.workdir, budget.quick)
    by_length = noise_floor_lengths(args.workdir, lengths, rollouts=1 if budget.quick else 2)
    print(noise_floor_markdown(noise, by_length))
    return {"noise_floor": noise, "noise_floor_lengths": by_length}


def _noise_floor_lengths(args, budget: Budget) -> tuple[int, ...]:
    """--noise_floor_lengths parsed: LENGTHS by default, none with --quick or
    --no_noise_floor unless given."""
    if args.noise_floor_lengths is None:
        return () if budget.quick or args.no_noise_floor else LENGTHS
    return parse_lengths(args.noise_floor_lengths)


def _commit() -> str:
    """The checkout's short commit, marked when tracked files have uncommitted changes."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            check=False,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
