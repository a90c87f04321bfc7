"""Rollout on a long tail: the continuous engine against the static one, on CPU.

Lengths are long-tailed on purpose: sequence b's length L_b is drawn from a lognormal
(capped at T) and forced by a logits bias of +1e4 (the model's full decode step still runs;
only the draw is steered). The bias counts down: the prompt's last token is L_b + 1 and
every fed token x ≥ 2 forces x − 1 next, so the sequence reads L_b, L_b − 1, …, 1 and ends
at token 1, the end token. Each of the B sequences has its own prompt (G = 1).

Measured in one process (same compiled programs for the long-tailed and the uniform batch:
lengths are data):

  continuous   `sample(engine="continuous", num_slots=S)`: S slots over the queue of B
  static B     `sample(engine="static")` on all B rows at once (needs B/S× the KV memory)
  static S     the static engine on chunks of S rows, one after the other (the same rows per
               step and KV budget as the continuous engine)
  uniform      the same B sequences with every length = the long tail's mean

and, for each, wall seconds, useful tokens/s (Σ L_b / wall) and the long-tail / uniform
ratio (the issue's target: ≥ 0.6 for the engine), and the continuous engine's loop steps,
useful-row efficiency (Σ L_b / (steps · S)).

`--simulate` also replays the continuous engine's scheduling (a finished slot takes the next
sequence in the same step; greedy list scheduling) at full size: lognormal(mean 2048,
capped at 8192) lengths, B sequences on S slots, against the static engine's B rows.

    python benchmarks/sampler_longtail.py               # B=64, S=16, mean 48, T=192; ~2-4 min
    python benchmarks/sampler_longtail.py --slots 0 --drain-levels -1 --continuous-only
                                        # `sample`'s defaults (num_slots, drain_levels None)
    python benchmarks/sampler_longtail.py --simulate    # plus the full-size simulation

Benchmark model: benchmarks/sampler.py's (Qwen3-style, d = 256, 4 layers, vocab 4096).
"""

from __future__ import annotations

import argparse
import heapq
import json

import common
import jax
import jax.numpy as jnp
import numpy as np
from sampler import MODEL

from gspo_jax import models, sampling
from gspo_jax.sampling import continuous
from gspo_jax.sampling.options import EngineOptions

BIAS = 1e4
END = 1


def lognormal_lengths(n: int, mean: float, cap: int, sigma: float, seed: int = 0):
    """n lengths ≥ 2 from a lognormal of the given mean (before the cap) and sigma, capped."""
    mu = np.log(mean) - sigma**2 / 2
    draw = np.random.default_rng(seed).lognormal(mu, sigma, n)
    return np.clip(np.round(draw), 2, cap).astype(np.int32)


def _countdown(logits_BV, fed_B):
    """+BIAS on token fed − 1 (the countdown); rows fed the end token get no bias."""
    target = jnp.maximum(fed_B - 1, END)
    return logits_BV + BIAS * jax.nn.one_hot(target, logits_BV.shape[-1], dtype=logits_BV.dtype)


def force_lengths() -> None:
    """Wraps the model's prefill and decode steps (looked up by the samplers at trace time)
    so that the draw follows `_countdown`."""
    prefill, shared, paged = (
        models.prefill_shared,
        models.decode_step_shared,
        models.decode_step_paged,
    )

    def prefill_forced(cfg, params, tokens_QP, mask_QP, **kw):
        cache, logits, routing = prefill(cfg, params, tokens_QP, mask_QP, **kw)
        return cache, _countdown(logits, tokens_QP[:, -1]), routing

    def shared_forced(cfg, params, prompt, response, tokens_B, slot, **kw):
        logits, cache, routing = shared(cfg, params, prompt, response, tokens_B, slot, **kw)
        return _countdown(logits, tokens_B), cache, routing

    def paged_forced(cfg, params, kv, tokens_S, *args, **kw):
        logits, kv = paged(cfg, params, kv, tokens_S, *args, **kw)
        return _countdown(logits, tokens_S), kv

    models.prefill_shared = prefill_forced
    models.decode_step_shared = shared_forced
    models.decode_step_paged = paged_forced


