"""Cost of pass@k / maj@k evaluation (eval.pass_k = k) against the greedy evaluation.

Sets up configs/default.py (its supervised warm start included, so response lengths are a
trained model's), then times the held-out evaluation `--reps` times after a compiling
call: each evaluation runs its greedy pass and its k-sample pass over the same
eval.num_prompts prompts (trainer/evaluation.py), timed apart. Prints one JSON line:
median seconds of each, their ratio, and the sampled / greedy response tokens.

    python benchmarks/eval_cost.py                  # k = 4, the default's 500 prompts
    python benchmarks/eval_cost.py --k=8 --warm_start_steps=300

The sampled pass generates k x the greedy pass's tokens and scores k x its responses. On
a shared machine read the ratio (both passes timed in the same evaluation), not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from configs import default
from gspo_jax.trainer import loop, setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="eval.pass_k")
    parser.add_argument("--reps", type=int, default=3, help="timed evaluations")
    parser.add_argument("--warm_start_steps", type=int, default=None, help="default: config's")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    c = default.get_config()
    c.eval.pass_k = args.k
    c.log.progress_bar = False
    c.reward.num_workers = 0  # scoring in-process: the timing is the evaluation's own
    if args.warm_start_steps is not None:
        c.warm_start.steps = args.warm_start_steps
        c.warm_start.target_accuracy = 0  # exactly that many steps
    workdir = args.workdir or tempfile.mkdtemp(prefix="eval_cost_")
    trainer = setup.setup(c, os.path.join(workdir, "run"))
    try:
        with jax.set_mesh(trainer.mesh):
            params = loop.init_or_restore(trainer).train.params
            trainer.evaluator(params)  # compiles both samplers
            runs = [trainer.evaluator(params) for _ in range(args.reps)]
    finally:
        trainer.close()
    greedy = statistics.median(r["time/eval_greedy_s"] for r in runs)
    sampled = statistics.median(r["time/eval_sampled_s"] for r in runs)
    last = runs[-1]
    report = {
        "k": args.k,
        "prompts": last["eval/num_prompts"],
        "greedy_s": round(greedy, 4),
        "sampled_s": round(sampled, 4),
        "sampled_over_greedy": round(sampled / greedy, 3),
        "tokens_sampled_over_greedy": round(
            args.k * last["eval/sampled_length_mean"] / last["eval/length_mean"], 3
        ),
        "eval/accuracy": last["eval/accuracy"],
        **{k: v for k, v in last.items() if k.startswith(("eval/pass@", "eval/maj@"))},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
