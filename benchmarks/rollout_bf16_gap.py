"""The bf16 sampler-vs-trainer log-prob gap in each rollout layout, against an f32 pass.

Why the continuous engine's replicas widen `sampler/logprob_gap_mean` in bf16 (and not in
f32): both sides of the gap are bf16 computations of the same f32 quantity, and they agree
to ~1e-8 only when they happen to round every intermediate the same way. This measures,
on the Qwen3 test fixture (random weights, 8 prompts x 4 samples, 24 tokens, no end token,
bf16 compute, 2 fake CPU devices):

  gap          mean / max |log π_sampler − log π_trainer| (the trainer's shared-prompt pass,
               `train_step.make_logprobs_fn`, on the same mesh and tokens: what the loop's
               sampler/* metrics compare), per response position
  vs f32       mean |log π − log π_f32| over positions 1+ for the sampler's and for the
               trainer's bf16 log-probs, where π_f32 is the trainer's pass in f32 on the
               same tokens: which of the two is further from the exact value

for one device, the engine over GSPMD on 2 devices (replicas off), and one engine replica
per device (the "trainer" layout's default on a data-parallel mesh), and the same three in
f32 as the control. Position 0 comes from the prefill, which is the trainer's arithmetic.

`--kv_dtype` (comma-separated `sampling.kv_dtype` values) stores the sampler's KV pages in
each in turn, one row each: "auto" (the default) keeps them in the compute dtype, "int8"
quantises them (a scale per token and kv head). The trainer's pass is the same for all, so
the rows compare the sampler's log-probs through the gap (the tokens differ once a draw
flips, so sampler-to-sampler differences per position would mean nothing).

    python benchmarks/rollout_bf16_gap.py                       # ~1 min on 2 CPU cores
    python benchmarks/rollout_bf16_gap.py --kv_dtype auto,int8  # and int8 KV pages (~4 min)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from configs import default
from gspo_jax import models, sampling, sharding
from gspo_jax.config.specs import step_config
from gspo_jax.sampling import continuous
from gspo_jax.train_step import make_logprobs_fn

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models", "qwen3")
N, P, G, T = 8, 16, 4, 24


@contextlib.contextmanager
def no_replicas():
    """One engine over GSPMD's layout: what the engine ran before the replicas."""
    original = continuous.replica_axes
    continuous.replica_axes = lambda mesh, layout, num_prompts, plan: ((), plan)
    try:
        yield
    finally:
        continuous.replica_axes = original


def measure(cfg, params, tokens, devices: int, replicas: bool, kv_dtype: str = "auto") -> dict:
    mesh = sharding.make_mesh(
        {"data": devices, "fsdp": 1, "tensor": 1, "expert": 1}, jax.devices()[:devices]
    )
    trainer = sharding.tree_shardings(
        jax.eval_shape(lambda: params), models.logical_axes(cfg), mesh
    )
    config = default.get_config()
    config.num_return_sequences_in_group = G  # the trainer's pass shares each prompt over G
    config.sampling.temperature = 1.0
    logprobs = {
        dtype: make_logprobs_fn(step_config(config, dataclasses.replace(cfg, dtype=dtype)))
        for dtype in (cfg.dtype, "float32")
    }
    with jax.set_mesh(mesh), contextlib.nullcontext() if replicas else no_replicas():
        tp = jax.device_put(params, trainer)
        tok, msk = jax.device_put((tokens, np.ones_like(tokens)), sharding.batch_sharding(mesh, 2))
        rollout = sampling.RolloutLayout(cfg, mesh, "trainer")(tp)
        out = sampling.sample(
            cfg, rollout, tok, msk, jax.random.key(7), num_samples=G, max_new_tokens=T,
            eos_ids=(), buckets=(P,), layout="trainer", kv_dtype=kv_dtype,
        )  # fmt: skip
        full = jnp.concatenate([out.prompt_tokens, out.tokens], 1)
        mask = jnp.concatenate([out.prompt_mask, out.mask], 1)
        trainer_lp = np.asarray(logprobs[cfg.dtype](tp, full, mask, T)[0], np.float64)
        exact = np.asarray(logprobs["float32"](tp, full, mask, T)[0], np.float64)
    sampler_lp = np.asarray(out.logprobs, np.float64)
    gap = np.abs(sampler_lp - trainer_lp)
    return {
        "gap_mean": gap.mean(),
        "gap_max": gap.max(),
        "gap_pos0": gap[:, 0].mean(),
        "gap_pos1+": gap[:, 1:].mean(),
        "sampler_vs_f32": np.abs(sampler_lp - exact)[:, 1:].mean(),
        "trainer_vs_f32": np.abs(trainer_lp - exact)[:, 1:].mean(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv_dtype", default="auto", help="comma-separated sampling.kv_dtype values")
    kv_dtypes = ap.parse_args().kv_dtype.split(",")
    for kv in kv_dtypes:
        if kv not in models.KV_DTYPES:
            ap.error(f"--kv_dtype {kv!r}: expected values of {models.KV_DTYPES}")
    cfg, params = models.load_pretrained(FIXTURE)
    tokens = np.random.default_rng(0).integers(1, 250, (N, P)).astype(np.int32)
    runs = [("1 device", 1, False), ("2 devices, one engine (GSPMD)", 2, False)]
    runs.append(("2 devices, one replica per device", 2, True))
    print(
        "| compute | KV | engine | gap mean | gap max | gap, position 0 | gap, positions 1+ "
        "| sampler vs f32 | trainer vs f32 |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in ("bfloat16", "float32"):
        c = dataclasses.replace(cfg, dtype=dtype)
        for kv_dtype in kv_dtypes:
            for name, devices, replicas in runs:
                r = measure(c, params, tokens, devices, replicas, kv_dtype)
                kv = dtype if kv_dtype == "auto" else kv_dtype
                print(
                    f"| {dtype} | {kv} | {name} | {r['gap_mean']:.1e} | {r['gap_max']:.1e} "
                    f"| {r['gap_pos0']:.1e} | {r['gap_pos1+']:.1e} "
                    f"| {r['sampler_vs_f32']:.1e} | {r['trainer_vs_f32']:.1e} |"
                )


if __name__ == "__main__":
    main()
