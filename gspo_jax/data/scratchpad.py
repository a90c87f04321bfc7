"""Long additions with a written scratchpad: a task whose responses are long and vary in
length, where GSPO's argument (token-level noise accumulating over a long response) applies.

A question adds two numbers of d digits each, d drawn uniformly from [min_digits, max_digits]
(leading digit non-zero). The worked solution, which the warm start imitates and the RL
policy writes before its answer, goes column by column from the units, one line per
column with the carry-in written as a third term, then the sum after "####". For
"What is 4781 + 2959?":

    1+9=10
    8+5+1=14
    7+9+1=17
    4+2+1=7
    #### 7740

A column with a carry-out of 1 is followed by a column whose line has the "+1" term; the
last line's carry (if any) is the sum's leading digit. With the char-level tokenizer a
solution is at most 10·d + 4 tokens (every column carrying): d in [8, 25] gives 61 to 242
tokens in the generated data (mean 145), at most 254, before the end token; d in [4, 12],
33 to 124 (mean 73).

Records: ``id``, ``question``, ``answer`` (the worked solution; the supervised target), and
``final_answer`` (the sum, the reference the verifier compares with: `arith_exact` reads the
number after the solution's last "####"). Configs:

    pad8_25   d in [8, 25]: 20,000 train / 500 test (the scratchpad experiment's task)
    pad4_12   d in [4, 12]: shorter, for a quick look (20,000 / 500)

The imperfect teacher (`NoisyTeacher`) writes an erring record's solution with every carry
dropped (``worked_solution(a, b, drop_carries=True)``), so one slip early in a long response
decides the answer, and RL against the exact verifier has to unlearn it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds


@dataclasses.dataclass(eq=False)
class ScratchpadConfig(tfds.core.BuilderConfig):
    """Attributes:
    min_digits, max_digits: digits of each operand, drawn uniformly per question.
    num_train, num_test: examples per split (distinct questions, test first).
    seed: seed of the generator; the whole dataset is a function of the config."""

    min_digits: int = 8
    max_digits: int = 25
    num_train: int = 20_000
    num_test: int = 500
    seed: int = 0


SCRATCHPAD_CONFIGS = (
    ScratchpadConfig(
        name="pad8_25",
        description="a + b, both of d digits, d uniform in [8, 25]; worked column by column.",
        min_digits=8,
        max_digits=25,
    ),
    ScratchpadConfig(
        name="pad4_12",
        description="a + b, both of d digits, d uniform in [4, 12]; worked column by column.",
        min_digits=4,
        max_digits=12,
    ),
)


def worked_solution(a: int, b: int, *, drop_carries: bool = False) -> str:
    """The column-by-column solution of a + b (module docstring); with drop_carries, the
    careless student's: no "+1" term ever, each sum digit (x + y) mod 10."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    lines, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        lines.append(f"{x}+{y}" + ("+1" if carry else "") + f"={total}")
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


class SyntheticScratchpad(tfds.core.GeneratorBasedBuilder):
    """Long additions with worked solutions; registered in TFDS as ``synthetic_scratchpad``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[ScratchpadConfig]] = list(SCRATCHPAD_CONFIGS)
    DEFAULT_CONFIG_NAME = "pad8_25"

    def _log_download_bytes(self) -> None:  # nothing is downloaded (see arithmetic.py)
        pass

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "id": tfds.features.Text(),
                    "question": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "final_answer": tfds.features.Text(),
                }
            ),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated locally; nothing to download.
        problems = generate_problems(self.builder_config)
        num_test = self.builder_config.num_test
        return {
            "train": self._generate_examples("train", problems[num_test:]),
            "test": self._generate_examples("test", problems[:num_test]),
        }

    def _generate_examples(self, split: str, problems: list[dict[str, str]]):
        for i, problem in enumerate(problems):
            example_id = f"{split}-{i:05d}"
            yield example_id, {"id": example_id, **problem}
