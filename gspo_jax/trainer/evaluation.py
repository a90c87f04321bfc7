"""Held-out evaluation: greedy accuracy always, and pass@k / maj@k of k samples if asked.

The loop calls its `Evaluator` (built by setup.py) at RL step 0, every `eval.every_steps`
and at the end; it runs `greedy_accuracy`. The prompts are the first `eval.num_prompts` of
the split whatever the number of processes: every process walks the same global batches and
scores its own rows of each (`sharding.process_rows`); the sums are combined across
processes.

Greedy: each prompt gets one temperature-0 response; its accuracy is the configured accuracy
reward (0/1), with a failed verification counted as wrong -> eval/accuracy.

Sampled (`eval.pass_k` = k >= 1): the same prompts also get k responses each at
`eval.temperature` (no top-k / top-p), one sampler call per prompt batch whose k samples
share the prompt's prefill. A sample is correct when its accuracy score is > 0.5. With c of
the n = k samples correct,

    pass@j = 1 − C(n−c, j) / C(n, j),   j = 1..k   (Chen et al. 2021, eq. 1, unbiased)

per prompt, averaged over prompts -> eval/pass@1 .. eval/pass@k; maj@k is the accuracy of
the answer most samples give (rewards/voting.py: the vote, its tie rule, answers that do
not parse) -> eval/maj@k. Cost: k x the greedy evaluation's sampled tokens, plus k x its
verifier calls; one sampled call holds eval.batch_size x k sequences (lower
eval.batch_size if that does not fit). The samples come from their own stream, fold_in(fold_in(PRNGKey(seed),
EVAL_STREAM), call) for the call-th prompt batch: the same draws at every evaluation (common
random numbers: a change of the curve is the policy's, not the draw's), and the training
stream (fold_in(PRNGKey(seed), step), rollout/stage.py) is never touched, so resume stays exact.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gspo_jax import sharding as sharding_lib
from gspo_jax.config.specs import EvalSpec
from gspo_jax.rollout import stage as rollout
from gspo_jax.rollout.scoring import examples_of

# fold_in data of the evaluation's sampling stream: RL step 2**32 - 1 is never reached, so
# it never coincides with a rollout's key fold_in(PRNGKey(seed), step).
EVAL_STREAM = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """Held-out evaluation of a policy: `evaluator(params) -> {eval/...}`.

    sample_greedy(params, prompt_tokens, prompt_mask, key) -> SampleOutput of one greedy
    response per prompt; eval_data: the whole prepared held-out split. With
    spec.pass_k = k >= 1: sample_k(params, prompt_tokens, prompt_mask, key) ->
    SampleOutput of k responses per prompt, and answer_key(completion) -> the answer maj@k
    votes with (rewards/voting.py)."""

    spec: EvalSpec
    sample_greedy: Callable
    eval_data: Any
    tokenizer: Any
    accuracy: rollout.Scorer
    mesh: Any
    buckets: tuple[int, ...]
    sample_k: Callable | None = None
    answer_key: Callable | None = None

    def __call__(self, params, per_problem: list | None = None) -> dict[str, float]:
        """The metrics; with a list `per_problem`, also appends (problem index [P], greedy
        accuracy score [P]) per prompt batch, this process's valid rows (`greedy_accuracy`)."""
        greedy_key = jax.random.PRNGKey(0)  # greedy decoding draws nothing
        sample_k = None
        if self.spec.pass_k > 0:
            stream = eval_stream_key(self.spec.seed)

            def sample_k(tokens, mask, call):
                return self.sample_k(params, tokens, mask, jax.random.fold_in(stream, call))

        return greedy_accuracy(
            lambda tokens, mask: self.sample_greedy(params, tokens, mask, greedy_key),
            self.eval_data,
            self.tokenizer,
            self.accuracy,
            self.mesh,
            num_prompts=self.spec.num_prompts,
            batch_size=self.spec.batch_size,
            buckets=self.buckets,
            sample_k=sample_k,
            pass_k=self.spec.pass_k,
            answer_key=self.answer_key,
            per_problem=per_problem,
        )


def eval_stream_key(seed: int) -> jax.Array:
    """The evaluation's sampling key of run seed `seed` (module docstring)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), EVAL_STREAM)


def pass_at_k(n: int, c, k: int) -> np.ndarray:
    """Chen et al. (2021)'s unbiased pass@k of problems with `c` correct of `n` samples:
    1 − C(n−c, k)/C(n, k) = 1 − Π_{i=n−c+1}^{n} (1 − k/i), the product form (no huge
    binomials); 1 when n − c < k (a factor is then 0). `c`: int array [P]; returns [P]."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c_P = np.asarray(c, np.int64)
    if np.any((c_P < 0) | (c_P > n)):
        raise ValueError(f"correct counts must be in [0, n={n}], got {c_P.tolist()}")
    i_N = np.arange(1, n + 1)
    in_product_PN = i_N[None, :] > (n - c_P)[:, None]
    factors_PN = np.where(in_product_PN, 1.0 - k / i_N[None, :], 1.0)
    return 1.0 - np.prod(factors_PN, axis=1)


def majority_correct(keys_PK, scores_PK) -> np.ndarray:
    """maj@k per problem [P]: the accuracy score of the first sample giving the majority
    answer (rewards/voting.py, `majority_vote`); 0 when no sample gave an answer."""
    from gspo_jax.rewards.voting import majority_vote

    out = np.zeros(len(scores_PK))
    for p, (keys, scores) in enumerate(zip(keys_PK, scores_PK)):
        winner = majority_vote(keys)
        out[p] = 0.0 if winner is None else float(scores[winner])
    return out


