"""One RL step's two halves on this machine: train-step MFU and sampler throughput.

  python benchmarks/rl_step.py                         # tiny preset (CPU, ~1 minute)
  python benchmarks/rl_step.py --preset=qwen3_0p6b     # Qwen3-0.6B shapes (GPU/TPU)

Everything is a ratio measured in the same run, because shared machines drift:
  train MFU     model FLOPs of one jitted train step (benchmarks/common.py: 6·N per token
                for the matmul parameters, the unembedding on response tokens only, causal
                attention; rematerialisation and the log-prob backward's logit recompute
                NOT counted) divided by wall time, over this machine's measured bf16 (or f32
                on CPU) matmul rate;
  sampler       generated tokens/s of `sampling.sample` (N prompts x G samples, one prefill
                per prompt), the decode step's time over its FLOP floor (one step's FLOPs
                attending to the mean cache length, at the measured matmul rate), and
                against a per-token Python loop over the model's decode step (--baseline).
Random weights (the numbers do not depend on them); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import base
from gspo_jax import models, sampling
from gspo_jax.config import step_config
from gspo_jax.train_step import TrainState, make_train_step

PRESETS = {
    "tiny": {
        "model": {
            "arch": "qwen3",
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "qk_norm": True,
            "tie_word_embeddings": True,
        },
        "prompts": 4,
        "group": 8,
        "prompt_len": 64,
        "response_len": 128,
        "dtype": "float32",
        "remat": "none",
        "micro": None,
    },
    # Qwen3-0.6B's published config.json (28 layers, GQA 16/8, head_dim 128, tied).
    "qwen3_0p6b": {
        "model": {
            "arch": "qwen3",
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_layers": 28,
            "num_heads": 16,
            "num_kv_heads": 8,
            "head_dim": 128,
            "qk_norm": True,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
        },
        "prompts": 32,
        "group": 8,
        "prompt_len": 256,
        "response_len": 768,
        "dtype": "bfloat16",
        "remat": "full",
        "micro": 32,
    },
}


def bench_train(preset, cfg, rate):
    n, g = preset["prompts"], preset["group"]
    p, t = preset["prompt_len"], preset["response_len"]
    b = n * g
    config = base.get_config()  # the train step at the defaults of configs/base.py, with:
    config.num_mini_batches = 4
    config.micro_batch_size = preset["micro"]
    config.response_length = t
    config.logprob_chunk_size = 512
    sc = step_config(config, cfg)
    tx = optax.adamw(1e-6)
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p + t)), jnp.int32),
        "attention_mask": jnp.ones((b, p + t), jnp.int32),
        "response_mask": jnp.ones((b, t), jnp.float32),
        "old_logprobs": jnp.asarray(-rng.random((b, t)) * 5, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=b), jnp.float32),
    }
    step = make_train_step(sc, tx, donate=True)
    holder = {"state": state}

    def one_step():  # the state is donated: carry it from call to call
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    compile_s = common.seconds(one_step)
    seconds = common.median_seconds(one_step, reps=3, warmup=0)
    flops = common.train_flops(cfg, b, p, t)  # 4 mini-batches cover the batch once
    return {
        "train/responses": b,
        "train/tokens": b * (p + t),
        "train/seconds": seconds,
        "train/first_call_s": compile_s,
        "train/tokens_per_s": b * (p + t) / seconds,
        "train/model_tflops": flops / seconds / 1e12,
        "train/mfu_vs_measured_matmul": flops / seconds / rate,
    }


def bench_sampler(preset, cfg, rate, baseline: bool):
    n, g = preset["prompts"], preset["group"]
    p, t = preset["prompt_len"], preset["response_len"]
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(1))
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, cfg.vocab_size, (n, p)).astype(np.int32)
    mask = np.ones((n, p), np.int32)
    kwargs = {"num_samples": g, "max_new_tokens": t, "eos_ids": (), "buckets": (p,)}

    def run(key):
        return sampling.sample(cfg, params, prompts, mask, key, **kwargs)

    seconds = common.median_seconds(run, jax.random.PRNGKey(0))
    generated = int(np.asarray(run(jax.random.PRNGKey(0)).mask).sum())
    b = n * g
    # Decode floor: one step's FLOPs for B rows, attending to the mean cache length.
    step_flops = common.decode_step_flops(cfg, b, p + t / 2)
    result = {
        "sampler/rows": b,
        "sampler/generated_tokens": generated,
        "sampler/seconds": seconds,
        "sampler/tokens_per_s": generated / seconds,
        "sampler/step_ms": 1e3 * seconds / t,
        "sampler/step_floor_ms": 1e3 * step_flops / rate,
        "sampler/step_over_floor": (seconds / t) / (step_flops / rate),
    }
    if baseline:
        loop = common.python_loop_sampler(cfg, params, prompts, mask, g, t)
        loop_s = common.median_seconds(loop, reps=1)
        result["sampler/python_loop_tokens_per_s"] = b * t / loop_s
        result["sampler/speedup_over_python_loop"] = loop_s / seconds
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--baseline", action="store_true", help="also time a per-token Python loop")
    ap.add_argument("--skip_train", action="store_true")
    ap.add_argument("--skip_sampler", action="store_true")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    cfg = models.ModelConfig(
        **preset["model"], param_dtype="float32", dtype=preset["dtype"], remat=preset["remat"]
    )
    device = jax.devices()[0]
    rate = common.matmul_rate(
        dtype=preset["dtype"] if jax.default_backend() != "cpu" else "float32"
    )
    results = {
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "jax": jax.__version__,
        "preset": args.preset,
        "params_M": models.param_count(cfg) / 1e6,
        "matmul_tflops_measured": rate / 1e12,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k in preset["model"]},
    }
    if not args.skip_train:
        results.update(bench_train(preset, cfg, rate))
    if not args.skip_sampler:
        results.update(bench_sampler(preset, cfg, rate, args.baseline))
    width = max(len(k) for k in results)
    for key, value in results.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:<{width}}  {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
