"""Majority voting over sampled answers (maj@k): what each accuracy reward counts as "the
answer", and the vote itself.

Data flow: k sampled completions of one held-out prompt (host, decoded) -> the accuracy
reward's `answer_key` per completion -> `majority_vote` picks one completion -> its accuracy
score is the prompt's maj@k (trainer/evaluation.py). Scoring the chosen completion instead of
comparing the voted answer with the reference again works because the built-in rewards
depend on a completion only through its answer: completions with one key score alike.

Keys (`answer_key`): the answer a reward would grade, made comparable, or None (no answer):

| reward                      | the answer                                                   |
| --------------------------- | ------------------------------------------------------------ |
| `math`                      | `answers.extract_answer` (marker, else the last number)      |
| `math_strict`               | `answers.extract_answer` without the last-number fallback    |
| `arith_exact`, `arith_digits` | `arith.stated_value` (marker, else the whole completion)   |

An answer with a numeric value (`answers.answer_value`) is keyed by that exact Fraction, so
`0.5`, `1/2` and `\\frac{1}{2}` are one vote; a non-numeric answer by its
`answers.normalize_answer_text` form (empty: no answer). Register the key of your own
reward with `@register_answer("name")`; maj@k needs one for `reward.accuracy`'s first term.

The vote (`majority_vote`): completions without an answer do not vote; the answer with the
most votes wins; a tie goes to the tied answer that some completion gave first (the lowest
sample index). With no answer at all there is no winner, and maj@k counts the prompt wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from gspo_jax.registry import Registry
from gspo_jax.rewards import answers, arith

AnswerKeyFn = Callable[[str], Hashable | None]

# reward name -> completion -> hashable answer (None: no answer).
ANSWER_KEYS: Registry[AnswerKeyFn] = Registry("answer key")


def register_answer(reward_name: str) -> Callable[[AnswerKeyFn], AnswerKeyFn]:
    """Decorator registering `fn(completion) -> hashable | None` as the answer that reward
    `reward_name` grades (the key maj@k votes with)."""
    return ANSWER_KEYS.decorator(reward_name)


def canonical_answer(answer: str | None) -> Hashable | None:
    """("value", Fraction) for a numeric answer, ("text", normalised) for another, or None."""
    if answer is None:
        return None
    value = answers.answer_value(answer)
    if value is not None:
        return ("value", value)
    text = answers.normalize_answer_text(answer)
    return ("text", text) if text else None


@register_answer("math")
def math_answer(completion: str) -> Hashable | None:
    return canonical_answer(answers.extract_answer(completion, fallback="last_number"))


@register_answer("math_strict")
def math_strict_answer(completion: str) -> Hashable | None:
    return canonical_answer(answers.extract_answer(completion, fallback=None))


def _stated(completion: str) -> Hashable | None:
    value = arith.stated_value(completion)
    return None if value is None else ("value", value)


register_answer("arith_exact")(_stated)
register_answer("arith_digits")(_stated)


def answer_key_fn(accuracy_spec: str) -> AnswerKeyFn:
    """The answer key of a reward spec ("math", "math:1.0,format:0.1"): its first term's.
    ValueError naming the term and the registered keys when it has none."""
    first = accuracy_spec.split(",")[0].partition(":")[0].strip()
    if first not in ANSWER_KEYS:
        raise ValueError(
            f"reward {first!r} has no registered answer for majority voting (maj@k); "
            f"rewards with one: {sorted(ANSWER_KEYS)}. Register it with "
            "@gspo_jax.rewards.voting.register_answer"
        )
    return ANSWER_KEYS[first]


def majority_vote(keys: Sequence[Hashable | None]) -> int | None:
    """Index of the first completion giving the majority answer of `keys` (None keys do not
    vote; a tie goes to the answer given first), or None when no completion answered."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, key in enumerate(keys):
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    # max() keeps the first of equal maxima; `first` iterates in first-given order.
    winner = max(first, key=lambda k: counts[k])
    return first[winner]
