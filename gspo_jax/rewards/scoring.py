"""Robust batch scoring of completions: `score_batch` and its logging summary.

Data flow: sampler output decoded to text on the host -> `score_batch(reward, prompts,
completions, references)` -> (rewards_B float32, stats) -> `advantages.compute_advantages`.
Shape letters: B = number of completions in the batch (N prompts x G samples), K =
number of terms of the reward spec.

Handling rule (docs/architecture.md, reliability rules; `items.evaluate_item`): an item whose verifier
raises, returns a value that is not a real number, returns a non-finite value, or runs
past `timeout_s` gets reward `fail_value` (0.0) and is counted in `stats` with a
per-item status the trainer can log or mask. Configuration problems (unknown reward, a
worker that cannot start or cannot import the module that registers the reward) raise
instead: they are not bad data.

Two modes:

* Process mode (default whenever `timeout_s` is set): items go to the persistent worker
  pool of `pool.py`; a worker past the timeout is killed and replaced. Rewards reach
  workers by name, so they must be registered in an importable module.
* In-process mode (`timeout_s=None`, or `use_processes=False`): verifiers run in the
  calling thread, without isolation: a crash kills the trainer. `in_process_timeout_s`
  bounds each item with SIGALRM from the main thread (the trainer's reward.timeout_s with
  reward.num_workers=0); a verifier stuck inside one C call is not interrupted. Use it for tests and trusted, fast verifiers (a few us per item); any
  callable works there, registered or not.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from gspo_jax.rewards import registry
from gspo_jax.rewards.items import (
    MAX_MESSAGES,
    STATUS_ERROR,
    STATUS_NAMES,
    STATUS_NONFINITE,
    STATUS_NONNUMERIC,
    STATUS_OK,
    STATUS_TIMEOUT,
    SignalInterrupt,
    evaluate_item,
)
from gspo_jax.rewards.pool import RewardPool, get_default_pool
from gspo_jax.rewards.registry import Reward, RewardFn

log = logging.getLogger(__name__)

# Failures that are the verifier's own every time (a raise, a non-number, NaN): a batch of
# nothing but these is a broken verifier, not bad luck. Timeouts depend on the machine.
HARD_FAILURES = ("num_errors", "num_nonnumeric", "num_nonfinite")


class RewardError(RuntimeError):
    """Every reward of a batch failed: the verifier cannot score this task at all."""


class FailureLog:
    """Logs each distinct verifier failure message once (up to `limit` of them), so a
    verifier that raises is visible in the log, not only as a count in the metrics."""

    def __init__(self, what: str, limit: int = 10):
        self.what = what
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, stats: dict) -> None:
        for text in stats.get("messages", {}).values():
            key = text.split("\n")[0][:160]
            if key in self.seen or len(self.seen) >= self.limit:
                continue
            self.seen.add(key)
            more = " (the last new one logged)" if len(self.seen) == self.limit else ""
            log.warning("reward %s failed on an item%s: %s", self.what, more, text)


def raise_all_failed(num_items: int, batches: int, stats: dict, *, what: str) -> None:
    """RewardError: every call of the last `batches` batches (`num_items` in the last, over
    all processes) failed in a hard way; quotes one of this process's messages."""
    example = next(iter(stats.get("messages", {}).values()), "see the other processes' logs")
    counts = ", ".join(f"{k[4:]}={stats.get(k, 0)}" for k in HARD_FAILURES)
    raise RewardError(
        f"reward {what} failed on every response of {batches} batch(es) in a row ({num_items} "
        f"in the last; {counts} on this process): {example}. Such batches carry no reward "
        "signal, so nothing is learned; fix the verifier (try it with "
        "gspo_jax.rewards.score_batch on a few completions), or raise "
        "config.reward.max_failed_rollouts"
    )


