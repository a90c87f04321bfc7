"""Weights & Biases: the metrics rows mirrored into a W&B run, when `log.wandb_project` is set.

`MetricsWriter` (writers.py) writes metrics.jsonl and TensorBoard as always and hands each
row to its mirrors; a `WandbWriter` is one, made by setup.py on process 0 only. wandb is
imported here and only when a project is set (config validation names a missing install:
`pip install wandb`), so a run without W&B never loads it or starts its service.

- The run is named after the workdir (its last path component) and its config is the run's
  ConfigDict as a flat dict of dotted fields (`optim.learning_rate`, ...).
- One workdir, one W&B run: the run id is written to WORKDIR/wandb_run_id when the run
  starts, and a restart of the same workdir (a resume) continues that W&B run
  (`resume="allow"`). W&B keeps one row per step and only accepts steps past the last it
  holds: rows a resumed run writes again (those after its checkpoint, repeated exactly
  but for timings) are skipped in W&B, as metrics.jsonl drops and rewrites them.
- W&B's local files go to WORKDIR/wandb (or $WANDB_DIR when set); the console is not
  captured (stderr and WORKDIR/error.log are the record). `wandb_mode="offline"` writes the
  run there for a later `wandb sync`; "disabled" makes no writer at all.
- A signal that stops the run marks the W&B run as preempted (resumable) before it is
  finished; every exit path finishes it (Trainer.close).
"""

from __future__ import annotations

import logging
import os
import secrets
import string
from collections.abc import Mapping

import numpy as np

from gspo_jax.config.specs import WandbSpec
from gspo_jax.trainer.io import disk

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
_ID_CHARS = string.ascii_lowercase + string.digits


def run_id(workdir: str) -> str:
    """The W&B run id of `workdir`: read from WORKDIR/wandb_run_id, else made and written."""
    path = os.path.join(workdir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            found = f.read().strip()
        if not found or any(ch not in _ID_CHARS for ch in found):
            raise ValueError(
                f"{path} holds {found!r}, not a W&B run id (lowercase letters and digits): "
                "delete it to start a new W&B run for this workdir"
            )
        return found
    new = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    disk.write_text(path, new + "\n", lost="the W&B run id (nothing has trained yet)")
    return new


class WandbWriter:
    """A W&B run fed the rows of a MetricsWriter (`resume`, `write`, `preempting`, `close`)."""

    def __init__(self, spec: WandbSpec, workdir: str, config: Mapping):
        import wandb  # only here: a run without W&B never imports it

        self.id = run_id(workdir)
        try:
            self._run = wandb.init(
                project=spec.project,
                entity=spec.entity,
                name=os.path.basename(os.path.normpath(workdir)),
                id=self.id,
                resume="allow",
                mode=spec.mode,
                # Read at each start: wandb's own reading of $WANDB_DIR is once a process.
                dir=os.environ.get("WANDB_DIR") or workdir,
                config=dict(config),
                settings=wandb.Settings(console="off"),
            )
        except Exception as e:
            raise RuntimeError(
                f"Weights & Biases did not start (log.wandb_project={spec.project!r}, "
                f"log.wandb_mode={spec.mode!r}, run id {self.id}): {e}. Log in with "
                "`wandb login`, or log offline with --config.log.wandb_mode=offline"
            ) from e
        self.dir = os.path.dirname(self._run.dir)  # the run's local directory
        # The first step W&B takes from us: a resumed W&B run holds the steps before it.
        self._min_step = int(self._run.step)

    def resume(self, step: int) -> None:
        if self._min_step > step + 1:
            log.info(
                "W&B run %s holds steps up to %d already: the rows of steps %d..%d, written "
                "again after resuming from checkpoint %d, are not sent to it",
                self.id,
                self._min_step - 1,
                step + 1,
                self._min_step - 1,
                step,
            )

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step < self._min_step:
            return  # the interrupted run's row of this step is in W&B already
        values = {k: float(v) for k, v in metrics.items() if _is_scalar(v)}
        self._run.log(values, step=int(step))
        self._min_step = int(step)  # the same step again adds to its row

    def preempting(self) -> None:
        if self._run is not None:
            self._run.mark_preempting()

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _is_scalar(value) -> bool:
    if isinstance(value, bool) or np.ndim(value) != 0:
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
