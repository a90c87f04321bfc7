"""One rollout: prompts -> G responses each -> rewards -> advantages -> the train batch.

`Rollouts.collect(state, prompts, more_prompts=None) -> Rollout` is the rollout half of an
RL step (loop.py runs the other half, the train step, on what it returns). A `Rollouts`
holds its spec (specs.RolloutSpec) and the functions it needs, built once by setup.py. In
order:

  bucket_prompts                 host: drop padding columns down to a fixed compiled width
  sample                         G responses per prompt, with the sampler's log-probs
  decode_responses, Scorer       host: text -> rewards in verifier worker processes
  logprobs_fn                    π_ref (with a KL term); π_old for the token-level KL reward
  advantage_fn                   jitted advantages (running reward statistics carried)

π_old itself and π_old's MoE routing come from the train step (algorithm/old_policy.py), so
that its first update recomputes them exactly; the batch carries the sampler's log-probs.

Invalid rewards (a verifier that raised or timed out, NaN, non-numeric) follow the
config's `invalid_reward` rule: "mask" excludes the response from group statistics and
gives it advantage 0 (so it neither pushes nor pulls the policy); "zero" scores it 0.
Both are counted in the metrics.

DAPO's options (filtering.py), each off by default: `overlong_buffer_len` adds the soft
overlong penalty to every valid reward (what the advantages and `reward/*` see; accuracy is
unchanged); `overlong_filter` zeroes the loss mask of truncated responses, which still count
in their group's statistics (DAPO §3.4, TRL's `mask_truncated_completions`); with
`dynamic_sampling`, groups whose rewards are all equal are dropped and more prompts of the
data stream sampled (the same compiled sampler) until the batch is full or the extra rounds
run out, the rest filled with dead groups that get no loss and no weight in the statistics.
`reward/*` and `response/*` describe every response sampled in the step, before filtering.

Shapes: N prompts, G samples each, B = N·G responses, P prompt tokens, T response tokens,
L = P + T.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import sampling
from gspo_jax import sharding as sharding_lib
from gspo_jax.algorithm import advantages as advantages_lib
from gspo_jax.algorithm import objectives, old_policy
from gspo_jax.config.specs import AdvantageSpec, RolloutSpec
from gspo_jax.models import lora
from gspo_jax.rollout import scoring
from gspo_jax.rollout.filtering import group_rows, overlong_penalty, select_groups, zero_std_groups
from gspo_jax.rollout.scoring import Scorer, decode_responses, score_responses  # noqa: F401


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
        # groups whose valid rewards are all equal: zero advantage, no gradient (filtering.py)
        "reward/frac_zero_std": float(np.mean(zero_std_groups(rewards_B, valid_B, group_size))),
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
class _Round:
    """One sampling round of a rollout: the sampler's output (global arrays) and this
    process's rows on the host. `rewards` include the overlong `penalty`; `correct` does
    not; `sample_s` / `reward_s`: the round's sampling and scoring seconds."""

    prompts: dict
    out: sampling.SampleOutput
    mask: np.ndarray
    truncated: np.ndarray
    completions: list
    rewards: np.ndarray
    valid: np.ndarray
    correct: np.ndarray
    stats: dict
    penalty: np.ndarray
    sample_s: float
    reward_s: float


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