def score_batch(
    reward_fn: str | Reward | RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    references: Sequence[str],
    *,
    timeout_s: float | None = 10.0,
    use_processes: bool | None = None,
    pool: RewardPool | None = None,
    num_workers: int | None = None,
    fail_value: float = 0.0,
    in_process_timeout_s: float | None = None,
    examples: Sequence[Mapping] | None = None,
) -> tuple[np.ndarray, dict]:
    """Scores B completions: rewards_B (float32) and stats.

    reward_fn: a spec string ("math", "math:1.0,format:0.1"), a `Reward`, or a reward
      function (registered ones can run in worker processes; any callable in-process).
    timeout_s: per-item limit in seconds (process mode); None runs in-process.
    use_processes: None = process mode iff timeout_s is set. False with a timeout is an
      error (an in-process call cannot be stopped). True with timeout_s=None isolates
      crashes without a time limit.
    pool: the `RewardPool` to use (default: a shared pool of `num_workers` workers).
    fail_value: reward of a failed item (error, timeout, non-numeric, non-finite).
    in_process_timeout_s: in-process mode only, a per-item limit enforced with SIGALRM when
      called from the main thread (Python code is interrupted between bytecodes; a verifier
      stuck inside one C call, e.g. a regex, is not); elsewhere no limit.
    examples: per completion, the fields of the example it answers (a dict: a JSONL line,
      a table row), passed to the reward terms that ask for them (`example=`,
      registry.takes_example); None: `{}` for those terms.

    stats: num_items, num_ok, num_errors, num_timeouts, num_nonfinite, num_nonnumeric,
    num_failed, num_worker_restarts (ints); status_B (int8 codes STATUS_*), ok_B,
    error_B, timeout_B, nonfinite_B, nonnumeric_B (bool [B]); terms: {name: float32 [B]}
    raw per-term values (0 where the item failed); messages: {index: text} for up to
    MAX_MESSAGES failed items; time_s: wall time of the call.
    """
    start = time.perf_counter()
    num_items = len(completions)
    use_processes = _check_batch(
        prompts, completions, references, timeout_s, use_processes, fail_value
    )
    examples = _check_examples(examples, num_items)
    reward = registry.as_reward(reward_fn)
    if reward is None and use_processes:
        raise TypeError(
            f"reward_fn {reward_fn!r} is not registered: worker processes look rewards up "
            "by name, so register it with @register_reward in an importable module (or "
            "score in-process with timeout_s=None)"
        )
    term_names = reward.names if reward is not None else ("reward",)
    if use_processes and num_items:
        if pool is None:
            pool = get_default_pool(num_workers)
        if not reward.takes_example:  # nothing to send the workers
            examples = [None] * num_items
        status_B, totals_B, values_BK, messages, restarts = pool.score(
            reward, prompts, completions, references, timeout_s=timeout_s, examples=examples
        )
    else:
        target = reward if reward is not None else reward_fn
        items = (prompts, completions, references, examples)
        status_B, totals_B, values_BK, messages = _score_in_process(
            target, len(term_names), items, in_process_timeout_s
        )
        restarts = 0
    stats = _stats(status_B, values_BK, term_names, messages, restarts)
    stats["time_s"] = time.perf_counter() - start
    rewards_B = np.where(stats["ok_B"], totals_B, fail_value).astype(np.float32)
    return rewards_B, stats