def prompts_for(lengths, width: int):
    """[B, width] prompts ending in L_b + 1 (the countdown's start), other ids ≥ T + 2."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(int(lengths.max()) + 2, MODEL.vocab_size, (len(lengths), width))
    tokens[:, -1] = lengths + 1
    return tokens.astype(np.int32), np.ones_like(tokens, np.int32)


def run_engine(params, tokens, mask, T: int, engine: str, slots, reps: int, drain: int):
    """(median seconds, lengths) of `sample` on these prompts, compiled first. engine
    "static-chunks" runs the static engine on chunks of `slots` rows, one after the other."""
    kw = {"num_samples": 1, "max_new_tokens": T, "eos_ids": (END,), "buckets": (tokens.shape[1],)}
    key = jax.random.key(0)

    def call():
        if engine == "static-chunks":
            outs = [
                sampling.sample(
                    MODEL,
                    params,
                    tokens[i : i + slots],
                    mask[i : i + slots],
                    key,
                    engine="static",
                    **kw,
                )
                for i in range(0, len(tokens), slots)
            ]
            return np.concatenate([np.asarray(o.lengths) for o in jax.block_until_ready(outs)])
        out = sampling.sample(
            MODEL,
            params,
            tokens,
            mask,
            key,
            engine=engine,
            num_slots=slots,
            drain_levels=drain,
            **kw,
        )
        return np.asarray(jax.block_until_ready(out).lengths)

    lengths = call()
    return common.median_seconds(call, reps=reps, warmup=0), lengths


def measure(args) -> dict:
    force_lengths()
    params = models.init_params(MODEL, jax.random.key(0))
    tail = lognormal_lengths(args.batch, args.mean, args.max_new_tokens, args.sigma)
    uniform = np.full_like(tail, round(float(tail.mean())))
    report = {
        "batch": args.batch,
        "slots": args.slots,
        "T": args.max_new_tokens,
        "tail_mean": float(tail.mean()),
        "tail_max": int(tail.max()),
        "default_slots": continuous.plan(
            args.batch, args.prompt_len, args.max_new_tokens, page_size=16
        ).num_slots,
    }
    engines = [("continuous", args.slots or None)]
    if not args.continuous_only:
        engines += [("static", None), ("static-chunks", args.slots or report["default_slots"])]
    for engine, slots in engines:
        for name, lengths in (("tail", tail), ("uniform", uniform)):
            tokens, mask = prompts_for(lengths, args.prompt_len)
            seconds, got = run_engine(
                params,
                tokens,
                mask,
                args.max_new_tokens,
                engine,
                slots,
                args.reps,
                args.drain_levels,
            )
            assert np.array_equal(got, lengths), f"{engine} {name}: lengths not forced"
            report[f"{engine}/{name}_s"] = seconds
            report[f"{engine}/{name}_tokens_per_s"] = float(lengths.sum() / seconds)
        report[f"{engine}/tail_over_uniform"] = (
            report[f"{engine}/tail_tokens_per_s"] / report[f"{engine}/uniform_tokens_per_s"]
        )
    if not args.continuous_only:
        report["continuous_over_static_B"] = report["static/tail_s"] / report["continuous/tail_s"]
        report["continuous_over_static_S"] = (
            report["static-chunks/tail_s"] / report["continuous/tail_s"]
        )
    slots = args.slots or report["default_slots"]
    report["continuous/tail_efficiency_measured"] = measured_efficiency(params, tail, args, slots)
    row_steps = simulate_continuous(tail, slots, args.drain_levels)
    report["continuous/tail_efficiency_simulated"] = float(tail.sum() / row_steps)
    report["static/tail_efficiency"] = float(tail.sum() / (tail.max() * len(tail)))
    return report


def measured_efficiency(params, lengths, args, slots: int) -> float:
    """Σ L_b / the engine's own row-step count (`continuous.run`'s EngineStats)."""
    tokens, mask = prompts_for(lengths, args.prompt_len)
    plan = continuous.plan(len(lengths), args.prompt_len, args.max_new_tokens, num_slots=slots)
    options = EngineOptions(
        num_samples=1,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        top_k=None,
        top_p=None,
        share_prefix=True,
        drain_levels=args.drain_levels,
        layout="trainer",
        kv_dtype="auto",
    )
    out = continuous.run(
        MODEL,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jax.random.key(0),
        np.array([END], np.int32),
        np.int32(0),
        options=options,
        page_plan=plan,
    )
    assert np.array_equal(np.asarray(out[3]), lengths)
    return float(lengths.sum() / int(out[-1].row_steps))


def simulate_continuous(lengths, slots: int, drain_levels: int = 2) -> int:
    """Row steps (decode rows computed) of the continuous engine with no page limit:
    sequences in queue order, each to the slot free first, one token per step (its first
    from the prompt's logits in the step its slot frees); once the queue is empty the loop
    halves its width while at most half its rows run (`continuous.drain_widths`)."""
    free = [0] * min(slots, len(lengths))
    heapq.heapify(free)
    starts, ends = [], []
    for length in lengths:
        start = heapq.heappop(free)
        heapq.heappush(free, start + int(length))
        starts.append(start)
        ends.append(start + int(length))
    ends = np.sort(np.asarray(ends))
    widths = continuous.drain_widths(min(slots, len(lengths)), drain_levels)
    level, row_steps, last_start = 0, 0, max(starts)
    for step in range(int(ends[-1])):
        running = len(ends) - np.searchsorted(ends, step, side="right")
        while step > last_start and level + 1 < len(widths) and running <= widths[level + 1]:
            level += 1
        row_steps += widths[level]
    return row_steps


def simulate_full(args) -> dict:
    """Useful-row efficiency at full size: lognormal(mean 2048, sigma, cap 8192), 3 seeds."""
    out = {}
    for batch, slots in ((512, 64), (512, 128), (1024, 128), (2048, 256)):
        eff = []
        for seed in range(3):
            lengths = lognormal_lengths(batch, 2048, 8192, args.sigma, seed)
            useful = lengths.sum()
            eff.append(
                (
                    useful / simulate_continuous(lengths, slots, args.drain_levels),
                    useful / simulate_continuous(lengths, slots, 0),
                    useful / (lengths.max() * batch),
                )
            )
        c, c0, s = np.mean(eff, axis=0)
        out[f"sim/B{batch}_S{slots}"] = {
            "continuous": round(float(c), 3),
            "continuous_no_drain": round(float(c0), 3),
            "static": round(float(s), 3),
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16, help="0: sample's default (None)")
    ap.add_argument("--continuous-only", action="store_true", help="skip the static engine")
    ap.add_argument("--mean", type=float, default=48.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--drain-levels", type=int, default=2, help="-1: sample's default (None)")
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--simulate-only", action="store_true")
    args = ap.parse_args()
    args.drain_levels = None if args.drain_levels < 0 else args.drain_levels
    report = {} if args.simulate_only else measure(args)
    if args.simulate or args.simulate_only:
        report.update(simulate_full(args))
    for key, value in report.items():
        print(f"{key:40s} {value:.4g}" if isinstance(value, float) else f"{key:40s} {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
