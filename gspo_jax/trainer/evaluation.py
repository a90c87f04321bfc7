"""Greedy evaluation on the held-out split: the accuracy curve of every run.

The loop calls its `Evaluator` (built by setup.py) at RL step 0, every `eval.every_steps`
and at the end; it runs `greedy_accuracy`.
Each prompt gets one greedy response (temperature 0); its accuracy is the configured
accuracy reward (0/1), with a failed verification counted as wrong. The prompts are the first
`eval.num_prompts` of the split whatever the number of processes: every process walks the
same global batches and scores its own rows of each (`sharding.process_rows`); the sums are
combined across processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gspo_jax import sharding as sharding_lib
from gspo_jax.trainer import rollout
from gspo_jax.trainer.specs import EvalSpec


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """Held-out evaluation of a policy: `evaluator(params) -> {eval/...}`.

    sample_greedy(params, prompt_tokens, prompt_mask, key) -> SampleOutput of one greedy
    response per prompt; eval_data: the whole prepared held-out split."""

    spec: EvalSpec
    sample_greedy: Callable
    eval_data: Any
    tokenizer: Any
    accuracy: rollout.Scorer
    mesh: Any
    buckets: tuple[int, ...]

    def __call__(self, params) -> dict[str, float]:
        key = jax.random.PRNGKey(0)  # greedy decoding draws nothing
        return greedy_accuracy(
            lambda tokens, mask: self.sample_greedy(params, tokens, mask, key),
            self.eval_data,
            self.tokenizer,
            self.accuracy,
            self.mesh,
            num_prompts=self.spec.num_prompts,
            batch_size=self.spec.batch_size,
            buckets=self.buckets,
        )


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
) -> dict[str, float]:
    """{eval/accuracy, eval/length_mean, eval/num_prompts} over the first `num_prompts`.

    `sample_greedy(prompt_tokens, prompt_mask)` returns a SampleOutput of one greedy
    response per prompt; `eval_data` is the whole prepared held-out split
    (data.PreparedData). Each call samples a global batch of at most `batch_size` prompts,
    a whole number per data-parallel device; rows past `num_prompts` are padding.
    """
    total = min(num_prompts, eval_data.num_examples)
    dp = sharding_lib.data_parallel_size(mesh)
    per_call = min(batch_size, -(-total // dp) * dp)
    rows = sharding_lib.process_rows(mesh, per_call)
    it = eval_data.iterator(per_call, seed=0, train=False, rows=rows)
    totals = np.zeros(3)  # correct, response tokens, prompts
    for call in range(-(-total // per_call)):
        batch = next(it)
        tokens_NP, mask_NP = rollout.bucket_prompts(
            batch["prompt_tokens"], batch["prompt_mask"], buckets
        )
        out = sample_greedy(*sharding_lib.to_global(mesh, (tokens_NP, mask_NP)))
        mask = sharding_lib.to_local(out.mask)
        completions = rollout.decode_responses(tokenizer, sharding_lib.to_local(out.tokens), mask)
        correct, _, _ = accuracy.score(batch["prompt_text"], completions, batch["reference"])
        # Padding: past the split's end (valid = 0) or past the first num_prompts.
        valid = (batch["valid"] > 0) & (call * per_call + rows < total)
        totals += [np.sum(correct * valid), np.sum(mask.sum(axis=1) * valid), valid.sum()]
    totals = sharding_lib.host_sum(totals)
    n = max(totals[2], 1.0)
    return {
        "eval/accuracy": float(totals[0] / n),
        "eval/length_mean": float(totals[1] / n),
        "eval/num_prompts": float(totals[2]),
    }
