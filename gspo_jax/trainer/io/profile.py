"""`log.profile_steps`: a JAX profiler (xprof) trace of chosen RL steps, in WORKDIR/profile.

A run of consecutive listed steps is one trace (one `jax.profiler.start_trace` ...
`stop_trace`), so `(3, 4)` gives one trace of two steps and `(3, 9)` two traces. The trace
stops only after the step's new parameters exist (`block_until_ready`): jax dispatches
asynchronously, and a trace stopped when the Python call returns would miss the device work.
View it with TensorBoard's profile plugin (`pip install tensorboard tensorboard-plugin-profile`,
then `tensorboard --logdir WORKDIR/profile`) or at https://xprof.dev / Perfetto.

Step 1 includes compilation: profile step 2 or later to see a steady-state step."""

from __future__ import annotations

import logging
import os
from typing import Self

import jax

log = logging.getLogger(__name__)


class StepProfiler:
    """`with StepProfiler(workdir, steps) as p:` then `p.before(n)` / `p.after(n, out)` around
    RL step n (1-based). A trace still open when the block exits (an error, a preemption
    stop) is stopped there, so what it caught is written."""

    def __init__(self, workdir: str, steps: tuple[int, ...]):
        self.directory = os.path.join(workdir, "profile")
        self.steps = frozenset(steps)
        self.tracing = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.tracing:
            self._stop()

    def before(self, step: int) -> None:
        if step in self.steps and not self.tracing:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.tracing = True
            log.info("profiling RL step %d into %s", step, self.directory)

    def after(self, step: int, out) -> None:
        if self.tracing and step + 1 not in self.steps:
            jax.block_until_ready(out)
            self._stop()

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        self.tracing = False
        log.info("profile written to %s (tensorboard --logdir %s)", self.directory, self.directory)
