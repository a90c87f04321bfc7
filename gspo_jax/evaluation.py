"""Greedy evaluation on the held-out split: the accuracy curve of every run.

`train.py` calls `greedy_accuracy` at RL step 0, every `eval.every_steps` and at the end.
Each prompt gets one greedy response (temperature 0); its accuracy is the configured
accuracy reward (0/1), with a failed verification counted as wrong. Every process evaluates
its own shard; the sums are combined across processes.
"""

from __future__ import annotations

import jax
import numpy as np

from gspo_jax import rollout
from gspo_jax import sharding as sharding_lib


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
    response per prompt; `eval_data` is the prepared held-out split (data.PreparedData).
    """
    procs = jax.process_count()
    total = min(num_prompts, eval_data.num_examples * procs)
    per_call = max(min(batch_size, total) // procs, 1)
    it = eval_data.iterator(per_call, seed=0, train=False)
    num_calls = min(-(-total // (per_call * procs)), it.num_batches)
    totals = np.zeros(3)  # correct, response tokens, prompts
    for _ in range(num_calls):
        batch = next(it)
        tokens_NP, mask_NP = rollout.bucket_prompts(
            batch["prompt_tokens"], batch["prompt_mask"], buckets
        )
        out = sample_greedy(*sharding_lib.to_global(mesh, (tokens_NP, mask_NP)))
        mask = sharding_lib.to_local(out.mask)
        completions = rollout.decode_responses(tokenizer, sharding_lib.to_local(out.tokens), mask)
        correct, _, _ = accuracy.score(batch["prompt_text"], completions, batch["reference"])
        valid = np.asarray(batch["valid"], np.float64)  # the last batch is padded
        totals += [np.sum(correct * valid), np.sum(mask.sum(axis=1) * valid), valid.sum()]
    totals = sharding_lib.host_sum(totals)
    n = max(totals[2], 1.0)
    return {
        "eval/accuracy": float(totals[0] / n),
        "eval/length_mean": float(totals[1] / n),
        "eval/num_prompts": float(totals[2]),
    }
