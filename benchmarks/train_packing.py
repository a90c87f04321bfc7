"""The train step packed vs padded on a long-tailed batch and on a uniform one, on this CPU.

One rollout batch of N prompts x G responses (the rollout's layout: P left-padded prompt
columns, T response columns) is trained on by two steps of the same config, measured in
the same process, interleaved (batch by batch, step by step, each round):

  padded   `make_train_step` with packing off: every response T columns long (the prompt
           once per group, `shared_prompt`, as the default config runs it)
  packed   `make_train_step` with `packing=True`: real tokens in rows of pack_length
           (train_step/packing.py), its packed-row bucket chosen per batch

Two batches, the same prompts:

  long_tail  response lengths from the rollout benchmark's lognormal
             (benchmarks/sampler_longtail.py: mean T/4 before the cap, sigma 1, capped at T;
             at the paper's scale mean 2,048, cap 8,192)
  uniform    every response T tokens long (the control: nothing to pack away)

Reported per batch: real tokens (every response token, each group's prompt once: what the
model must read), each step's median seconds and real tokens/s, the packed / padded
speed-up (of the medians, and of each step's fastest run: on a loaded machine the less
noisy one), and the fraction of computed token slots that hold a real token (packed: the
packed rows' non-empty slots, a prompt repeated in a second segment counted as real;
padded: real tokens over the shared-prompt rows' slots), each step's compile (its first
call less its median: the packed step's is one bucket's) and `bucket_break_even_steps`: the
steps of this batch after which one more bucket's compile is paid back by the time packing
saves per step (None: it saved nothing). A run with packing compiles a step per bucket it
reaches instead of the one padded step; `configs/base.py`'s `packing=None` rule rests on
this figure. Targets (issue 39): long tail
packed >= 2.5x padded real tokens/s with >= 90 % of computed slots real; uniform within 5 %.

    python benchmarks/train_packing.py                     # ~3-5 min on 2 cores
    python benchmarks/train_packing.py --json=/tmp/packing.json

Benchmark model: benchmarks/sampler.py's (Qwen3-style, d = 256, 4 layers, vocab 4096), f32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sampler import MODEL
from sampler_longtail import lognormal_lengths

from configs import base as base_config
from gspo_jax import models
from gspo_jax.config.specs import step_config
from gspo_jax.sharding.split import num_micro
from gspo_jax.train_step import TrainState, make_train_step, packing


def make_batch(lengths, *, groups: int, group: int, prompt_len: int, response_len: int):
    """A train batch of these response lengths (prompts of prompt_len − 4 real tokens)."""
    rng = np.random.default_rng(0)
    B = groups * group
    prompt = rng.integers(3, MODEL.vocab_size, (groups, prompt_len)).astype(np.int32)
    prompt_mask = np.ones((groups, prompt_len), np.int32)
    prompt_mask[:, :4] = 0
    response = rng.integers(3, MODEL.vocab_size, (B, response_len)).astype(np.int32)
    response_mask = (np.arange(response_len)[None] < lengths[:, None]).astype(np.int32)
    return {
        "tokens": jnp.asarray(np.concatenate([np.repeat(prompt, group, 0), response], 1)),
        "attention_mask": jnp.asarray(
            np.concatenate([np.repeat(prompt_mask, group, 0), response_mask], 1)
        ),
        "response_mask": jnp.asarray(response_mask, jnp.float32),
        "sampler_logprobs": jnp.asarray(-rng.random((B, response_len)), jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
    }


def real_tokens(batch, group: int, response_len: int) -> int:
    mask = np.asarray(batch["attention_mask"])
    return int(mask[:, -response_len:].sum() + mask[::group, :-response_len].sum())


def timings(batches: dict, sc, tx, params, args):
    """Seconds of the padded and the packed step on every batch, interleaved (batch by
    batch, step by step, `args.reps` rounds after one compiling round): (times, the steps)."""
    padded_sc = dataclasses.replace(sc, packing=False)
    packed_sc = dataclasses.replace(sc, packing=True, pack_length=args.pack_length)
    steps = {"padded": make_train_step(padded_sc, tx), "packed": make_train_step(packed_sc, tx)}
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    times = {(b, s): [] for b in batches for s in steps}
    first = {}
    for rep in range(args.reps + 1):  # the first round compiles
        for b, batch in batches.items():
            for s, fn in steps.items():
                fresh = jax.tree.map(jnp.copy, state)
                t0 = time.perf_counter()
                jax.block_until_ready(fn(fresh, batch))
                if rep:
                    times[b, s].append(time.perf_counter() - t0)
                else:
                    first[b, s] = time.perf_counter() - t0
    return times, first, steps


def measure(batch, times, first, steps, sc, args) -> dict:
    """One batch's figures: medians of its timings, rows, real fractions, and the steps
    after which packing's own compile has paid for itself (`break_even_steps`)."""
    T, group = args.response_length, args.group
    packed, packed_sc = steps["packed"], steps["packed"].step_config
    real = real_tokens(batch, group, T)
    rows = packed.rows(batch)
    B, L = batch["tokens"].shape
    splits = sc.num_mini_batches * num_micro(sc.micro_batch_size, B // sc.num_mini_batches)
    micro_rows = B // splits
    share = max(1, group // splits) if sc.shared_prompt else 1
    padded_slots = splits * (micro_rows * T + (micro_rows // share) * (L - T))
    if rows:
        length = packing.pack_length(packed_sc, L)
        slots, filled = splits * rows * length, 0
        for part in np.split(np.arange(B).reshape(-1, splits).T.ravel(), splits):
            lay = packing.layout(
                batch["tokens"][part],
                batch["attention_mask"][part],
                L - T,
                group=share,
                rows=rows,
                length=length,
            )
            filled += int(jnp.sum(lay.segment_RL > 0))
    else:  # the padded fallback ran
        slots, filled = padded_slots, real
    plan_s = []  # the packed step's own overhead: counting and bucketing the rows
    for _ in range(5):
        t0 = time.perf_counter()
        packed.rows(batch)
        plan_s.append(time.perf_counter() - t0)
    out = {name: float(np.median(v)) for name, v in times.items()}
    best = {name: float(np.min(v)) for name, v in times.items()}
    # the first call compiles (the packed one its bucket's step): a run with packing
    # compiles one step per bucket it reaches instead of one padded step, so each bucket
    # after the first costs a compile, paid back by the time saved per step
    compile_s = {name: first[name] - out[name] for name in out}
    saved_s = out["padded"] - out["packed"]
    return {
        "real_tokens": real,
        "padded_s": out["padded"],
        "packed_s": out["packed"],
        "padded_real_tokens_per_s": real / out["padded"],
        "packed_real_tokens_per_s": real / out["packed"],
        "speedup": out["padded"] / out["packed"],
        "speedup_of_fastest": best["padded"] / best["packed"],
        "packed_real_fraction": filled / slots,
        "padded_real_fraction": real / padded_slots,
        "packed_rows_per_micro_batch": rows,
        "padded_rows_per_micro_batch": micro_rows,
        "packed_plan_s": float(np.median(plan_s)),
        "packed_compiles": len(packed.compiled),  # over both batches: their buckets
        "padded_compile_s": compile_s["padded"],
        "packed_compile_s": compile_s["packed"],
        "bucket_break_even_steps": compile_s["packed"] / saved_s if saved_s > 0 else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8, help="N prompts")
    ap.add_argument("--group", type=int, default=8, help="G responses per prompt")
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--response-length", type=int, default=256, help="T, the lognormal's cap")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--num-mini-batches", type=int, default=2)
    ap.add_argument("--pack-length", type=int, default=0, help="0: prompt + response length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()
    B, T = args.groups * args.group, args.response_length
    config = base_config.get_config()
    config.num_mini_batches = args.num_mini_batches
    sc = dataclasses.replace(
        step_config(config, MODEL),
        group_size=args.group,
        horizon=T,
        micro_batch_size=None,
    )
    params = jax.jit(models.init_params, static_argnums=0)(MODEL, jax.random.PRNGKey(0))
    tx = optax.adamw(1e-6)
    batches = {
        "long_tail": lognormal_lengths(B, T / 4, T, args.sigma),
        "uniform": np.full(B, T, np.int32),
    }
    data = {
        name: make_batch(
            lengths,
            groups=args.groups,
            group=args.group,
            prompt_len=args.prompt_length,
            response_len=T,
        )
        for name, lengths in batches.items()
    }
    times, first, steps = timings(data, sc, tx, params, args)
    results = {}
    for name, batch in data.items():
        mine = {s: times[name, s] for s in ("padded", "packed")}
        its_first = {s: first[name, s] for s in ("padded", "packed")}
        results[name] = r = measure(batch, mine, its_first, steps, sc, args)
        print(
            f"{name:9s} real tokens {r['real_tokens']:6d}  padded {r['padded_s']:.3f} s "
            f"({r['padded_real_fraction']:.0%} real)  packed {r['packed_s']:.3f} s "
            f"({r['packed_real_fraction']:.0%} real, {r['packed_rows_per_micro_batch']} of "
            f"{r['padded_rows_per_micro_batch']} rows)  speed-up {r['speedup']:.2f}x "
            f"(fastest runs: {r['speedup_of_fastest']:.2f}x); row count "
            f"{r['packed_plan_s'] * 1e3:.1f} ms; compile padded {r['padded_compile_s']:.1f} s, "
            f"packed {r['packed_compile_s']:.1f} s; a further bucket paid back after "
            f"{r['bucket_break_even_steps'] or float('inf'):.0f} steps"
        )
    results["setup"] = {
        "batch": B,
        "group": args.group,
        "prompt_length": args.prompt_length,
        "response_length": T,
        "lognormal": {"mean": T / 4, "sigma": args.sigma, "cap": T},
        "num_mini_batches": args.num_mini_batches,
        "pack_length": args.pack_length or args.prompt_length + T,
        "device": jax.devices()[0].device_kind,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
