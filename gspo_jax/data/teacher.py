"""An imperfect teacher for the supervised warm start: answers with the carries dropped.

Why: RL with a verifier can do what imitation cannot, namely exceed its teacher. The default
run warm-starts the policy on demonstrations in which a fraction `error_rate` of the
addition problems that need a carry are answered as a careless student would, adding digit
by digit and dropping every carry (47 + 85 -> "22" instead of "132"). The warm-started policy
inherits the mistake; RL against the exact verifier (`arith_exact`) has to unlearn it, which
shows up as held-out accuracy rising well above where imitation left it. Only the warm-start
demonstrations change: RL prompts, references and the test split are the true task.

`NoisyTeacher(source, error_rate, seed)` wraps a random-access source (a TFDS data source or
any sequence of records): same length, same records, except that the `answer` of a
deterministic `error_rate` fraction of carrying additions (chosen by a hash of the record
index and `seed`) is replaced by the carry-dropped sum (on the scratchpad task, whose answer
is a worked solution, by the solution written with every carry dropped). Other questions
pass through.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

from gspo_jax.data.pipeline import decode_record
from gspo_jax.data.scratchpad import worked_solution

_ADDITION = re.compile(r"What is (\d+) \+ (\d+)\?")


def drop_carry_sum(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry dropped: each digit (x + y) mod 10."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def needs_carry(a: int, b: int) -> bool:
    return drop_carry_sum(a, b) != a + b


class NoisyTeacher(Sequence):
    """A source whose carrying additions are answered wrongly at rate `error_rate`."""

    def __init__(self, source: Sequence[Any], error_rate: float, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"teacher error_rate={error_rate} must be in [0, 1]")
        self.source = source
        self.error_rate = float(error_rate)
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.source)

    def _errs(self, index: int) -> bool:
        # A stable hash (not Python's salted hash): the same records err on every run.
        h = zlib.crc32(f"{self.seed}:{index}".encode()) / 0xFFFFFFFF
        return h < self.error_rate

    def _corrupt(self, index: int, record) -> dict[str, Any]:
        record = decode_record(record)
        match = _ADDITION.fullmatch(str(record.get("question", "")))
        if match and self._errs(index):
            a, b = int(match[1]), int(match[2])
            if needs_carry(a, b):
                worked = "####" in str(record.get("answer", ""))  # the scratchpad task
                record["answer"] = (
                    worked_solution(a, b, drop_carries=True)
                    if worked
                    else str(drop_carry_sum(a, b))
                )
        return record

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._corrupt(index, self.source[index])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        getitems = getattr(self.source, "__getitems__", None)
        records = getitems(indices) if getitems is not None else [self.source[i] for i in indices]
        return [self._corrupt(i, r) for i, r in zip(indices, records)]