def greedy_accuracy(
    sample_greedy,
    eval_data,
    tokenizer,
    accuracy: rollout.Scorer,
    mesh,
    *,
    num_prompts: int,
    batch_size: int,
    buckets,
    sample_k: Callable | None = None,
    pass_k: int = 0,
    answer_key: Callable | None = None,
    per_problem: list | None = None,
) -> dict[str, float]:
    """{eval/accuracy, eval/length_mean, eval/num_prompts} over the first `num_prompts`,
    and with `sample_k` (pass_k = k >= 1) eval/pass@1..k, eval/maj@k and
    eval/sampled_length_mean.

    `sample_greedy(prompt_tokens, prompt_mask)` returns a SampleOutput of one greedy
    response per prompt, `sample_k(prompt_tokens, prompt_mask, call)` one of k per prompt
    (the k of a prompt contiguous); `eval_data` is the whole prepared held-out split
    (data.PreparedData). Each call samples a global batch of at most `batch_size` prompts,
    a whole number per data-parallel device; rows past `num_prompts` are padding. A list
    `per_problem` gets (index in the split [P], accuracy score [P]) of this process's valid
    rows per call: the per-problem outcomes eval/accuracy averages (paired statistics).
    """
    total = min(num_prompts, eval_data.num_examples)
    dp = sharding_lib.data_parallel_size(mesh)
    per_call = min(batch_size, -(-total // dp) * dp)
    rows = sharding_lib.process_rows(mesh, per_call)
    it = eval_data.iterator(per_call, seed=0, train=False, rows=rows)
    k = pass_k if sample_k is not None else 0
    # correct, response tokens, prompts; then per k: pass@1..k, maj@k, sampled tokens
    totals = np.zeros(3 + (k + 2 if k else 0))
    seconds = np.zeros(2)  # greedy, sampled
    for call in range(-(-total // per_call)):
        batch = next(it)
        tokens_NP, mask_NP = rollout.bucket_prompts(
            batch["prompt_tokens"], batch["prompt_mask"], buckets
        )
        prompts = sharding_lib.to_global(mesh, (tokens_NP, mask_NP))
        # Padding: past the split's end (valid = 0) or past the first num_prompts.
        valid = (batch["valid"] > 0) & (call * per_call + rows < total)
        t0 = time.perf_counter()
        out = sample_greedy(*prompts)
        completions, lengths = _responses(tokenizer, out)
        examples = functools.partial(examples_of, batch)  # read if the reward asks
        correct, _, _ = accuracy.score(
            batch["prompt_text"], completions, batch["reference"], examples
        )
        totals[:3] += [np.sum(correct * valid), np.sum(lengths * valid), valid.sum()]
        if per_problem is not None:
            index = call * per_call + np.asarray(rows)
            per_problem.append((index[valid], np.asarray(correct, np.float32)[valid]))
        t1 = time.perf_counter()
        if k:
            out_k = sample_k(*prompts, call)
            totals[3:] += _sampled_sums(out_k, batch, valid, k, tokenizer, accuracy, answer_key)
        seconds += [t1 - t0, time.perf_counter() - t1]
    return _eval_metrics(sharding_lib.host_sum(totals), k, seconds)


def _responses(tokenizer, out) -> tuple[list[str], np.ndarray]:
    """This process's decoded responses of a SampleOutput and their lengths in tokens."""
    mask = sharding_lib.to_local(out.mask)
    completions = rollout.decode_responses(tokenizer, sharding_lib.to_local(out.tokens), mask)
    return completions, mask.sum(axis=1)


def _sampled_sums(out, batch, valid, k, tokenizer, accuracy, answer_key) -> np.ndarray:
    """[pass@1..k, maj@k, response tokens] summed over this process's valid prompts."""
    completions, lengths = _responses(tokenizer, out)
    texts = np.repeat(batch["prompt_text"], k)
    references = np.repeat(batch["reference"], k)
    examples = functools.partial(examples_of, batch, k)
    scores, _, _ = accuracy.score(texts, completions, references, examples)
    scores_PK = np.asarray(scores, np.float64).reshape(-1, k)
    correct_P = np.sum(scores_PK > 0.5, axis=1)
    passes = np.stack([pass_at_k(k, correct_P, j) for j in range(1, k + 1)], axis=1)
    keys_PK = np.array([answer_key(c) for c in completions], dtype=object).reshape(-1, k)
    maj_P = majority_correct(keys_PK, scores_PK)
    tokens_P = lengths.reshape(-1, k).sum(axis=1)
    per_prompt = np.concatenate([passes, maj_P[:, None], tokens_P[:, None]], axis=1)
    return np.sum(per_prompt * valid[:, None], axis=0)


def _eval_metrics(totals: np.ndarray, k: int, seconds: np.ndarray) -> dict[str, float]:
    n = max(totals[2], 1.0)
    metrics = {
        "eval/accuracy": float(totals[0] / n),
        "eval/length_mean": float(totals[1] / n),
        "eval/num_prompts": float(totals[2]),
        "time/eval_greedy_s": float(seconds[0]),
    }
    if k:
        metrics.update({f"eval/pass@{j}": float(totals[2 + j] / n) for j in range(1, k + 1)})
        metrics[f"eval/maj@{k}"] = float(totals[3 + k] / n)
        metrics["eval/sampled_length_mean"] = float(totals[4 + k] / (n * k))
        metrics["time/eval_sampled_s"] = float(seconds[1])
    return metrics
