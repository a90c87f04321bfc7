"""Long additions with a written scratchpad: a task whose responses are long and vary in
length, where GSPO's argument (token-level noise accumulating over a long response) applies.

A question adds two numbers of d digits each, d drawn uniformly from [min_digits, max_digits]
(leading digit non-zero). The worked solution, which the warm start imitates and the RL
policy writes before its answer, goes column by column from the units. Each line restates
the digits still to add, then adds their last column with the carry-in as a third term;
the sum follows "####". For "What is 4781 + 2959?":

    4781+2959: 1+9=10
    478+295: 8+5+1=14
    47+29: 7+9+1=17
    4+2: 4+2+1=7
    #### 7740

Restating the operands keeps every step local: a line copies the previous one less a
digit, and the digits to add sit just before "+" and ":". A small model learns this (0.8M
parameters: 36 % exact after 500 supervised steps). A format that fetches the i-th digit
from the end of the question instead was not learned: the same model after 1,200 steps
got the first two columns right and then drifted, with 0.5 % exact answers.

Length: a line has at most 2·k + 12 tokens (newline included) when k digits are left, so
a solution has at most d² + 14·d + 4 tokens (every column carrying). d in [4, 10] gives 65
to 244 tokens in the generated data (mean 145), d in [2, 6] 31 to 124 (mean 74), before
the end token.

Records: ``id``, ``question``, ``answer`` (the worked solution; the supervised target), and
``final_answer`` (the sum, the reference the verifier compares with: `arith_exact` reads the
number after the solution's last "####"). Configs:

    pad4_10   d in [4, 10]: 20,000 train / 500 test (--scale=gpu)
    pad2_6    d in [2, 6]: 20,000 train / 500 test (--scale=cpu)

The imperfect teacher (`NoisyTeacher`) writes an erring record's solution with every carry
dropped (``worked_solution(a, b, drop_carries=True)``), so one slip early in a long response
decides the answer, and RL against the exact verifier has to unlearn it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from gspo_jax.data.local_builder import LocalBuilder


@dataclasses.dataclass(eq=False)
class ScratchpadConfig(tfds.core.BuilderConfig):
    """Attributes:
    min_digits, max_digits: digits of each operand, drawn uniformly per question.
    num_train, num_test: examples per split (distinct questions, test first).
    seed: seed of the generator; the whole dataset is a function of the config."""

    min_digits: int = 4
    max_digits: int = 10
    num_train: int = 20_000
    num_test: int = 500
    seed: int = 0


SCRATCHPAD_CONFIGS = (
    ScratchpadConfig(
        name="pad4_10",
        description="a + b, both of d digits, d uniform in [4, 10]; worked column by column.",
        min_digits=4,
        max_digits=10,
    ),
    ScratchpadConfig(
        name="pad2_6",
        description="a + b, both of d digits, d uniform in [2, 6]; worked column by column.",
        min_digits=2,
        max_digits=6,
    ),
)


def worked_solution(a: int, b: int, *, drop_carries: bool = False) -> str:
    """The column-by-column solution of a + b (module docstring); with drop_carries, the
    careless student's: no "+1" term ever, each sum digit (x + y) mod 10."""
    n = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(n), str(b).zfill(n)
    lines, digits, carry = [], [], 0
    for i in range(n):
        x, y = int(xs[n - 1 - i]), int(ys[n - 1 - i])
        total = x + y + carry
        lines.append(
            f"{xs[: n - i]}+{ys[: n - i]}: {x}+{y}" + ("+1" if carry else "") + f"={total}"
        )
        digits.append(total % 10)
        carry = 0 if drop_carries else total // 10
    if carry:
        digits.append(carry)
    answer = "".join(map(str, digits[::-1])).lstrip("0") or "0"
    return "\n".join(lines + [f"#### {answer}"])


def generate_problems(config: ScratchpadConfig) -> list[dict[str, str]]:
    """num_test + num_train distinct questions of the config, test split first."""
    if not 1 <= config.min_digits <= config.max_digits:
        raise ValueError(
            f"ScratchpadConfig {config.name!r}: need 1 <= min_digits <= max_digits, got "
            f"{config.min_digits}, {config.max_digits}"
        )
    rng = np.random.default_rng(config.seed)
    n = config.num_test + config.num_train
    seen, problems = set(), []
    while len(problems) < n:
        d = int(rng.integers(config.min_digits, config.max_digits + 1))
        a, b = (
            int("".join(map(str, [rng.integers(1, 10), *rng.integers(0, 10, d - 1)]))) for _ in "ab"
        )
        if (a, b) in seen:
            continue
        seen.add((a, b))
        problems.append(
            {
                "question": f"What is {a} + {b}?",
                "answer": worked_solution(a, b),
                "final_answer": str(a + b),
            }
        )
    return problems


class SyntheticScratchpad(LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """Long additions with worked solutions; registered in TFDS as ``synthetic_scratchpad``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[ScratchpadConfig]] = list(SCRATCHPAD_CONFIGS)
    DEFAULT_CONFIG_NAME = "pad4_10"

    def _info(self) -> tfds.core.DatasetInfo:
        return self._text_info(__doc__, ("id", "question", "answer", "final_answer"))

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated locally; nothing to download.
        return self._test_first(
            generate_problems(self.builder_config), self.builder_config.num_test
        )