def _check_batch(prompts, completions, references, timeout_s, use_processes, fail_value):
    """The arguments of `score_batch`, checked; returns whether to use worker processes."""
    num_items = len(completions)
    for name, seq in (("prompts", prompts), ("references", references)):
        if len(seq) != num_items:
            raise ValueError(f"{name} has {len(seq)} items but completions has {num_items}")
    for name, seq in (
        ("prompts", prompts),
        ("completions", completions),
        ("references", references),
    ):
        for i, item in enumerate(seq):
            if not isinstance(item, str):
                raise TypeError(f"{name}[{i}] must be a str, got {type(item).__name__}")
    if not math.isfinite(fail_value):
        raise ValueError(f"fail_value must be finite, got {fail_value}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
    if use_processes is None:
        use_processes = timeout_s is not None
    if not use_processes and timeout_s is not None:
        raise ValueError(
            "use_processes=False cannot enforce timeout_s: pass timeout_s=None for "
            "in-process scoring, or use_processes=True"
        )
    return use_processes


def _check_examples(examples, num_items: int) -> list:
    """`examples` as a list of B dicts or Nones (None: B Nones)."""
    if examples is None:
        return [None] * num_items
    examples = list(examples)
    if len(examples) != num_items:
        raise ValueError(f"examples has {len(examples)} items but completions has {num_items}")
    for i, example in enumerate(examples):
        if example is not None and not isinstance(example, Mapping):
            raise TypeError(f"examples[{i}] must be a dict or None, got {type(example).__name__}")
    return examples


def _score_in_process(target, num_terms, items, timeout_s=None):
    """(status [B], totals [B], per-term values [B, K], messages) scored in this process;
    `items` = (prompts, completions, references, examples)."""
    with _ctrl_c_is_not_the_verifiers():
        return _score_items(target, num_terms, *items, timeout_s)


class _ItemTimeout(BaseException):
    """Raised by SIGALRM inside an in-process verifier past its time (a BaseException, so
    the verifier's own `except Exception` cannot swallow it)."""


@contextlib.contextmanager
def _alarm(timeout_s: float | None):
    """Yields a function (re)arming a SIGALRM timer of `timeout_s` for the next item, or
    None where no timer can be set (not the main thread, no setitimer, no timeout)."""
    main = threading.current_thread() is threading.main_thread()
    if timeout_s is None or not main or not hasattr(signal, "setitimer"):
        yield None
        return

    def expire(signum, frame):
        raise _ItemTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        yield lambda: signal.setitimer(signal.ITIMER_REAL, timeout_s)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _ctrl_c_is_not_the_verifiers():
    """While Python's default SIGINT handler is installed (no trainer handler: start-up, the
    first evaluation, a library call), a Ctrl-C raises `SignalInterrupt`, which
    `evaluate_item` lets through, instead of a KeyboardInterrupt it would count as the
    verifier's error (only the main thread can install a handler)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def interrupt(signum, frame):
        raise SignalInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _score_items(target, num_terms, prompts, completions, references, examples, timeout_s):
    num_items = len(completions)
    status_B = np.zeros(num_items, np.int8)
    totals_B = np.zeros(num_items, np.float64)
    values_BK = np.zeros((num_items, num_terms), np.float64)
    messages = {}
    with _alarm(timeout_s) as arm:
        for i in range(num_items):
            try:
                if arm is not None:
                    arm()
                try:
                    result = evaluate_item(
                        target, prompts[i], completions[i], references[i], examples[i]
                    )
                finally:
                    if arm is not None:
                        signal.setitimer(signal.ITIMER_REAL, 0)
            except _ItemTimeout:
                text = f"timed out after {timeout_s} s (in-process, config.reward.timeout_s)"
                result = (STATUS_TIMEOUT, 0.0, (0.0,) * num_terms, text)
            status, total, values, text = result
            status_B[i], totals_B[i], values_BK[i] = status, total, values
            if text is not None and len(messages) < MAX_MESSAGES:
                messages[i] = text
    return status_B, totals_B, values_BK, messages


def _stats(status_B, values_BK, term_names, messages, restarts) -> dict:
    """`score_batch`'s stats (its docstring) from the items' status codes."""
    num_items = len(status_B)
    ok_B = status_B == STATUS_OK
    flags = {
        f"{STATUS_NAMES[code]}_B": status_B == code
        for code in (STATUS_ERROR, STATUS_TIMEOUT, STATUS_NONFINITE, STATUS_NONNUMERIC)
    }
    return {
        "num_items": num_items,
        "num_ok": int(ok_B.sum()),
        "num_errors": int(flags["error_B"].sum()),
        "num_timeouts": int(flags["timeout_B"].sum()),
        "num_nonfinite": int(flags["nonfinite_B"].sum()),
        "num_nonnumeric": int(flags["nonnumeric_B"].sum()),
        "num_failed": int(num_items - ok_B.sum()),
        "num_worker_restarts": restarts,
        "status_B": status_B,
        "ok_B": ok_B,
        **flags,
        "terms": {
            name: np.where(ok_B, values_BK[:, k], 0.0).astype(np.float32)
            for k, name in enumerate(term_names)
        },
        "messages": messages,
    }


def summarize(stats: dict, prefix: str = "reward/") -> dict[str, float]:
    """Flat scalar metrics for logging: failure counts, and the mean of each term over
    the items that scored."""
    metrics = {
        f"{prefix}{key}": float(stats[key])
        for key in (
            "num_failed",
            "num_errors",
            "num_timeouts",
            "num_nonfinite",
            "num_nonnumeric",
            "num_worker_restarts",
            "time_s",
        )
    }
    ok_B = stats["ok_B"]
    for name, values_B in stats["terms"].items():
        metrics[f"{prefix}{name}/mean"] = float(values_B[ok_B].mean()) if ok_B.any() else 0.0
    return metrics
