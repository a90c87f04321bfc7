"""Sampler-vs-trainer log-prob gap of hybrid Qwen3.5 (recurrent DeltaNet decode vs chunked
recomputation) next to Qwen3's, by response length, in f32 and bf16.

The sampler decodes each Gated DeltaNet layer token by token (the recurrent form, from the
prefill's state); the trainer recomputes π_old and the update's log-probs with the chunked
form over the whole sequence (deltanet.py). The two are the same sums in a different
order, so their difference is a rounding term that Qwen3 (attention only) does not have.
This measures it on the random test fixtures (tests/fixtures/models/qwen3, qwen35):
N = 4 prompts of 8 tokens, temperature 1 draws with no end token, static engine, for each
response length T, per compute dtype:

  gap mean / max   |log π_sampler − log π_trainer| over the B·T response tokens, where
                   π_trainer is `models.forward` on prompt + response (the train step's
                   arithmetic) in the same dtype
  last-quarter     the mean over positions ≥ 3T/4 (does the gap grow along the response?)

GSPO's clip range is ε = 3e-4 / 4e-4 on the *sequence* ratio exp(mean_t Δ log π): a
per-token gap whose mean stays well below ε leaves the first update's ratios inside the
clip. π_old itself is recomputed by the trainer with the chunked form, so the update's
ratio is exactly 1 on-policy whatever this gap is.

    python benchmarks/qwen35_logprob_gap.py                 # T = 64, 256, 1024
    python benchmarks/qwen35_logprob_gap.py --lengths 64,128
    python benchmarks/qwen35_logprob_gap.py --lengths 256,1024 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gspo_jax import models, sampling

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models")
N, P = 4, 8


def gap(family: str, dtype: str, T: int) -> tuple[float, float, float]:
    cfg, params = models.load_pretrained(os.path.join(FIXTURES, family), compute_dtype=dtype)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (N, P)).astype(np.int32)
    mask = np.ones((N, P), np.int32)
    out = sampling.sample(
        cfg,
        params,
        prompts,
        mask,
        jax.random.key(1),
        num_samples=1,
        max_new_tokens=T,
        temperature=1.0,
        eos_ids=(),
        engine="static",
        buckets=(P,),
    )
    tokens = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    full_mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = models.forward(cfg, params, tokens, full_mask)[:, P - 1 : -1]
    trainer = jnp.take_along_axis(jax.nn.log_softmax(logits), out.tokens[..., None], -1)[..., 0]
    diff = np.abs(np.asarray(trainer) - np.asarray(out.logprobs))
    return float(diff.mean()), float(diff.max()), float(diff[:, 3 * T // 4 :].mean())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="64,256,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"{'model':8} {'dtype':9} {'T':>5} {'gap mean':>10} {'gap max':>10} {'last 1/4':>10}")
    for dtype in args.dtypes.split(","):
        for T in lengths:
            for family in ("qwen3", "qwen35"):
                mean, worst, tail = gap(family, dtype, T)
                print(f"{family:8} {dtype:9} {T:5d} {mean:10.2e} {worst:10.2e} {tail:10.2e}")


if __name__ == "__main__":
    main()
