"""One verifier call judged: the reward-handling rule (docs/architecture.md).

`evaluate_item(reward, prompt, completion, reference, example)` runs a verifier and returns
(status, total, per-term values, message); it never raises an Exception. An item whose
verifier raises, returns a value that is not a real number (`numbers.Real`:
bool/int/float/Fraction/NumPy scalars; a string such as "1.0" is *not* parsed), or
returns a non-finite value (or a weighted sum that overflows) gets a failure status and
a message; `scoring.score_batch` turns failures into `fail_value` and counts them. The
same function runs in-process and inside the worker processes of `pool.py`; timeouts
and dead workers are the pool's business (STATUS_TIMEOUT, STATUS_ERROR).
"""

from __future__ import annotations

import math
import numbers

from gspo_jax.rewards.registry import Reward, RewardFn, call_reward, takes_example

STATUS_OK = 0
STATUS_ERROR = 1
STATUS_TIMEOUT = 2
STATUS_NONFINITE = 3
STATUS_NONNUMERIC = 4
STATUS_NAMES = ("ok", "error", "timeout", "nonfinite", "nonnumeric")

# Rewards travel as float32 (scoring.score_batch -> advantages): a value beyond its range is
# finite in Python but inf after the cast, and would surface steps later as a non-finite
# update blamed on the loss coefficients. It is counted as non-finite here, at the source.
FLOAT32_MAX = 3.4028234663852886e38

# Messages kept per batch and their length: enough to debug, bounded for logs.
MAX_MESSAGES = 16
MAX_MESSAGE_CHARS = 500


class SignalStop(SystemExit):
    """The trainer's own stop at a second signal (trainer/preemption.py), raised wherever the
    main thread is, a verifier scored in-process included: never a verifier failure."""


class SignalInterrupt(KeyboardInterrupt):
    """A real Ctrl-C (SIGINT) that reached a verifier scored in-process: the trainer's second
    SIGINT, or the first one while no stop-at-the-step-boundary handler is installed. A
    verifier that raises KeyboardInterrupt itself is a verifier error like any other."""


# What `evaluate_item` lets through: the interrupts that belong to the process, not to the
# verifier. Everything else a verifier raises (SystemExit, KeyboardInterrupt) is its failure.
PROCESS_STOPS = (SignalStop, SignalInterrupt)


def check_value(value: object) -> tuple[int, float, str | None]:
    """(status, float value, message) for one verifier return value."""
    if not isinstance(value, numbers.Real):
        text = repr(value)[:80] if isinstance(value, (str, bytes)) else type(value).__name__
        return STATUS_NONNUMERIC, 0.0, f"returned a non-numeric value: {text}"
    try:
        result = float(value)
    except OverflowError:
        return STATUS_NONFINITE, 0.0, "returned a value too large for float64"
    except (TypeError, ValueError) as e:
        return STATUS_NONNUMERIC, 0.0, f"returned a value float() rejects: {e}"
    if not math.isfinite(result):
        return STATUS_NONFINITE, 0.0, f"returned a non-finite value: {result}"
    if abs(result) > FLOAT32_MAX:
        return (
            STATUS_NONFINITE,
            0.0,
            f"returned {result!r}, beyond float32's range (rewards are float32)",
        )
    return STATUS_OK, result, None


def _truncate(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."


def evaluate_item(
    reward: Reward | RewardFn,
    prompt: str,
    completion: str,
    reference: str,
    example: dict | None = None,
) -> tuple[int, float, tuple[float, ...], str | None]:
    """Runs one item: (status, total, per-term values, message); never raises an Exception.
    `example`: the row's fields, for the terms that ask for them (registry.takes_example).

    total = sum_k w_k * v_k over the terms of a `Reward` (v for a plain callable); each
    v_k must pass `check_value`, and so must the total (weights can overflow it).
    """
    num_terms = len(reward.names) if isinstance(reward, Reward) else 1
    zeros = (0.0,) * num_terms
    try:
        if isinstance(reward, Reward):
            raw = reward.term_values(prompt, completion, reference, example)
        else:
            wants = takes_example(reward)
            raw = (call_reward(reward, prompt, completion, reference, example, wants),)
    except PROCESS_STOPS:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - a verifier failure is data
        return STATUS_ERROR, 0.0, zeros, _truncate(f"{type(e).__name__}: {e}")
    values = []
    for k, value in enumerate(raw):
        status, number, message = check_value(value)
        if status != STATUS_OK:
            if isinstance(reward, Reward) and num_terms > 1:
                message = f"term {reward.names[k]!r} {message}"
            return status, 0.0, zeros, message
        values.append(number)
    if isinstance(reward, Reward):
        total = math.fsum(w * v for w, v in zip(reward.weights, values))
    else:
        total = values[0]
    if not math.isfinite(total):
        return STATUS_NONFINITE, 0.0, zeros, f"weighted sum is not finite: {total}"
    if abs(total) > FLOAT32_MAX:
        text = f"weighted sum {total!r} is beyond float32's range (rewards are float32)"
        return STATUS_NONFINITE, 0.0, zeros, text
    return STATUS_OK, total, tuple(values), None
