"""The rollout's scoring: responses decoded to text, scored by the reward's verifiers (in
worker processes, with timeouts and the invalid-reward rule), the accuracy reward beside it.
"""

from __future__ import annotations

import json

import numpy as np

from gspo_jax import sharding as sharding_lib
from gspo_jax.config.specs import RewardSpec
from gspo_jax.rewards import build_reward, score_batch
from gspo_jax.rewards.scoring import HARD_FAILURES, FailureLog, raise_all_failed


def decode_responses(tokenizer, tokens_BT: np.ndarray, mask_BT: np.ndarray) -> list[str]:
    """Response text per row: the valid tokens, special tokens (the end token) removed."""
    rows = [row[m > 0].tolist() for row, m in zip(np.asarray(tokens_BT), np.asarray(mask_BT))]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def examples_of(batch, repeat: int = 1) -> list[dict] | None:
    """Each row's fields as a dict, repeated `repeat` times (G responses per prompt), from
    a prompt batch's `example` texts (data/pipeline.py); None where the data carry none."""
    if "example" not in batch:
        return None
    rows = [json.loads(text) for text in batch["example"]]
    return [row for row in rows for _ in range(repeat)]


class Scorer:
    """A reward function bound to its failure rule, timeout and worker pool.

    Each distinct failure message is logged once. With `max_failed_batches=k`, k batches
    in a row in which every call failed in a hard way (raised, non-number, NaN:
    `rewards.HARD_FAILURES`), counted over all processes, raise `rewards.RewardError` on
    every process (one small all-reduce per call): such a batch has no reward signal at
    all, so a verifier that keeps failing trains nothing."""

    def __init__(
        self,
        reward_fn,
        invalid_reward: str,
        *,
        timeout_s=None,
        pool=None,
        max_failed_batches=None,
        in_process_timeout_s=None,
    ):
        self.reward_fn = reward_fn
        self.invalid_reward = invalid_reward
        self.timeout_s = timeout_s
        self.in_process_timeout_s = in_process_timeout_s
        self.pool = pool
        self.max_failed_batches = max_failed_batches or None
        self.failed_batches = 0  # consecutive batches in which every call failed
        self.what = repr(getattr(reward_fn, "spec", getattr(reward_fn, "__name__", reward_fn)))
        self.log_failures = FailureLog(self.what)

    @classmethod
    def for_reward(cls, spec: RewardSpec, pool) -> Scorer:
        """The rollout's reward (`spec.spec`), its failure rule and failure limit."""
        return cls(
            build_reward(spec.spec),
            spec.invalid_reward,
            timeout_s=spec.timeout_s,
            pool=pool,
            max_failed_batches=spec.max_failed_rollouts,
            in_process_timeout_s=spec.in_process_timeout_s,
        )

    @classmethod
    def for_accuracy(cls, spec: RewardSpec, pool) -> Scorer:
        """The accuracy reward (`spec.accuracy`): a failed verification counts as wrong (0),
        never as missing."""
        return cls(
            build_reward(spec.accuracy),
            "zero",
            timeout_s=spec.timeout_s,
            pool=pool,
            in_process_timeout_s=spec.in_process_timeout_s,
        )

    @property
    def takes_example(self) -> bool:
        """Whether a term of the reward asks for the example's fields."""
        return bool(getattr(self.reward_fn, "takes_example", False))

    def score(self, prompts, completions, references, examples=None):
        """(rewards [B] f32, valid [B] bool, stats): see score_responses. `examples`: a
        callable giving the B rows' fields (`examples_of`), called only when a term of the
        reward asks for them, or the list itself."""
        if callable(examples):
            examples = examples() if self.takes_example else None
        rewards, valid, stats = score_responses(
            self.reward_fn,
            prompts,
            completions,
            references,
            examples=examples,
            invalid_reward=self.invalid_reward,
            timeout_s=self.timeout_s,
            pool=self.pool,
            in_process_timeout_s=self.in_process_timeout_s,
        )
        self.log_failures(stats)
        if self.max_failed_batches is not None:
            hard = sum(stats.get(k, 0) for k in HARD_FAILURES)
            items, failed = sharding_lib.host_sum(np.array([len(rewards), hard], np.int64))
            all_failed = bool(items) and failed == items
            self.failed_batches = self.failed_batches + 1 if all_failed else 0
            if self.failed_batches >= self.max_failed_batches:
                raise_all_failed(int(items), self.failed_batches, stats, what=self.what)
        return rewards, valid, stats


def score_responses(
    reward_fn,
    prompts,
    completions,
    references,
    *,
    invalid_reward: str,
    timeout_s: float | None,
    pool=None,
    in_process_timeout_s: float | None = None,
    examples=None,
):
    """Rewards [B] f32, validity [B] bool and the scoring stats.

    With invalid_reward="mask" a failed item is invalid (excluded downstream); with "zero"
    it is valid with reward 0. Either way its reward is 0.0, never NaN.
    """
    rewards_B, stats = score_batch(
        reward_fn,
        list(prompts),
        list(completions),
        list(references),
        timeout_s=timeout_s,
        pool=pool,
        in_process_timeout_s=in_process_timeout_s,
        examples=examples,
    )
    ok_B = np.asarray(stats["ok_B"], bool)
    rewards_B = np.where(ok_B, rewards_B, 0.0).astype(np.float32)
    valid_B = ok_B if invalid_reward == "mask" else np.ones_like(ok_B)
    return rewards_B, valid_B, stats
