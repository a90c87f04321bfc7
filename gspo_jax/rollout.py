"""One rollout's host-side glue: responses -> text -> rewards -> advantages -> train batch.

Where it sits (DESIGN.md §4): train.py samples G responses per prompt with
`sampling.sample`, then calls these pieces in order:

  prompts = bucket_prompts(...)                    host, fixed compiled widths
  completions = decode_responses(...)              host, tokenizer
  rewards, valid, stats = score_responses(...)     host, verifier worker pool
  advantages, running = advantage_fn(...)          jitted, sharded like the batch

Invalid rewards (a verifier that raised or timed out, NaN, non-numeric) follow the
config's `invalid_reward` rule: "mask" excludes the response from group statistics and
gives it advantage 0 (so it neither pushes nor pulls the policy); "zero" scores it 0.
Both are counted in the metrics.

Shapes: N prompts, G samples each, B = N·G responses, P prompt tokens, T response tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import advantages as advantages_lib
from gspo_jax import objectives, sampling
from gspo_jax.config import normalize_reward_norm
from gspo_jax.rewards import score_batch


def bucket_prompts(tokens_NP: np.ndarray, mask_NP: np.ndarray, buckets) -> tuple:
    """Drop leading all-padding columns down to `sampling.choose_bucket`'s width.

    Done on the host and agreed across processes (every process must feed the same width),
    so each compiled shape comes from the fixed bucket list: a new prompt batch of a known
    bucket never recompiles, in the sampler or in the train step.
    """
    longest = int(mask_NP.sum(axis=1).max())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        longest = int(np.max(multihost_utils.process_allgather(np.int32(longest))))
    width = tokens_NP.shape[1]
    bucket = sampling.choose_bucket(longest, width, buckets)
    return tokens_NP[:, width - bucket :], mask_NP[:, width - bucket :]


def decode_responses(tokenizer, tokens_BT: np.ndarray, mask_BT: np.ndarray) -> list[str]:
    """Response text per row: the valid tokens, special tokens (the end token) removed."""
    rows = [row[m > 0].tolist() for row, m in zip(np.asarray(tokens_BT), np.asarray(mask_BT))]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


class Scorer:
    """A reward function bound to its failure rule, timeout and worker pool."""

    def __init__(self, reward_fn, invalid_reward: str, *, timeout_s=None, pool=None):
        self.reward_fn = reward_fn
        self.invalid_reward = invalid_reward
        self.timeout_s = timeout_s
        self.pool = pool

    def score(self, prompts, completions, references):
        """(rewards [B] f32, valid [B] bool, stats): see score_responses."""
        return score_responses(
            self.reward_fn,
            prompts,
            completions,
            references,
            invalid_reward=self.invalid_reward,
            timeout_s=self.timeout_s,
            pool=self.pool,
        )


def score_responses(
    reward_fn,
    prompts,
    completions,
    references,
    *,
    invalid_reward: str,
    timeout_s: float | None,
    pool=None,
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
    )
    ok_B = np.asarray(stats["ok_B"], bool)
    rewards_B = np.where(ok_B, rewards_B, 0.0).astype(np.float32)
    valid_B = ok_B if invalid_reward == "mask" else np.ones_like(ok_B)
    return rewards_B, valid_B, stats


def _advantage_kwargs(config) -> dict:
    """compute_advantages' processing options, read from the config's ROLL-named fields."""
    return {
        "group_size": config.num_return_sequences_in_group,
        "adv_estimator": config.adv_estimator,
        "reward_clip": config.reward_clip,
        "reward_norm": normalize_reward_norm(config.reward_norm),
        "reward_shift": config.reward_shift,
        "reward_scale": config.reward_scale,
        "whiten_advantages": config.whiten_advantages,
        "advantage_clip": config.advantage_clip,
    }


def make_advantage_fn(config):
    """Jitted (rewards [B], valid [B], running) -> (advantages [B], running) from config."""
    kwargs = _advantage_kwargs(config)

    @jax.jit
    def fn(rewards_B, valid_B, running):
        return advantages_lib.compute_advantages(
            rewards_B, mask=valid_B.astype(jnp.float32), running=running, **kwargs
        )

    return fn


def make_token_advantage_fn(config):
    """Jitted advantages [B, T] with an in-reward token-level KL (add_token_level_kl).

    Token reward r_t = −β·KL_t(π_old ‖ π_ref) on every response token, plus the sequence
    reward on the last one; the estimator then works on these (reward-to-go for
    "reinforce", the summed score for "grpo"), as verl/ROLL do.
    """
    kwargs = _advantage_kwargs(config)
    beta = float(config.token_level_kl_coef)
    estimator = config.kl_estimator

    @jax.jit
    def fn(rewards_B, valid_B, running, old_logprobs_BT, ref_logprobs_BT, mask_BT):
        kl_BT = objectives.kl_penalty(old_logprobs_BT, ref_logprobs_BT, estimator, mask=mask_BT)
        adv_BT, running = advantages_lib.compute_token_advantages(
            rewards_B,
            -beta * kl_BT,
            mask_BT,
            mask=valid_B.astype(jnp.float32),
            running=running,
            **kwargs,
        )
        return adv_BT, running

    return fn


@jax.jit
def logprob_gap(a_BT, b_BT, mask_BT):
    """Mean and max |sampler − trainer| log-prob over valid tokens (paper §5.4's premise)."""
    diff = jnp.abs(a_BT - b_BT) * mask_BT
    return jnp.sum(diff) / jnp.maximum(jnp.sum(mask_BT), 1.0), jnp.max(diff)


def reward_metrics(rewards_B, valid_B, correct_B, stats, group_size: int) -> dict[str, float]:
    """Host metrics of one rollout's rewards (all plain floats)."""
    valid_B = np.asarray(valid_B, bool)
    r = rewards_B[valid_B] if valid_B.any() else np.zeros(1, np.float32)
    groups_NG = rewards_B.reshape(-1, group_size)
    valid_NG = valid_B.reshape(-1, group_size)
    zero_var = [
        float(np.ptp(g[v]) == 0) if v.sum() >= 2 else 1.0 for g, v in zip(groups_NG, valid_NG)
    ]
    return {
        "reward/mean": float(np.mean(r)),
        "reward/std": float(np.std(r)),
        "reward/accuracy": float(np.mean(correct_B)),
        "reward/invalid_frac": float(1.0 - valid_B.mean()),
        "reward/num_errors": float(stats.get("num_errors", 0)),
        "reward/num_timeouts": float(stats.get("num_timeouts", 0)),
        "reward/num_nonfinite": float(
            stats.get("num_nonfinite", 0) + stats.get("num_nonnumeric", 0)
        ),
        "groups/zero_variance_frac": float(np.mean(zero_var)),
    }


def response_metrics(mask_BT: np.ndarray, truncated_B: np.ndarray) -> dict[str, float]:
    lengths = np.asarray(mask_BT).sum(axis=1)
    return {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(np.mean(truncated_B)),
    }
