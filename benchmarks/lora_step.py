"""The train step with LoRA against full fine-tuning, same model, same batch, one process.

  python benchmarks/lora_step.py                   # configs/default.py's model and batch
  python benchmarks/lora_step.py --rank=16 --rounds=9

configs/default.py's model (char vocabulary, 3 layers, d=64) and rollout geometry (16
prompts x 8 responses of 40 + 16 tokens, 4 mini-batches); random weights and tokens (the
time does not depend on them). Rounds alternate the two jitted steps, so machine drift
hits both alike; prints each one's median seconds, their ratio, and the trainable
parameters and optimizer-state bytes of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import default
from gspo_jax import models
from gspo_jax.config import specs
from gspo_jax.models import lora
from gspo_jax.train_step import TrainState, make_train_step

VOCAB = 100  # the char tokenizer's size (configs/default.py)


def _setup(config, rank: int):
    config.model.lora_rank = rank
    cfg = specs.scratch_model_config(config, vocab_size=VOCAB, eos_token_ids=(1,))
    tx = optax.adamw(1e-4)
    base = lora.base_config(cfg)
    params = models.init_params(base, jax.random.PRNGKey(0))
    if rank:
        params = lora.combine(params, lora.init_adapters(cfg, jax.random.PRNGKey(1)))
    opt_state = tx.init(lora.trainable(params))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
    step = make_train_step(specs.step_config(config, cfg), tx, donate=True)
    trained = sum(x.size for x in jax.tree.leaves(lora.trainable(params)))
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    return {"step": step, "state": state, "trained": trained, "opt_bytes": opt_bytes}


def _batch(config):
    b = config.rollout_batch_size * config.num_return_sequences_in_group
    p, t = config.prompt_length, config.response_length
    rng = np.random.default_rng(0)
    return {
        "tokens": jnp.asarray(rng.integers(0, VOCAB, (b, p + t)), jnp.int32),
        "attention_mask": jnp.ones((b, p + t), jnp.int32),
        "response_mask": jnp.ones((b, t), jnp.float32),
        "sampler_logprobs": jnp.asarray(-rng.random((b, t)) * 3, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=b), jnp.float32),
    }


def _time(run, batch) -> float:
    t0 = time.perf_counter()
    run["state"], metrics = run["step"](run["state"], batch)
    jax.block_until_ready(metrics)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    runs = {
        "full": _setup(default.get_config(), 0),
        "lora": _setup(default.get_config(), args.rank),
    }
    batch = _batch(default.get_config())
    for run in runs.values():
        _time(run, batch)  # compile
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(_time(run, batch))
    print("| train step | trainable params | optimizer state bytes | median s |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        median = statistics.median(times[name])
        print(f"| {name} | {run['trained']:,} | {run['opt_bytes']:,} | {median:.3f} |")
    ratio = statistics.median(times["lora"]) / statistics.median(times["full"])
    print(f"LoRA rank {args.rank} / full: {ratio:.2f}x the train step's time")


if __name__ == "__main__":
    main()
