"""Shared by the end-to-end tests: the `python -m gspo_jax.main` command line, flags
shrinking configs/default.py to a 2-layer d=32 model, and the reader of a run's
metrics.jsonl."""

import json
import os
import sys


def main_command(workdir, *flags, config="configs/default.py") -> list[str]:
    """argv of `python -m gspo_jax.main --config=CONFIG --workdir=WORKDIR FLAGS...`."""
    return [
        sys.executable,
        "-m",
        "gspo_jax.main",
        f"--config={config}",
        f"--workdir={workdir}",
        *flags,
    ]


TINY_MODEL = [
    "--config.response_length=12",
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=2",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1",
    "--config.model.head_dim=16",
    "--config.warm_start.steps=3",
    "--config.warm_start.batch_size=16",
    "--config.checkpoint.every_steps=1",
    "--config.log.progress_bar=false",
]


def metrics_by_step(workdir) -> dict[int, dict]:
    """metrics.jsonl of a run as {step: merged row} (a step may span several lines)."""
    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return rows


def steps_written(workdir) -> int:
    """The newest step of a run's metrics.jsonl that is completely written, -1 if none: safe
    to call while the run (another process) is still writing the file. A line counts once
    its newline is there; the file may not exist yet, or be empty."""
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            text = f.read()
    except FileNotFoundError:
        return -1
    complete = text[: text.rfind("\n") + 1].splitlines()  # a line still being written waits
    return max((json.loads(line)["step"] for line in complete if line.strip()), default=-1)
