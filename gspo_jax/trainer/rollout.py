"""One rollout: prompts -> G responses each -> rewards -> advantages -> the train batch.

`Rollouts.collect(state, prompts) -> Rollout` is the rollout half of an RL step (loop.py
runs the other half, the train step, on what it returns). A `Rollouts` holds its spec
(specs.RolloutSpec) and the functions it needs, built once by setup.py. In order:

  bucket_prompts                 host: drop padding columns down to a fixed compiled width
  sample                         G responses per prompt, with the sampler's log-probs
  decode_responses, Scorer       host: text -> rewards in verifier worker processes
  logprobs_fn                    π_ref (with a KL term); π_old for the token-level KL reward
  advantage_fn                   jitted advantages (running reward statistics carried)

π_old itself and π_old's MoE routing come from the train step (train_step/old_policy.py), so
that its first update recomputes them exactly; the batch carries the sampler's log-probs.

Invalid rewards (a verifier that raised or timed out, NaN, non-numeric) follow the
config's `invalid_reward` rule: "mask" excludes the response from group statistics and
gives it advantage 0 (so it neither pushes nor pulls the policy); "zero" scores it 0.
Both are counted in the metrics.

Shapes: N prompts, G samples each, B = N·G responses, P prompt tokens, T response tokens,
L = P + T.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import advantages as advantages_lib
from gspo_jax import objectives, sampling
from gspo_jax import sharding as sharding_lib
from gspo_jax.rewards import build_reward, score_batch
from gspo_jax.rewards.scoring import HARD_FAILURES, FailureLog, raise_all_failed
from gspo_jax.train_step import old_policy
from gspo_jax.trainer.specs import AdvantageSpec, RewardSpec, RolloutSpec


def bucket_prompts(tokens_NP: np.ndarray, mask_NP: np.ndarray, buckets) -> tuple:
    """Drop leading all-padding columns down to `sampling.choose_bucket`'s width.

    Done on the host and agreed across processes (every process must feed the same width),
    so each compiled shape comes from the fixed bucket list: a new prompt batch of a known
    bucket never recompiles, in the sampler or in the train step.
    """
    longest = sharding_lib.host_max(int(mask_NP.sum(axis=1).max()))
    width = tokens_NP.shape[1]
    bucket = sampling.choose_bucket(longest, width, buckets)
    return tokens_NP[:, width - bucket :], mask_NP[:, width - bucket :]


def decode_responses(tokenizer, tokens_BT: np.ndarray, mask_BT: np.ndarray) -> list[str]:
    """Response text per row: the valid tokens, special tokens (the end token) removed."""
    rows = [row[m > 0].tolist() for row, m in zip(np.asarray(tokens_BT), np.asarray(mask_BT))]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


class Scorer:
    """A reward function bound to its failure rule, timeout and worker pool.

    Each distinct failure message is logged once. With `max_failed_batches=k`, k batches
    in a row in which every call failed in a hard way (raised, non-number, NaN:
    `rewards.HARD_FAILURES`), counted over all processes, raise `rewards.RewardError` on
    every process (one small all-reduce per call): such a batch has no reward signal at
    all, so a verifier that keeps failing trains nothing."""

    def __init__(
        self, reward_fn, invalid_reward: str, *, timeout_s=None, pool=None, max_failed_batches=None
    ):
        self.reward_fn = reward_fn
        self.invalid_reward = invalid_reward
        self.timeout_s = timeout_s
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
        )

    @classmethod
    def for_accuracy(cls, spec: RewardSpec, pool) -> Scorer:
        """The accuracy reward (`spec.accuracy`): a failed verification counts as wrong (0),
        never as missing."""
        return cls(build_reward(spec.accuracy), "zero", timeout_s=spec.timeout_s, pool=pool)

    def score(self, prompts, completions, references):
        """(rewards [B] f32, valid [B] bool, stats): see score_responses."""
        rewards, valid, stats = score_responses(
            self.reward_fn,
            prompts,
            completions,
            references,
            invalid_reward=self.invalid_reward,
            timeout_s=self.timeout_s,
            pool=self.pool,
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


def make_advantage_fn(spec: AdvantageSpec, mesh=None):
    """Jitted advantages with the spec's ROLL-named options:

        fn(rewards [B], valid [B], running, *, old_logprobs, ref_logprobs, mask)
            -> (advantages, running)

    advantages are [B] (`compute_advantages`), or [B, T] with `add_token_level_kl`: then
    the token reward r_t = −β·KL_t(π_old ‖ π_ref) on every response token, plus the
    sequence reward on the last one, goes through `compute_token_advantages`
    (reward-to-go for "reinforce", the summed score for "grpo"), as verl/ROLL do. The
    log-prob arguments are only read in that case.

    Given `mesh`, the jitted function declares its layout: every [B] / [B, T] input and the
    advantages split over the mesh's batch axes (as the train step takes them), the running
    statistics replicated; inputs are put into that layout first (a no-op when they are).
    B must then split over the data-parallel devices, which `config.validate` ensures.
    """
    kwargs = spec.kwargs()
    beta, estimator = spec.token_level_kl_coef, spec.kl_estimator

    def sequence_level(rewards_B, valid_B, running):
        return advantages_lib.compute_advantages(
            rewards_B, mask=valid_B.astype(jnp.float32), running=running, **kwargs
        )

    def token_level(rewards_B, valid_B, running, old_logprobs_BT, ref_logprobs_BT, mask_BT):
        kl_BT = objectives.kl_penalty(old_logprobs_BT, ref_logprobs_BT, estimator, mask=mask_BT)
        return advantages_lib.compute_token_advantages(
            rewards_B,
            -beta * kl_BT,
            mask_BT,
            mask=valid_B.astype(jnp.float32),
            running=running,
            **kwargs,
        )

    if mesh is None:
        in_seq = in_tok = None
        sequence_level, token_level = jax.jit(sequence_level), jax.jit(token_level)
    else:
        rows, rows_T = sharding_lib.batch_sharding(mesh, 1), sharding_lib.batch_sharding(mesh, 2)
        same = sharding_lib.replicated(mesh)  # the running moments (a pytree prefix)
        in_seq, out_seq = (rows, rows, same), (rows, same)
        in_tok, out_tok = (rows, rows, same, rows_T, rows_T, rows_T), (rows_T, same)
        sequence_level = jax.jit(sequence_level, in_shardings=in_seq, out_shardings=out_seq)
        token_level = jax.jit(token_level, in_shardings=in_tok, out_shardings=out_tok)

    def call(jitted, in_shardings, args):
        if in_shardings is not None:
            dp = sharding_lib.data_parallel_size(mesh)
            if np.shape(args[0])[0] % dp:
                raise ValueError(
                    f"advantages: {np.shape(args[0])[0]} rewards do not split over the {dp} "
                    "data-parallel devices of the mesh"
                )
            args = jax.device_put(args, in_shardings)
        return jitted(*args)

    def fn(rewards_B, valid_B, running, *, old_logprobs=None, ref_logprobs=None, mask=None):
        if spec.token_level_kl:
            args = (rewards_B, valid_B, running, old_logprobs, ref_logprobs, mask)
            return call(token_level, in_tok, args)
        return call(sequence_level, in_seq, (rewards_B, valid_B, running))

    # The jitted function the config uses, positional arguments only (tools.aot lowers it).
    fn.jitted = token_level if spec.token_level_kl else sequence_level
    return fn


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


# ------------------------------------------------------------------------------ the rollout


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What one rollout hands to the train step, as data.

    batch           the train step's input (train_step/step.py's module docstring), on
                    device, laid out over the mesh's batch axes
    running         the reward statistics after this rollout (reward_norm="running")
    host_metrics    plain floats: rewards, accuracy, response lengths (of the global batch:
                    every process's rows), phase timings
    completions     the decoded responses [B] (this process's rows), rewards / valid [B]
    """

    batch: dict[str, jax.Array]
    running: Any
    host_metrics: dict[str, float]
    completions: list[str]
    rewards: np.ndarray
    valid: np.ndarray


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """The rollout stage: its spec and the functions it needs (built by setup.py).

    sample(params, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput (the
    rollout's sampler options bound); reward / accuracy: the verifiers (accuracy None: the
    reward itself is the 0/1 accuracy); logprobs_fn: the train step's jitted whole-batch
    log-prob pass (π_ref, the token-level KL's π_old); advantage_fn: `make_advantage_fn`;
    batch_shardings: the layout the jitted train step declares for its batch.
    """

    spec: RolloutSpec
    mesh: Any
    tokenizer: Any
    sample: Callable
    reward: Scorer
    accuracy: Scorer | None
    logprobs_fn: Callable
    advantage_fn: Callable
    batch_shardings: dict

    def collect(self, state, prompts: dict[str, np.ndarray]) -> Rollout:
        """Sample, score and prepare one rollout batch for `state`'s policy.

        `prompts` is this process's rows of the prompt batch (the loop's iterator); RL step
        `state.step` samples with fold_in(state.rng, state.step), so a resumed run draws
        what it would have drawn.
        """
        t0 = time.perf_counter()
        out = self._sample(state, prompts)
        response_mask = sharding_lib.to_local(out.mask)
        t1 = time.perf_counter()
        tokens = sharding_lib.to_local(out.tokens)
        completions = decode_responses(self.tokenizer, tokens, response_mask)
        rewards, valid, correct, stats = self._score(prompts, completions)
        t2 = time.perf_counter()
        train_batch, running = self._train_batch(state, out, rewards, valid)
        host = self._metrics(out, response_mask, rewards, valid, correct, stats)
        host["perf/sample_tokens_per_s"] = host.pop("response/tokens") / max(t1 - t0, 1e-9)
        host["time/sample_s"] = t1 - t0
        host["time/reward_s"] = t2 - t1
        return Rollout(train_batch, running, host, completions, rewards, valid)

    def _sample(self, state, prompts) -> sampling.SampleOutput:
        """G responses to each prompt of `prompts` from the state's policy."""
        tokens_NP, mask_NP = bucket_prompts(
            prompts["prompt_tokens"], prompts["prompt_mask"], self.spec.buckets
        )
        prompt_tokens, prompt_mask = sharding_lib.to_global(self.mesh, (tokens_NP, mask_NP))
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        return self.sample(state.train.params, prompt_tokens, prompt_mask, key)

    def _score(self, prompts, completions):
        """(rewards [B], valid [B], correct [B], scoring stats) of this process's responses."""
        g = self.spec.group_size
        texts = np.repeat(prompts["prompt_text"], g)
        references = np.repeat(prompts["reference"], g)
        rewards, valid, stats = self.reward.score(texts, completions, references)
        if self.accuracy is None:
            return rewards, valid, rewards, stats
        correct, _, _ = self.accuracy.score(texts, completions, references)
        return rewards, valid, correct, stats

    def _metrics(self, out, response_mask, rewards, valid, correct, stats) -> dict:
        """Host metrics of the global batch (every process's rows): the same on every
        process, and for any number of processes."""
        counts = ("num_errors", "num_timeouts", "num_nonfinite", "num_nonnumeric")
        totals = sharding_lib.host_sum(np.array([stats.get(k, 0) for k in counts]))
        rows = (rewards, valid, correct, response_mask, sharding_lib.to_local(out.truncated))
        rewards_B, valid_B, correct_B, mask_BT, truncated_B = sharding_lib.gather_rows(rows)
        g = self.spec.group_size
        host = reward_metrics(rewards_B, valid_B, correct_B, dict(zip(counts, totals)), g)
        host.update(response_metrics(mask_BT, truncated_B))
        host["response/tokens"] = float(mask_BT.sum())
        return host

    def _train_batch(self, state, out: sampling.SampleOutput, rewards, valid):
        """The train step's batch: the sampler's log-probs, π_ref and the advantages.
        Returns (batch, running reward statistics)."""
        spec = self.spec
        tokens_BL, mask_BL = out.sequences()  # prompt (repeated G times) then response
        mask_BT = out.mask.astype(jnp.float32)
        ref_logprobs = old_logprobs = None
        if spec.needs_ref:
            ref_logprobs = self.logprobs_fn(
                state.ref_params, tokens_BL, mask_BL, spec.response_length
            )[0]
        if spec.token_level_kl:
            old_logprobs = old_policy.for_token_kl_reward(
                spec.old_logprobs_source,
                out.logprobs,
                lambda: self.logprobs_fn(
                    state.train.params, tokens_BL, mask_BL, spec.response_length
                )[0],
            )
        rewards_B, valid_B = sharding_lib.to_global(self.mesh, (rewards, valid))
        advantages, running = self.advantage_fn(
            rewards_B,
            valid_B,
            state.running,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            mask=mask_BT,
        )
        batch = {
            "tokens": tokens_BL,
            "attention_mask": mask_BL,
            "response_mask": mask_BT,
            "sampler_logprobs": out.logprobs,
            "advantages": advantages,
        }
        if spec.use_kl_loss:
            batch["ref_logprobs"] = ref_logprobs
        # The layout the jitted train step declares (`train_step.batch_shardings`).
        return jax.device_put(batch, self.batch_shardings), running
