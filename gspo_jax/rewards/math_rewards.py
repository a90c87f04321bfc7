"""Math answer verifiers (GSM8K / MATH style) and answer-format rewards.

Data flow: completion text + dataset reference -> these registered rewards (host,
inside `scoring.score_batch`) -> rewards [B] -> advantages. Extraction and
equivalence rules live in `answers.py` (module docstring there); values below.

| name           | value                                                                  |
| -------------- | ---------------------------------------------------------------------- |
| `math`         | 1.0 iff the completion's final answer equals the reference's, else 0.0.  |
|                | Final answer: last `####`/`\\boxed{}` marker, else the last number in the |
|                | text (fallback). Equality: exact rationals (`answers.answers_match`).   |
| `math_strict`  | as `math` without the last-number fallback: no marker -> 0.0.           |
| `format`       | 1.0 iff the completion has exactly one `####`, the rest of its line is  |
|                | one number (`answers.parse_number`) and nothing but whitespace follows |
|                | that line; else 0.0. Correctness is not checked.                       |
| `boxed_format` | 1.0 iff the completion has exactly one top-level `\\boxed{...}` (braces |
|                | balanced) with non-empty content; else 0.0. The content may be symbolic. |

All raise ValueError for a reference with no answer (a data bug, counted as an
error by `score_batch`, never scored as a wrong completion).
"""

from __future__ import annotations

import re

from gspo_jax.rewards import answers
from gspo_jax.rewards.registry import register_reward

_BRACED_BOX_RE = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")


def math_correct(completion: str, reference: str, *, fallback: str | None) -> float:
    """1.0 iff extract_answer(completion, fallback) matches extract_reference_answer(reference)."""
    ref_answer = answers.extract_reference_answer(reference)
    predicted = answers.extract_answer(completion, fallback=fallback)
    return 1.0 if answers.answers_match(predicted, ref_answer) else 0.0


@register_reward("math")
def math_reward(prompt: str, completion: str, reference: str) -> float:
    """Final-answer correctness with the last-number fallback (see module docstring)."""
    del prompt
    return math_correct(completion, reference, fallback="last_number")


@register_reward("math_strict")
def math_strict_reward(prompt: str, completion: str, reference: str) -> float:
    """Final-answer correctness; only `####`/`\\boxed{}` answers count."""
    del prompt
    return math_correct(completion, reference, fallback=None)


@register_reward("format")
def format_reward(prompt: str, completion: str, reference: str) -> float:
    """1.0 for exactly one `#### <number>` that ends the completion, else 0.0."""
    del prompt, reference
    if completion.count("####") != 1:
        return 0.0
    after = completion.split("####", 1)[1]
    line, _, rest = after.partition("\n")
    if rest.strip():
        return 0.0
    return 1.0 if answers.parse_number(line.strip()) is not None else 0.0


@register_reward("boxed_format")
def boxed_format_reward(prompt: str, completion: str, reference: str) -> float:
    """1.0 for exactly one balanced, non-empty top-level `\\boxed{...}`, else 0.0."""
    del prompt, reference
    boxes = answers.top_level_boxes(completion)
    if len(boxes) != 1 or boxes[0][1] is None:
        return 0.0
    start = boxes[0][0]
    # `\boxed 5` has no braces: not the well-formed marker this reward asks for.
    if _BRACED_BOX_RE.match(completion, start) is None:
        return 0.0
    return 1.0 if boxes[0][1].strip() else 0.0
