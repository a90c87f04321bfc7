"""Every signal that asks a job to end stops the run at the next RL step boundary, with a
checkpoint (`SIGNALS`).

A TPU preemption (a maintenance event, a Spot VM reclaimed, `launch/tpu_pod.sh stop`)
sends SIGTERM to every host; Ctrl-C sends SIGINT; a dropped SSH connection sends SIGHUP to
the session's jobs; Slurm's `--signal=USR1@60` (and other batch systems' warnings) send
SIGUSR1 or SIGUSR2 ahead of the time limit; a CPU-time limit (`ulimit -t`, a scheduler's
CPU budget) sends SIGXCPU before SIGKILL. Without a handler each of these kills the process
at once and the steps since the last periodic checkpoint are lost. SIGQUIT (Ctrl-\\) is left
alone on purpose: it is the one way a user asks for an immediate stop with a core dump (a
hung run to debug), and no scheduler sends it to end a job. With `StopOnSignal` around
the loop the first signal only sets a flag: the step in flight finishes, the loop asks
`requested()` at the boundary, saves a checkpoint of that step and returns; the entry point
then exits with status 128 + the signal number, as if the signal had killed it (a
supervisor that restarts killed jobs still restarts this one, and the restart resumes from
that checkpoint). A second signal stops at once, without a checkpoint.

Multi-host: `requested()` is the largest signal number received by any process
(`sharding.host_max`, one tiny all-gather per step), so every process stops after the same
step and takes part in the same (collective) save, even if only one was signalled.
Handlers can only be installed from the main thread; elsewhere (a notebook's worker
thread) nothing is installed and `requested()` stays 0.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Self

from gspo_jax import sharding as sharding_lib
from gspo_jax.rewards.items import SignalInterrupt, SignalStop

log = logging.getLogger(__name__)

# The signals that end a job, each handled the same way (module docstring). Verifier
# workers ignore the same set (rewards/pool.py `WORKER_IGNORED_SIGNALS`, kept equal by a test).
SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGXCPU,
)


class StopOnSignal:
    """Context manager: catches `SIGNALS` while the loop runs (module docstring)."""

    def __init__(self):
        self.received = 0  # the first signal's number, 0 before any
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received:
            log.warning("%s received again: stopping now, without a checkpoint", name)
            self.__exit__()
            # Their own types, so that a verifier scored in-process (rewards/items.py), which
            # counts a SystemExit or KeyboardInterrupt as its failure, lets them through.
            if signum == signal.SIGINT:
                raise SignalInterrupt
            raise SignalStop(128 + signum)
        self.received = signum
        log.warning(
            "%s received: stopping after the current RL step, with a checkpoint (send it "
            "again to stop at once)",
            name,
        )

    def requested(self) -> int:
        """The signal that asks the run to stop (0: none), the same on every process."""
        return sharding_lib.host_max(self.received)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by `signum` (what the signal's default would give)."""
    return 128 + int(signum)
