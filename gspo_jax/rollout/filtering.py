"""DAPO's rollout-side options: dynamic sampling (dead groups dropped and refilled) and
overlong handling (the soft length penalty, the loss mask of truncated responses).

All host-side NumPy on one rollout's rewards and lengths (rollout/stage.py calls them between
scoring and the jitted advantages); nothing here changes a shape the jitted functions see.

  overlong_penalty(lengths, ...)        DAPO §3.4's soft overlong punishment, added to rewards
  zero_std_groups(rewards, valid, G)    groups whose (valid) rewards are all equal: "dead"
  select_groups(live, n)                which sampled groups fill a batch of n, and the padding
  DeadGroupWatch                        one warning when most groups stay dead step after step

A dead group (every valid reward equal, or fewer than two valid) has zero advantage under group
normalisation, so it adds nothing to a GSPO/GRPO gradient; when every group is dead the
gradient is exactly zero and the run trains nothing.

Shapes: N groups (prompts), G responses each, B = N·G.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def overlong_penalty(lengths_B, *, max_length: int, buffer_len: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4, eq. 13), f32 [B], <= 0:

        L_max = max_length (response_length), L_b = buffer_len, L = a response's length
        (its tokens, the end token included, as verl counts them)
        penalty(L) = 0                                   L <= L_max − L_b
                   = ((L_max − L_b) − L) / L_b · factor   L_max − L_b < L <= L_max

    so it falls linearly from 0 to −factor at L = L_max. buffer_len = 0 is no penalty.
    """
    lengths_B = np.asarray(lengths_B, np.float64)
    if buffer_len <= 0 or factor == 0:
        return np.zeros(lengths_B.shape, np.float32)
    expected = max_length - buffer_len
    penalty = np.minimum((expected - lengths_B) / buffer_len * factor, 0.0)
    return penalty.astype(np.float32)


def zero_std_groups(rewards_B, valid_B, group_size: int) -> np.ndarray:
    """bool [N]: groups whose valid rewards all equal (zero std), or with fewer than two valid
    rewards: the groups whose advantages group normalisation sets to zero."""
    rewards_NG = np.asarray(rewards_B).reshape(-1, group_size)
    valid_NG = np.asarray(valid_B, bool).reshape(-1, group_size)
    high = np.where(valid_NG, rewards_NG, -np.inf).max(axis=1)
    low = np.where(valid_NG, rewards_NG, np.inf).min(axis=1)
    return (valid_NG.sum(axis=1) < 2) | (high == low)


def select_groups(live_R: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The groups of a dynamic-sampling batch, from every group sampled this step in order
    (`live_R` bool [R]: not dead). Returns (index [num_groups] into the R groups, pad
    [num_groups] bool): the first `num_groups` live groups, in sampling order; when there
    are fewer, the rest is filled with the first dead groups, marked `pad` (the rollout
    gives them no loss and no weight in the advantage statistics). The batch keeps its
    shape either way, so the jitted train step never sees a new one."""
    live_R = np.asarray(live_R, bool)
    live, dead = np.flatnonzero(live_R), np.flatnonzero(~live_R)
    kept = live[:num_groups]
    short = num_groups - kept.size
    if short > dead.size:
        raise ValueError(
            f"dynamic sampling: {live_R.size} groups sampled cannot fill {num_groups} "
            f"({kept.size} live, {dead.size} dead)"
        )
    index = np.concatenate([kept, dead[:short]]).astype(np.int64)
    pad = np.arange(num_groups) >= kept.size
    return index, pad


def group_rows(index_N: np.ndarray, group_size: int) -> np.ndarray:
    """Row indices [N·G] of groups `index_N` (the G responses of group n are rows n·G...)."""
    return (np.asarray(index_N)[:, None] * group_size + np.arange(group_size)).reshape(-1)


class DeadGroupWatch:
    """Warns once when at least `threshold` of the train batch's groups are dead for
    `patience` RL steps in a row: `reward/frac_zero_std`, or with dynamic sampling the
    padding it could not replace (`rollout/groups_short`). Those groups have zero advantage,
    so most (at 1.0: all) of the batch trains nothing, and no loss value says so."""

    def __init__(
        self,
        *,
        threshold: float = 0.8,
        patience: int = 5,
        dynamic: bool = False,
        constant_steps: int = 2,
    ):
        self.threshold, self.patience, self.dynamic = threshold, patience, dynamic
        self.in_a_row = 0
        self.warned = False
        # A reward with one value over the whole batch in each of the run's first steps is
        # more likely a broken verifier or a data/reward mismatch than hard prompts: said
        # after `constant_steps` steps, before the dead-group warning's `patience`.
        self.constant_steps = constant_steps
        self.constant_in_a_row = 0
        self.constant_value = None
        self.constant_warned = False

    def constant_reward(self, step: int, metrics: dict) -> str | None:
        """The warning's text when every response of each of the run's first
        `constant_steps` RL steps (1, 2, ...) had one reward value (also logged), else None."""
        std, mean = metrics.get("reward/std"), metrics.get("reward/mean")
        if self.constant_warned or std is None or step > self.constant_steps:
            return None
        same = std == 0 and (self.constant_in_a_row == 0 or mean == self.constant_value)
        self.constant_in_a_row = self.constant_in_a_row + 1 if same else int(std == 0)
        self.constant_value = mean
        if self.constant_in_a_row < self.constant_steps:
            return None
        self.constant_warned = True
        message = (
            f"RL step {step}: the reward was {mean:g} for every response of each of the "
            f"first {self.constant_in_a_row} RL steps (reward/std = 0): nothing trains while "
            "it stays constant. Check that config.reward.spec scores this task's answers "
            "(the verifier, the data's reference format) and that the model can get some "
            "right. Warned once per run."
        )
        log.warning("%s", message)
        return message

    def dead_fraction(self, metrics: dict) -> float | None:
        if not self.dynamic:
            return metrics.get("reward/frac_zero_std")
        short, kept = metrics.get("rollout/groups_short"), metrics.get("rollout/groups_kept")
        return None if short is None else short / max(short + kept, 1)

    def after_step(self, step: int, metrics: dict) -> str | None:
        """The warning's text the first time the condition holds (also logged), else None;
        a reward constant over the first steps is said first (`constant_reward`)."""
        constant = self.constant_reward(step, metrics)
        frac = self.dead_fraction(metrics)
        if frac is None or self.warned:
            return constant
        self.in_a_row = self.in_a_row + 1 if frac >= self.threshold else 0
        if self.in_a_row < self.patience:
            return constant
        self.warned = True
        if self.dynamic:
            what = f"rollout/groups_short = {frac:.0%} of the batch, after dynamic sampling"
            advice = "raise dynamic_sampling_max_rounds, "
        else:
            what = f"reward/frac_zero_std = {frac:.2f}"
            advice = "set dynamic_sampling=true (DAPO: refill the batch with live groups), "
        message = (
            f"RL step {step}: at least {self.threshold:.0%} of the groups had identical "
            f"rewards ({what}) for {self.in_a_row} RL steps in a row. Such a group has zero "
            "advantage and gives no gradient; at 100% the policy does not move at all. "
            f"Consider: {advice}a larger num_return_sequences_in_group, a higher "
            "sampling.temperature, a reward with partial credit, or data matched to the "
            "model (all right or all wrong is equally dead). Warned once per run."
        )
        log.warning("%s", message)
        return message
