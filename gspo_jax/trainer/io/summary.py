"""WORKDIR/summary.json: where a run started from, its first and last held-out accuracy,
how it ended; merged into, never truncated, written whole."""

import json
import logging
import os
from typing import Any

from gspo_jax.trainer.io import disk

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
# How one invocation ended and what it wrote: never carried over from an earlier
# invocation's summary.json when a later one merges into it (`write_summary`).
OUTCOME_KEYS = ("preempted", "stopped_after", "error", "export", "plot")


def write_summary(workdir: str, summary: dict) -> dict:
    """Merge `summary` into WORKDIR/summary.json: a re-run of a finished workdir, a resume
    or a longer run keeps what earlier invocations recorded (eval_start, eval_end, ...)
    and overwrites what it measured again; how the earlier one ended (OUTCOME_KEYS) is
    dropped. `origin` is the run's (a resume's own goes to `resumed_from`). Written whole (a temporary file renamed), so a crash never leaves half of it."""
    path = os.path.join(workdir, SUMMARY_FILE)
    previous: Any = {}
    try:
        with open(path) as f:
            previous = json.load(f)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): rewritten from this run alone", path, e)
    if not isinstance(previous, dict):
        previous = {}
    merged = {k: v for k, v in previous.items() if k not in OUTCOME_KEYS} | summary
    if summary.get("start_step") and "origin" in previous:
        # A resume (or a re-run of a finished workdir) starts from the run's own checkpoint:
        # where the run's weights came from (a warm start, its target) stays the record.
        merged["origin"] = previous["origin"]
        merged["resumed_from"] = summary.get("origin")
    lost = "this invocation's summary (its accuracies, how it ended)"
    kept = "the checkpoints and metrics.jsonl are kept" + (
        "; so is the previous summary.json, as it was" if previous else ""
    )
    disk.write_text(path, json.dumps(merged, indent=2, default=str), lost=lost, kept=kept)
    return merged
