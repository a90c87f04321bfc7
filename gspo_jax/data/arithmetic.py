"""Synthetic verifiable arithmetic task as a TFDS builder (array_record, generated locally).

This is the task behind the project's default laptop run: a tiny transformer is warm-started
with supervised answers, then trained with RL against an exact-match verifier. Records are
generated deterministically from the config's seed (no download, no TensorFlow) and written as
array_record so they can be read with ``tfds.data_source`` / grain.

Each record: ``id`` ("train-00042"), ``question`` ("What is 47 + 385?"), ``answer`` ("432",
the integer as a decimal string, never negative). The model is taught to answer
``#### 432`` (see ``gspo_jax.data.pipeline.format_answer``).

Configs (operands are drawn uniformly without replacement from [0, 10**digits - 1]):

    add2   a + b, 2-digit operands. Only 10,000 distinct questions exist: 9,500 train / 500 test
           (every question appears exactly once).
    add3   a + b, 3-digit operands: 20,000 train / 500 test.
    mixed  op uniform over {+, -, *}: + and - with 3-digit operands (a >= b for -, so answers
           are non-negative), * with 2-digit operands: 20,000 train / 500 test.

A caller may pass its own ``ArithmeticConfig(name=..., ops=..., digits=..., ...)`` as
``config=`` to the builder. Train and test are disjoint: all questions of a config are distinct
and the first ``num_test`` of the seeded sequence form the test split.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from gspo_jax.data.local_builder import LocalBuilder

_SUPPORTED_OPS = ("+", "-", "*")


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(tfds.core.BuilderConfig):
    """Difficulty of the synthetic task.

    Attributes:
      ops: operators to draw from (uniformly), a subset of ``+``, ``-``, ``*``.
      digits: maximum operand digits for each op (same length as ``ops``).
      num_train: examples in the train split.
      num_test: examples in the test split.
      seed: seed of the generator; the whole dataset is a function of the config.
    """

    ops: tuple[str, ...] = ("+",)
    digits: tuple[int, ...] = (2,)
    num_train: int = 20_000
    num_test: int = 500
    seed: int = 0


ARITHMETIC_CONFIGS = (
    ArithmeticConfig(
        name="add2",
        description="a + b with operands in [0, 99]; all 10,000 questions, 9,500 train/500 test.",
        ops=("+",),
        digits=(2,),
        num_train=9_500,
        num_test=500,
    ),
    ArithmeticConfig(
        name="add3",
        description="a + b with operands in [0, 999]; 20,000 train / 500 test.",
        ops=("+",),
        digits=(3,),
    ),
    ArithmeticConfig(
        name="mixed",
        description="+ and - (a >= b) on [0, 999], * on [0, 99]; 20,000 train / 500 test.",
        ops=("+", "-", "*"),
        digits=(3, 3, 2),
    ),
)


def _pool_size(op: str, digits: int) -> int:
    """Number of distinct (a, b) pairs for an op: m^2, or m(m+1)/2 for a >= b under '-'."""
    m = 10**digits
    return m * (m + 1) // 2 if op == "-" else m * m


def _decode_pairs(op: str, digits: int, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maps pool codes to operand pairs; a bijection onto the op's pool."""
    m = 10**digits
    if op != "-":
        return codes // m, codes % m
    # Triangular numbering of pairs with b <= a: code = a(a+1)/2 + b.
    a = np.floor((np.sqrt(8.0 * codes + 1.0) - 1.0) / 2.0).astype(np.int64)
    # Float sqrt can be off by one near perfect squares; correct exactly in integers.
    a = np.where(a * (a + 1) // 2 > codes, a - 1, a)
    a = np.where((a + 1) * (a + 2) // 2 <= codes, a + 1, a)
    return a, codes - a * (a + 1) // 2


def generate_problems(config: ArithmeticConfig) -> list[dict[str, str]]:
    """All problems of a config, test split first: ``num_test + num_train`` distinct questions.

    Deterministic in ``config``: the op of each problem is drawn uniformly, then the operand
    pairs of each op are drawn without replacement from that op's pool.
    """
    if len(config.ops) != len(config.digits) or not config.ops:
        raise ValueError(
            f"ArithmeticConfig {config.name!r}: ops {config.ops} and digits {config.digits} "
            "must be non-empty and of the same length."
        )
    for op, d in zip(config.ops, config.digits):
        if op not in _SUPPORTED_OPS:
            raise ValueError(
                f"ArithmeticConfig {config.name!r}: unknown op {op!r}; use {_SUPPORTED_OPS}."
            )
        if not 1 <= d <= 9:
            raise ValueError(f"ArithmeticConfig {config.name!r}: digits={d} not in [1, 9].")
    n = config.num_train + config.num_test
    rng = np.random.default_rng(config.seed)
    op_index = rng.integers(len(config.ops), size=n)
    a = np.zeros(n, np.int64)
    b = np.zeros(n, np.int64)
    for k, (op, d) in enumerate(zip(config.ops, config.digits)):
        rows = np.flatnonzero(op_index == k)
        pool = _pool_size(op, d)
        if len(rows) > pool:
            raise ValueError(
                f"ArithmeticConfig {config.name!r}: {len(rows)} problems requested for op "
                f"{op!r} with {d} digits, but only {pool} distinct ones exist; lower "
                "num_train/num_test or raise digits."
            )
        a[rows], b[rows] = _decode_pairs(op, d, rng.choice(pool, size=len(rows), replace=False))
    problems = []
    for i in range(n):
        op = config.ops[op_index[i]]
        x, y = int(a[i]), int(b[i])
        value = x + y if op == "+" else x - y if op == "-" else x * y
        problems.append({"question": f"What is {x} {op} {y}?", "answer": str(value)})
    return problems


class SyntheticArithmetic(LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """Verifiable arithmetic questions; registered in TFDS as ``synthetic_arithmetic``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[ArithmeticConfig]] = list(ARITHMETIC_CONFIGS)
    DEFAULT_CONFIG_NAME = "add3"

    def _info(self) -> tfds.core.DatasetInfo:
        return self._text_info(__doc__, ("id", "question", "answer"))

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated locally; nothing to download.
        return self._test_first(
            generate_problems(self.builder_config), self.builder_config.num_test
        )