def _onto(mesh, out: sampling.SampleOutput) -> sampling.SampleOutput:
    """The sampler's outputs moved from the rollout's mesh to `mesh` (one process: the same
    devices), rows over its batch axes as `sharding.to_global` lays them (replicated when
    they do not split), scalars replicated."""
    dp = sharding_lib.data_parallel_size(mesh)

    def put(x):
        if x is None:
            return None
        if np.ndim(x) and x.shape[0] % dp == 0:
            return jax.device_put(x, sharding_lib.batch_sharding(mesh, np.ndim(x)))
        return jax.device_put(x, sharding_lib.replicated(mesh))

    return jax.tree.map(put, out)


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """The rollout stage: its spec and the functions it needs (built by setup.py).

    sample(params, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput (the
    rollout's sampler options bound); reward / accuracy: the verifiers (accuracy None: the
    reward itself is the 0/1 accuracy); logprobs_fn: the train step's jitted whole-batch
    log-prob pass (π_ref, the token-level KL's π_old); advantage_fn: `make_advantage_fn`;
    batch_shardings: the layout the jitted train step declares for its batch;
    rollout_params: the trainer's params -> the sampler's copy (`sampling.RolloutLayout`:
    compute dtype, the decode layout), made once per RL step; None: the sampler reads the
    trainer's params as they are. rollout_mesh: the rollout's own mesh
    (`sampling.rollout_mesh`; rollout_params reshards onto it): the prompts go onto it, the
    sampler runs under it and its outputs come back to `mesh`; None: `mesh`.
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
    rollout_params: Callable | None = None
    rollout_mesh: Any = None

    def collect(self, state, prompts: dict[str, np.ndarray], more_prompts=None) -> Rollout:
        """Sample, score and prepare one rollout batch for `state`'s policy.

        `prompts` is this process's rows of the prompt batch (the loop's iterator); RL step
        `state.step` samples with fold_in(state.rng, state.step), so a resumed run draws
        what it would have drawn. With `dynamic_sampling`, `more_prompts()` gives the next
        prompt batch of the data stream for each extra round (round k samples with
        fold_in(that key, k)); the loop saves the data position after them.
        """
        t0 = time.perf_counter()
        policy = state.train.params
        if self.rollout_params is not None:  # one reshard per RL step, every round reads it
            policy = jax.block_until_ready(self.rollout_params(policy))
        reshard_s = time.perf_counter() - t0
        rounds = [self._round(state, policy, prompts, 0)]
        if self.spec.dynamic_sampling:
            rounds = self._refill(state, policy, rounds, more_prompts)
            out, rows, pad_B = self._assemble(rounds)
        else:
            out, rows = rounds[0].out, np.arange(rounds[0].rewards.size)
            pad_B = np.zeros(rows.size, bool)

        def cat(name):
            return np.concatenate([getattr(r, name) for r in rounds])[rows]

        rewards, valid, truncated = cat("rewards"), cat("valid"), cat("truncated")
        completions = [c for r in rounds for c in r.completions]
        completions = [completions[i] for i in rows]
        # A pad row neither weighs in its group's statistics nor gets loss; a truncated one
        # (overlong_filter) keeps its place in the statistics and only loses its loss.
        filtered_B = truncated & ~pad_B if self.spec.overlong_filter else np.zeros_like(pad_B)
        keep_B = ~(pad_B | filtered_B)
        train_batch, running = self._train_batch(
            state, out, rewards, valid & ~pad_B, None if keep_B.all() else keep_B
        )
        host = self._metrics(rounds)
        if self.spec.dynamic_sampling or self.spec.overlong_filter:
            host.update(self._filter_metrics(rounds, pad_B, filtered_B))
        sample_s, reward_s = (sum(getattr(r, k) for r in rounds) for k in ("sample_s", "reward_s"))
        host.update(_engine_metrics(rounds, host["response/tokens"]))
        host["perf/sample_tokens_per_s"] = host.pop("response/tokens") / max(sample_s, 1e-9)
        host["time/sample_s"] = sample_s
        if self.rollout_params is not None:
            host["time/rollout_reshard_s"] = reshard_s
        host["time/reward_s"] = reward_s
        return Rollout(train_batch, running, host, completions, rewards, valid)

    def _round(self, state, policy, prompts, index: int) -> _Round:
        """One sampling round: G responses to each prompt, decoded, scored, and the soft
        overlong penalty (`overlong_buffer_len`) added to the valid rewards."""
        t0 = time.perf_counter()
        out = self._sample(state, prompts, index, policy)
        mask = sharding_lib.to_local(out.mask)
        t1 = time.perf_counter()
        completions = decode_responses(self.tokenizer, sharding_lib.to_local(out.tokens), mask)
        rewards, valid, correct, stats = self._score(prompts, completions)
        spec = self.spec
        penalty = overlong_penalty(
            mask.sum(axis=1),
            max_length=spec.response_length,
            buffer_len=spec.overlong_buffer_len,
            factor=spec.overlong_penalty_factor,
        )
        penalty = np.where(valid, penalty, 0.0).astype(np.float32)
        truncated = sharding_lib.to_local(out.truncated).astype(bool)
        return _Round(
            prompts=prompts,
            out=out,
            mask=mask,
            truncated=truncated,
            completions=completions,
            rewards=rewards + penalty,
            valid=valid,
            correct=correct,
            stats=stats,
            penalty=penalty,
            sample_s=t1 - t0,
            reward_s=time.perf_counter() - t1,
        )

    def _refill(self, state, policy, rounds: list, more_prompts) -> list:
        """Dynamic sampling: extra rounds while any process holds fewer live groups than
        prompts, at most `dynamic_sampling_max_rounds`. Every process samples in the same
        rounds (the sampler is one program over all of them), each keeping its own rows."""
        g, n = self.spec.group_size, rounds[0].rewards.size // self.spec.group_size
        live = int(np.sum(~zero_std_groups(rounds[0].rewards, rounds[0].valid, g)))
        while len(rounds) <= self.spec.dynamic_sampling_max_rounds:
            if not sharding_lib.host_sum(np.array([max(n - live, 0)]))[0]:
                break
            if more_prompts is None:
                raise ValueError(
                    "dynamic_sampling needs more prompts: pass more_prompts to collect "
                    "(the loop passes its data iterator)"
                )
            rounds.append(self._round(state, policy, more_prompts(), len(rounds)))
            live += int(np.sum(~zero_std_groups(rounds[-1].rewards, rounds[-1].valid, g)))
        return rounds

    def _assemble(self, rounds: list) -> tuple[sampling.SampleOutput, np.ndarray, np.ndarray]:
        """(the batch's SampleOutput, its rows among every round's rows, pad [B]): the
        first live groups (`select_groups`), the batch of the usual shape. Prompt columns
        are left padded to the widest round's bucket (positions come from the mask, so
        this changes no number), a width the bucket list already allows."""
        g = self.spec.group_size
        live = np.concatenate([~zero_std_groups(r.rewards, r.valid, g) for r in rounds])
        index, pad_N = select_groups(live, rounds[0].rewards.size // g)
        rows = group_rows(index, g)
        width = max(r.out.prompt_tokens.shape[1] for r in rounds)
        fill = {"prompt_tokens": int(self.tokenizer.pad_token_id), "prompt_mask": 0}

        def local(r, name):
            x = sharding_lib.to_local(getattr(r.out, name))
            if name in fill:
                x = np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=fill[name])
            return x

        # Every per-row field is taken row by row; num_steps is the rounds' max, the other
        # scalars (the engine's counts: row_steps, preemptions) their sum.
        out = rounds[0].out
        names = [f.name for f in dataclasses.fields(out) if getattr(out, f.name) is not None]
        scalars = {k for k in names if np.ndim(getattr(out, k)) == 0}
        fields = {
            k: np.concatenate([local(r, k) for r in rounds])[rows]
            for k in names
            if k not in scalars
        }
        fields = sharding_lib.to_global(self.mesh, fields)
        for k in scalars:
            values = [np.asarray(getattr(r.out, k)) for r in rounds]
            fields[k] = jnp.asarray(max(values) if k == "num_steps" else sum(values))
        return out.replace(**fields), rows, np.repeat(pad_N, g)

    def _sample(self, state, prompts, index: int = 0, policy=None) -> sampling.SampleOutput:
        """G responses to each prompt of `prompts` from the state's policy (`policy`: its
        rollout copy, default the trainer's params; round `index` of dynamic sampling: the
        same compiled sampler, another key)."""
        tokens_NP, mask_NP = bucket_prompts(
            prompts["prompt_tokens"], prompts["prompt_mask"], self.spec.buckets
        )
        mesh = self.mesh if self.rollout_mesh is None else self.rollout_mesh
        prompt_tokens, prompt_mask = sharding_lib.to_global(mesh, (tokens_NP, mask_NP))
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if index:
            key = jax.random.fold_in(key, index)
        policy = state.train.params if policy is None else policy
        if self.rollout_mesh is None:
            return self.sample(policy, prompt_tokens, prompt_mask, key)
        # off the trainer's mesh: the key's data, which every process holds whole
        key = jax.random.wrap_key_data(sharding_lib.to_replicated(mesh, jax.random.key_data(key)))
        with jax.set_mesh(self.rollout_mesh):
            out = self.sample(policy, prompt_tokens, prompt_mask, key)
        return _onto(self.mesh, out)

    def _score(self, prompts, completions):
        """(rewards [B], valid [B], correct [B], scoring stats) of this process's responses."""
        g = self.spec.group_size
        texts = np.repeat(prompts["prompt_text"], g)
        references = np.repeat(prompts["reference"], g)
        examples = functools.partial(scoring.examples_of, prompts, g)  # read if asked for
        rewards, valid, stats = self.reward.score(texts, completions, references, examples)
        if self.accuracy is None:
            return rewards, valid, rewards, stats
        correct, _, _ = self.accuracy.score(texts, completions, references, examples)
        return rewards, valid, correct, stats

    def _metrics(self, rounds: list) -> dict:
        """Host metrics of every response sampled this step (every process's rows, every
        round: the policy's own numbers, before any filtering): the same on every process,
        and for any number of processes."""
        counts = ("num_errors", "num_timeouts", "num_nonfinite", "num_nonnumeric")
        local = [sum(r.stats.get(k, 0) for r in rounds) for k in counts]
        totals = sharding_lib.host_sum(np.array(local))
        names = ("rewards", "valid", "correct", "mask", "truncated", "penalty")
        rows = tuple(np.concatenate([getattr(r, k) for r in rounds]) for k in names)
        gathered = sharding_lib.gather_rows(rows)
        rewards_B, valid_B, correct_B, mask_BT, truncated_B, penalty_B = gathered
        g = self.spec.group_size
        host = reward_metrics(rewards_B, valid_B, correct_B, dict(zip(counts, totals)), g)
        host.update(response_metrics(mask_BT, truncated_B))
        if self.spec.overlong_buffer_len > 0:
            penalised = penalty_B[np.asarray(valid_B, bool)]
            host["reward/overlong_penalty_mean"] = (
                float(penalised.mean()) if penalised.size else 0.0
            )
        host["response/tokens"] = float(mask_BT.sum())
        return host

    def _filter_metrics(self, rounds: list, pad_B: np.ndarray, filtered_B: np.ndarray) -> dict:
        """Dynamic sampling's and overlong_filter's counts over the global train batch."""
        g, spec, out = self.spec.group_size, self.spec, {}
        sampled = sum(r.rewards.size for r in rounds) // g
        totals = sharding_lib.host_sum(
            np.array([sampled, pad_B.sum() // g, pad_B.size // g, filtered_B.sum(), pad_B.size])
        )
        sampled, short, groups, filtered, rows = (int(x) for x in totals)
        if spec.dynamic_sampling:
            out["rollout/dynamic_rounds"] = float(len(rounds) - 1)
            out["rollout/groups_sampled"] = float(sampled)
            out["rollout/groups_kept"] = float(groups - short)
            out["rollout/groups_short"] = float(short)
        if spec.overlong_filter:
            out["response/filtered_frac"] = filtered / max(rows, 1)
        return out

    def _train_batch(self, state, out: sampling.SampleOutput, rewards, valid, keep=None):
        """The train step's batch: the sampler's log-probs, π_ref and the advantages.
        `keep` [B] bool (this process's rows; None: all): rows that get loss, the others'
        response mask zeroed in the batch only. Returns (batch, running reward statistics)."""
        spec = self.spec
        tokens_BL, mask_BL = out.sequences()  # prompt (repeated G times) then response
        mask_BT = out.mask.astype(jnp.float32)
        ref_logprobs = old_logprobs = None
        if spec.needs_ref:
            # LoRA: π_ref is the frozen base, the policy with its adapters off (no copy).
            ref = state.ref_params
            if ref is None:
                ref = lora.adapters_off(state.train.params)
            ref_logprobs = self.logprobs_fn(ref, tokens_BL, mask_BL, spec.response_length)[0]
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
        if keep is not None:
            keep_B = sharding_lib.to_global(self.mesh, np.asarray(keep, np.float32))
            mask_BT = mask_BT * keep_B[:, None]
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


def _engine_metrics(rounds: list, tokens: float) -> dict:
    """rollout/useful_row_frac (response tokens over the decode rows the sampler computed,
    every round: 1 when no row waited for another) and rollout/preemptions (continuous
    engine: sequences decoded again for want of KV pages)."""
    rows = sum(int(np.asarray(r.out.row_steps)) for r in rounds if r.out.row_steps is not None)
    if not rows:
        return {}
    preempted = sum(int(np.asarray(r.out.preemptions)) for r in rounds)
    return {"rollout/useful_row_frac": tokens / rows, "rollout/preemptions": float(preempted)}
