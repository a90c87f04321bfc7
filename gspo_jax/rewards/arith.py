"""Exact checker for the synthetic multi-digit arithmetic task (and a partial-credit variant).

Data flow: the synthetic task (gspo_jax/data) gives a question and an integer reference
string; the policy's completion text -> `arith_exact` (host, inside `score_batch`)
-> rewards [B].

What counts as correct for `arith_exact` (1.0, else 0.0):

1. The stated answer is, as in `math`, the content of the last `####` or top-level
   `\\boxed{}` marker (`answers.find_marker`); with no marker, the whole completion
   (stripped) is the answer: the completion may be just the number. There is no
   last-number fallback, so `12 + 30 = 42` without a marker is not an answer.
2. That answer must be one number by `answers.parse_number` (whole string: sign,
   thousands groups, one trailing `.`, `$` and `%` decorations are accepted; units,
   words and expressions are not) whose value equals the reference integer exactly
   (`42`, `42.`, `#### 42`, `\\boxed{42}`, `42.0` and `0042` are all correct for "42";
   `42 apples`, `4 2` and `41.9` are not).
3. The reference (a bare integer string, or a GSM8K-style solution ending in
   `#### n`) must be an integer; anything else raises ValueError naming it.

`arith_digits` (partial credit, not a default; opt in with e.g. "arith_digits" or
"arith_exact:1.0,arith_digits:0.1"): when the stated answer is an integer with the
reference's sign, the fraction of digit positions that agree when both absolute values
are written in base 10 and aligned at the units digit, over the longer length:
ref 1234, answer 1284 -> 3/4; answer 234 -> 3/4; answer 12345 -> 0/5. Otherwise 0.0.
It is 1.0 exactly when `arith_exact` is.
"""

from __future__ import annotations

from fractions import Fraction

from gspo_jax.rewards import answers
from gspo_jax.rewards.registry import register_reward


def reference_integer(reference: str) -> int:
    """The reference's integer answer; ValueError (naming it) if it is not an integer."""
    answer = answers.extract_reference_answer(reference)
    value = answers.parse_number(answer)
    if value is None or value.denominator != 1:
        raise ValueError(f"arithmetic reference is not an integer: {reference[-200:]!r}")
    return int(value)


def stated_value(completion: str) -> Fraction | None:
    """The number the completion states (rule 1 and 2 above), or None."""
    marker = answers.find_marker(completion)
    answer = completion.strip() if marker is None else marker[1]
    if not answer:
        return None
    return answers.parse_number(answer)


@register_reward("arith_exact")
def arith_exact_reward(prompt: str, completion: str, reference: str) -> float:
    """1.0 iff the stated answer equals the integer reference (module docstring), else 0.0."""
    del prompt
    target = reference_integer(reference)
    return 1.0 if stated_value(completion) == target else 0.0


@register_reward("arith_digits")
def arith_digits_reward(prompt: str, completion: str, reference: str) -> float:
    """Partial credit: matching units-aligned digits / max(#digits), sign must agree."""
    del prompt
    target = reference_integer(reference)
    value = stated_value(completion)
    if value is None or value.denominator != 1 or (value < 0) != (target < 0):
        return 0.0
    got, want = str(abs(int(value))), str(abs(target))
    width = max(len(got), len(want))
    got, want = got.rjust(width, " "), want.rjust(width, " ")
    return sum(g == w for g, w in zip(got, want)) / width
