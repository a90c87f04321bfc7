"""Orbax's noise, held back: the one line a run reports for a failed checkpoint read or write
is its CheckpointError (checkpoint.py); what orbax, tensorstore and asyncio print around it
(an ERROR log with a traceback per thread for one full disk, dozens of "Event loop is
closed" tracebacks from a failed restore's late callbacks, "Task exception was never
retrieved" at garbage collection) goes to this module's DEBUG log instead.

    quiet_failures()                  around a restore: stderr and unraisable errors held
    hold_back_background_failures()   from a manager's creation: orbax's ERROR records to DEBUG
    keep_filters_to_the_end()         after a failed save: the filters stay until exit
    release_process_hooks()           a run's end (Trainer.close): everything put back

Why each filter exists, with the case that needed it: docs/failures.md.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import sys
import time
import traceback
import types
from typing import ClassVar

log = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_failures():
    """A damaged file makes tensorstore's reads fail inside orbax's asyncio tasks, which
    then print dozens to hundreds of "Event loop is closed" tracebacks (unraisable errors of
    callback threads that fire after orbax closed its loop, some seconds later) and "Task
    exception was never retrieved" (at garbage collection). The caller reports the one-line
    reason; this holds the rest back (logged at DEBUG level) and, after a failure, keeps
    dropping that one late error until the run ends (`_drop_late_event_loop_errors`). Yields a status
    whose `failed` the caller sets when it caught a failure itself."""
    hook, stderr = sys.unraisablehook, sys.stderr
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [logger.level for logger in loggers]
    held, swallowed = io.StringIO(), []
    sys.unraisablehook = swallowed.append
    sys.stderr = held
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    status = types.SimpleNamespace(failed=False)  # the caller may mark a failure it caught
    try:
        yield status
    except BaseException:
        status.failed = True
        raise
    finally:
        failed = status.failed
        # The failed reads' callbacks keep firing for a moment after orbax gives up: hold
        # stderr until they stop (at most a few seconds, and only when something failed).
        deadline, quiet, size = time.monotonic() + 3.0, 0, -1
        while (failed or held.tell()) and quiet < 3 and time.monotonic() < deadline:
            gc.collect()  # the failed tasks and coroutines are finalised here, silently
            quiet = quiet + 1 if held.tell() + len(swallowed) == size else 0
            size = held.tell() + len(swallowed)
            time.sleep(0.1)
        gc.collect()
        sys.unraisablehook, sys.stderr = hook, stderr
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if failed or held.tell() or swallowed:
            _drop_late_event_loop_errors()
        if held.getvalue() or swallowed:
            log.debug(
                "held back while restoring a checkpoint (%d unraisable):\n%s",
                len(swallowed),
                held.getvalue(),
            )


# The unraisable hook `_drop_late_event_loop_errors` wrapped, while its filter is installed.
_hook_before_filter = None


def _drop_late_event_loop_errors() -> None:
    """Until `release_process_hooks` (a run's end), drop (only) the "Event loop is closed"
    errors that a failed restore's tensorstore callbacks raise when they fire after orbax
    closed its loop, possibly seconds later; every other unraisable exception still reaches
    the previous hook."""
    global _hook_before_filter
    if _hook_before_filter is not None:
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    hook.gspo_jax_filter = True
    _hook_before_filter = previous
    sys.unraisablehook = hook


class OrbaxErrorsToDebug(logging.Filter):
    """Orbax logs a failed background write at ERROR once per thread involved, each with a
    traceback (about 240 lines for one full disk), before `check` raises the one line that
    names the directory and the cause. Those records go to this module's DEBUG log instead,
    one line each; the CheckpointError's traceback (WORKDIR/error.log) holds the cause.
    Orbax's records cannot be told by their file (absl names its own as the caller): they
    are the ERROR records on absl's or asyncio's logger that carry orbax's "[process=N]"
    prefix or name a directory of one of our managers, and asyncio's reports of an orbax
    task nobody awaited (its coroutine is orbax's) or of an orbax future nobody retrieved
    (the message names no coroutine; the traceback's frames are orbax's). The cases that
    needed each rule are in docs/failures.md."""

    directories: ClassVar[set[str]] = set()  # every async manager's, for the process

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        orbax_task = record.name == "asyncio" and (
            "/orbax/checkpoint/" in text or _raised_in_orbax(record.exc_info)
        )
        if orbax_task or text.startswith("[process=") or any(d in text for d in self.directories):
            log.debug("orbax: %s", " ".join(text.split())[:1000])
            return False
        return True


def _raised_in_orbax(exc_info) -> bool:
    """Whether a log record's exception was raised in orbax's checkpoint code."""
    if not exc_info or exc_info[2] is None:
        return False
    return any(
        "/orbax/checkpoint/" in frame.filename for frame in traceback.extract_tb(exc_info[2])
    )


orbax_filter = OrbaxErrorsToDebug()
# absl's logger carries orbax's own reports; asyncio's carries "Task exception was never
# retrieved" (with a traceback) for a failed write's tensorstore task that nobody awaited,
# logged whenever the garbage collector finalises it, which can be after `check` raised.
_FILTERED_LOGGERS = ("absl", "asyncio")
failure_seen = False  # a save failed or stalled: the filters stay until the process ends


def hold_back_background_failures() -> None:
    """Until `release_process_hooks`: orbax's ERROR records to DEBUG, and the "Event loop is
    closed" errors of its failed writes' late callbacks dropped (`_drop_late_event_loop_errors`)."""
    for name in _FILTERED_LOGGERS:
        logger = logging.getLogger(name)
        if orbax_filter not in logger.filters:
            logger.addFilter(orbax_filter)
    _drop_late_event_loop_errors()


def keep_filters_to_the_end() -> None:
    global failure_seen
    failure_seen = True


def release_process_hooks() -> None:
    """Put back the unraisable hook a failed restore's filter replaced (if it is still the
    one in place) and remove the orbax log filter: the run that needed them is over
    (`Trainer.close`). After a failed or stalled save both stay: the failed write's threads
    may still report, late, until the process ends."""
    global _hook_before_filter
    if failure_seen:
        return
    for name in _FILTERED_LOGGERS:
        logging.getLogger(name).removeFilter(orbax_filter)
    if _hook_before_filter is not None and getattr(sys.unraisablehook, "gspo_jax_filter", False):
        sys.unraisablehook = _hook_before_filter
    _hook_before_filter = None
