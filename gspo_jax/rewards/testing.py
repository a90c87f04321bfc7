"""TEST-ONLY verifiers that misbehave on purpose, for the tests of `scoring.score_batch`.

Not imported by `gspo_jax.rewards`: importing this module registers the names below.
They live in the package (not under tests/) because worker processes resolve rewards by
importing the registering module by name, and `gspo_jax.rewards.testing` is importable
in a spawned or forkserver child whatever its working directory and sys.path (the
subprocess tests rely on that too). Besides the tests, the experiment's noise floor
(experiments/gspo_vs_grpo/run.py) scores with `test_checksum`.

`test_chaos` acts on the completion text, so one batch can mix every failure kind:

| completion       | behaviour                                                  |
| ---------------- | ---------------------------------------------------------- |
| "ok:<x>"         | returns float(x)                                           |
| "raise"          | raises RuntimeError                                        |
| "nan" / "inf"    | returns float("nan") / float("inf")                        |
| "str"            | returns the string "1.0" (non-numeric)                     |
| "none"           | returns None (non-numeric)                                 |
| "sleep"          | time.sleep(1000)                                           |
| "nap"            | time.sleep(1), then returns 1.0 (a slow verifier)          |
| "spin"           | `while True: pass`                                         |
| "regex"          | catastrophic backtracking inside `re` (C code, holds GIL)  |
| "exit"           | os._exit(3): the worker process dies                       |
| "huge"           | returns 10**400 (an int too large for float64)             |
| "sysexit"        | calls sys.exit(1)                                          |

Anything else raises ValueError.
"""

from __future__ import annotations

import os
import re
import sys
import time

from gspo_jax.rewards.registry import register_reward

# (a+)+$ on "aaaa...b" backtracks 2^n ways; n=40 runs for hours.
_CATASTROPHIC_RE = re.compile(r"(a+)+$")


@register_reward("test_chaos")
def chaos_reward(prompt: str, completion: str, reference: str) -> object:
    """Misbehaves as the completion says (table in the module docstring)."""
    del prompt, reference
    if completion.startswith("ok:"):
        return float(completion[3:])
    if completion == "raise":
        raise RuntimeError("deliberate failure")
    if completion in ("nan", "inf"):
        return float(completion)
    if completion == "str":
        return "1.0"
    if completion == "none":
        return None
    if completion == "sleep":
        time.sleep(1000)
    if completion == "nap":
        time.sleep(1.0)
        return 1.0
    if completion == "spin":
        while True:
            pass
    if completion == "regex":
        return float(_CATASTROPHIC_RE.match("a" * 40 + "b") is not None)
    if completion == "exit":
        os._exit(3)
    if completion == "huge":
        return 10**400
    if completion == "sysexit":
        sys.exit(1)
    raise ValueError(f"test_chaos: unknown behaviour {completion!r}")


@register_reward("test_raise")
def raise_reward(prompt: str, completion: str, reference: str) -> float:
    """Always raises."""
    raise RuntimeError("deliberate failure")


@register_reward("test_nan")
def nan_reward(prompt: str, completion: str, reference: str) -> float:
    """Always NaN."""
    return float("nan")


@register_reward("test_const")
def const_reward(prompt: str, completion: str, reference: str) -> float:
    """float(reference): a trivially cheap verifier, for overhead measurements."""
    return float(reference)


@register_reward("test_checksum")
def checksum_reward(prompt: str, completion: str, reference: str) -> float:
    """(Σ code points of the completion mod 7) / 6: a deterministic function of the response
    text that varies within a group, so advantages and gradients are non-zero (for tests
    comparing whole RL steps)."""
    del prompt, reference
    return (sum(map(ord, completion)) % 7) / 6.0
