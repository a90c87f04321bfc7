"""Check the roofline estimator (tools/roofline.py) against this CPU: predicted vs measured.

tools.aot estimates TPU times that nobody here can measure. This script runs the same
estimator code where it can be checked: it measures this machine's matmul FLOP/s and memory
bandwidth, then for three functions of the RL step at two model sizes each

    train step   train_step.make_train_step (π_old pass + the updates, remat as configured)
    logprobs     train_step.make_logprobs_fn (the whole-batch log-prob pass)
    decode       the continuous engine (sampling.continuous.engine_loop): `--response_length`
                 decode steps of `--batch` x group sequences, after a paged prefill

compiles the program for the CPU (normal optimisation, not the tests' -O0), predicts its
time from its optimised HLO (`hlo_stats.op_costs` -> `roofline.estimate`) with this CPU as
the chip (peak = the measured matmul rate, HBM = the measured bandwidth, every efficiency 1:
the measured figures are achieved rates), and measures it (median of `--reps` calls).

    python benchmarks/calibrate_roofline.py                       # a few minutes on 2 cores
    python benchmarks/calibrate_roofline.py --hidden_size=128 --num_layers=1 \\
        --response_length=32 --batch=1 --json=/tmp/cal.json      # seconds (smoke test)

Prints a table and writes `--json`: {"cpu": {...}, "rows": [{"function", "predicted_s",
"measured_s", ...}]}. Target: every predicted / measured within [0.67, 1.5]. The machine may
be shared: the CPU figures are measured in the same run, and `uptime`'s load is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--threads=all" not in sys.argv:  # before jax starts: one thread for every program
    os.environ["XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_cpu_multi_thread_eigen=false",
            "intra_op_parallelism_threads=1",
        ]
    )

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from configs import default
from gspo_jax import models
from gspo_jax.config import specs
from gspo_jax.sampling import continuous
from gspo_jax.train_step import TrainState, make_logprobs_fn, make_train_step
from tools import aot, hlo_stats, roofline


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _median_s(call, reps: int) -> float:
    """Median wall seconds of `call()` (a function returning arrays) after one warm-up."""
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_PROBES: dict = {}


def _probes():
    """The compiled probes (built once): a 2048^2 f32 matmul, an elementwise pass over 256
    MB in place (its buffer donated), the same pass into a fresh output buffer, a loop of
    tiny ops, and 8-row matmuls of 16 matrices of 3 MB (a decode step's shapes)."""
    if not _PROBES:
        n = 2048
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        x = jnp.ones((64 * 2**20,), jnp.float32)  # 256 MB
        _PROBES.update(
            a=a,
            box=[x],
            mm=jax.jit(lambda x, y: x @ y).lower(a, a).compile(),
            stream=jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0),
            fresh=jax.jit(lambda v: v * 0.5 + 1.0).lower(x).compile(),
            tiny=_tiny_op_loop(),
            thin_w=[jnp.full((512, 1536), 1e-3 * i, jnp.float32) for i in range(16)],
            thin_x=jnp.ones((8, 512), jnp.float32),
            thin=jax.jit(_thin_matmuls),
        )
    return _PROBES


def _thin_matmuls(x, ws):
    """8 rows times each matrix of `ws` in turn (a decode step's weight matmuls: 16
    layers' 3 MB matrices, 50 MB, more than this CPU's L2 cache; separate arguments, so
    that no slice of a stacked array is copied first)."""
    acc = jnp.zeros_like(x)
    for w in ws:
        acc = acc + (x @ w)[:, : x.shape[1]]
    return acc


def _tiny_op_loop(trips: int = 20_000):
    """(compiled, its op executions per call): a loop of `trips` steps on 16 floats,
    whose time is nearly all per-op cost (each step's ops counted by the estimator's own
    rule, `hlo_stats.op_costs`, so the cost per op is per op as the estimate counts them)."""

    def loop(x):
        return jax.lax.fori_loop(0, trips, lambda i, v: jnp.sin(v) * 0.5 + i, x)

    compiled = jax.jit(loop).lower(jnp.ones((16,), jnp.float32)).compile()
    executions = sum(op.count for op in hlo_stats.op_costs(compiled.as_text()))
    return compiled, executions


def _once(call) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - t0


def probe_cpu() -> dict:
    """This machine's f32 matmul FLOP/s, memory bandwidth (the in-place pass: read +
    write) and the rate at which fresh buffers are first touched (the fresh pass's extra
    time over the in-place one: page faults; XLA:CPU allocates a call's temporaries and
    outputs anew), the fixed cost of one op execution (`_tiny_op_loop`) and the rate at which
    a matmul packs its larger input (an 8-row matmul's time beyond its FLOPs at the 2048^2
    one's rate), one call of each."""
    p = _probes()
    a, box = p["a"], p["box"]

    def step():
        box[0] = p["stream"](box[0])
        return box[0]

    matmul = 2 * a.shape[0] ** 3 / _once(lambda: p["mm"](a, a))
    donated = _once(step)
    fresh = _once(lambda: p["fresh"](box[0]))
    tiny, executions = p["tiny"]
    per_op = _once(lambda: tiny(jnp.ones((16,), jnp.float32))) / executions
    x, w = p["thin_x"], p["thin_w"]
    size = sum(m.size for m in w)
    thin = _once(lambda: p["thin"](x, w)) - 2 * x.shape[0] * size / matmul
    return {
        "matmul_flops": matmul,
        "bandwidth": 2 * box[0].nbytes / donated,
        "first_touch": box[0].nbytes / max(fresh - donated, 1e-9),
        "op_s": per_op,
        # the 8-row matmuls' time beyond their FLOPs' is packing their matrices
        "matmul_pack": 4 * size / max(thin, 1e-9),
    }


def measure_cpu(reps: int) -> dict:
    """probe_cpu's figures, medians of `reps` after a warm-up."""
    probe_cpu()
    runs = [probe_cpu() for _ in range(reps)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out | {"load": load()}


def cpu_chip(cpu: dict) -> roofline.Chip:
    return roofline.Chip(
        "this CPU (measured)",
        peak_flops=cpu["matmul_flops"],
        hbm_gib=0,
        hbm_bw=cpu["bandwidth"],
        link_bw=1.0,
        torus_axes=0,
        source="benchmarks/calibrate_roofline.py",
        hop_s=0.0,
        efficiency=dict.fromkeys(roofline.EFFICIENCY, 1.0),
        first_touch_bw=cpu["first_touch"],
        op_s=cpu.get("op_s", 0.0),
        matmul_pack_bw=cpu.get("matmul_pack", 0.0),
    )


def run_config(hidden: int, layers: int, args):
    """configs/default.py at this size: f32 (the CPU's matmul rate is f32's), XLA
    attention, one micro-batch of `batch` x group responses."""
    c = default.get_config()
    m = c.model
    m.hidden_size, m.intermediate_size, m.num_layers = hidden, 3 * hidden, layers
    m.num_heads = m.num_kv_heads = max(1, hidden // 64)
    m.head_dim = 64
    m.attention_impl, m.dtype, m.param_dtype, m.remat = "xla", "float32", "float32", args.remat
    c.rollout_batch_size, c.num_return_sequences_in_group = args.batch, args.group
    c.num_mini_batches, c.micro_batch_size = 1, args.batch * args.group
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.prompt_length, c.sampling.prompt_buckets = args.prompt_length, (args.prompt_length,)
    c.response_length, c.eval.batch_size = args.response_length, args.batch * args.group
    c.warm_start.steps = 0
    c.packing = False  # the padded programs (every response full length: packing saves nothing)
    cfg = specs.scratch_model_config(c, vocab_size=args.vocab, eos_token_ids=(1,), pad_token_id=0)
    return c, cfg


TOP = 0  # --top: print the N ops predicted to take longest


def _predict(chip, compiled, vocab: int, loop_trips=1, inner_trips=None) -> tuple[float, dict]:
    ops = hlo_stats.op_costs(
        compiled.as_text(),
        vocab=vocab,
        unknown_trip_count=loop_trips,
        inner_trip_count=inner_trips,
    )
    mem = compiled.memory_analysis()
    fresh = mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    e = roofline.estimate(chip, ops, fresh_bytes=fresh)
    if TOP:
        timed = [(o.count * roofline.op_time(chip, o.cls if o.cls != "kernel" else "matmul",
                                             o.flops, o.bytes, o.packed_bytes), o)
                 for o in ops]  # fmt: skip
        for s, o in sorted(timed, key=lambda x: -x[0])[:TOP]:
            print(
                f"    {s:.4f} s  {o.count:g} x {o.op} {o.shape} {o.flops / 1e6:.1f} MFLOP "
                f"{o.bytes / 1e6:.2f} MB  {o.source[-50:]}"
            )
    return e.high_s, e


def _calibrated(function, size, compiled, call, args, vocab, **trips) -> dict:
    """Times `call` `args.reps` times (after a warm-up), each time right after probing this
    CPU (`probe_cpu`: the machine is shared, its speed drifts with the other jobs' load),
    predicts each call's time from that probe, and reports the medians: predicted,
    measured, and predicted / measured."""
    jax.block_until_ready(call())
    predicted, measured, ratios, probes = [], [], [], []
    for _ in range(args.reps):
        cpu = probe_cpu()
        seconds = _once(call)
        p, e = _predict(cpu_chip(cpu), compiled, vocab, **trips)
        predicted.append(p)
        measured.append(seconds)
        ratios.append(p / seconds)
        probes.append(cpu)
    cpu = {k: statistics.median(c[k] for c in probes) for k in probes[0]}
    row = {
        "function": function,
        "size": size,
        "predicted_s": statistics.median(predicted),
        "measured_s": statistics.median(measured),
        "ratio": statistics.median(ratios),
        "executed_flops": e.executed_flops,
        "hbm_bytes": e.hbm_bytes,
        "by_class_s": {k: v["s"] for k, v in e.classes.items()},
        "cpu": cpu | {"load": load()},
    }
    print(_line(row), flush=True)
    return row


def calibrate_size(hidden: int, layers: int, args) -> list[dict]:
    c, cfg = run_config(hidden, layers, args)
    a = aot._abstract_run(c, cfg, jax.devices()[:1], num_processes=1)
    size = f"d={hidden} x {layers} layers"
    B, L, T, V = a.B, a.L, a.T, cfg.vocab_size
    rng = np.random.default_rng(0)
    params = jax.jit(models.init_params, static_argnums=0)(a.cfg, jax.random.key(0))
    tokens = jnp.asarray(rng.integers(2, V, (B, L)), jnp.int32)
    mask = jnp.ones((B, L), jnp.int32)
    rows = []

    wanted = set(args.functions.split(","))
    # train step (one micro-batch: the π_old pass and one update)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=a.tx.init(params))
    batch = {
        "tokens": tokens,
        "attention_mask": mask,
        "response_mask": jnp.ones((B, T), jnp.float32),
        "sampler_logprobs": jnp.full((B, T), -3.0, jnp.float32),
        "ref_logprobs": jnp.full((B, T), -3.0, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=(B,)), jnp.float32),
    }
    batch = {k: batch[k] for k in aot.batch_ndims(a.step_config)}
    if "train_step" in wanted:
        step = make_train_step(a.step_config, a.tx, donate=False)
        compiled = step.lower(state, batch).compile()
        call = lambda: compiled(state, batch)
        rows.append(_calibrated("train step", size, compiled, call, args, V))

    # log-prob pass
    if "logprobs" in wanted:
        fn = make_logprobs_fn(a.step_config)
        compiled_lp = fn.lower(params, tokens, mask, T).compile()
        call = lambda: compiled_lp(params, tokens, mask)
        rows.append(_calibrated("logprobs", size, compiled_lp, call, args, V))
    if "decode" not in wanted:
        return rows

    # continuous engine: prefill into pages, then T decode steps of every sequence
    N, G, P = a.N, a.G, a.P
    ps = int(c.sampling.page_size)
    tokens_NP = tokens[:N, :P]
    mask_NP = jnp.ones((N, P), jnp.int32)
    opts = {"num_samples": G, "share_prefix": True, "page_size": ps, "layout": "trainer"}
    pages, plen, logits = continuous.prefill_pages(a.cfg, params, tokens_NP, mask_NP, **opts)[:3]
    plan = continuous.plan(N * G, P, T, num_slots=N * G, page_size=ps)
    static = {
        "num_sequences": N * G,
        "max_new_tokens": T,
        "page_plan": plan,
        "temperature": 1.0,
        "top_k": None,
        "top_p": None,
        "impl": "xla",
        "drain_levels": 0,
        "layout": "trainer",
    }
    key = jax.random.key(1)
    eos = jnp.asarray([-1], jnp.int32)  # never sampled: every sequence decodes T tokens
    pad = jnp.asarray(0, jnp.int32)
    engine_args = (a.cfg, params, pages, plen, logits, key, eos, pad)
    compiled = continuous.engine_loop.lower(*engine_args, **static).compile()
    # XLA's paged attention reads the pages in blocks of 8 (models/paged.py), in two while
    # loops per layer up to the longest row: ceil(context / (8 x page_size)) trips, the
    # context growing from P + 1 to P + T over the decode.
    blocks = float(np.mean([-(-(P + t) // (8 * ps)) for t in range(1, T + 1)]))
    run_args = engine_args[1:]
    steps = int(compiled(*run_args)[5])
    if steps != T:
        print(f"  (decode ran {steps} loop steps, predicted for {T})")
    call = lambda: compiled(*run_args)
    trips = {"loop_trips": T, "inner_trips": blocks}
    rows.append(_calibrated(f"decode ({T} steps)", size, compiled, call, args, V, **trips))
    return rows


def _line(r: dict) -> str:
    by = ", ".join(f"{k} {v:.3g}" for k, v in r["by_class_s"].items())
    return (
        f"| {r['function']} | {r['size']} | {r['predicted_s']:.4g} | {r['measured_s']:.4g} "
        f"| {r['ratio']:.2f} | {r['executed_flops'] / 1e9:.2f} | {r['hbm_bytes'] / 1e9:.2f} "
        f"| {by} | {r['cpu']['matmul_flops'] / 1e9:.0f} / {r['cpu']['bandwidth'] / 1e9:.1f} "
        f"| {r['cpu']['load'][0]} |"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden_size", default="256,512", help="model widths, comma-separated")
    p.add_argument("--num_layers", default="2,4", help="layers per width, comma-separated")
    p.add_argument("--response_length", type=int, default=256)
    p.add_argument("--prompt_length", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="prompts (x --group responses)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--remat", default="full")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--top", type=int, default=0, help="print each function's N longest ops")
    p.add_argument("--functions", default="train_step,logprobs,decode", help="a subset")
    p.add_argument(
        "--threads",
        default="1",
        choices=("1", "all"),
        help="1 (default): every program and probe on one thread, so that on a shared "
        "machine each gets the same share of a core; all: XLA's own threading",
    )
    args = p.parse_args()
    global TOP
    TOP = args.top
    hidden = [int(x) for x in str(args.hidden_size).split(",")]
    layers = [int(x) for x in str(args.num_layers).split(",")]
    if len(layers) == 1:
        layers *= len(hidden)
    cpu = measure_cpu(args.reps)
    print(
        f"this CPU: matmul {cpu['matmul_flops'] / 1e9:.1f} GFLOP/s (f32), memory "
        f"{cpu['bandwidth'] / 1e9:.2f} GB/s, first touch of fresh buffers "
        f"{cpu['first_touch'] / 1e9:.2f} GB/s, a matmul's packing "
        f"{cpu['matmul_pack'] / 1e9:.2f} GB/s, {cpu['op_s'] * 1e9:.0f} ns per op; load "
        f"average {cpu['load']}; jax "
        f"{jax.__version__}, {os.cpu_count()} cores",
        flush=True,
    )
    print(
        "| function | size | predicted s | measured s | predicted / measured | executed "
        "GFLOP | HBM GB | predicted s by class | CPU GFLOP/s / GB/s (medians of the probes) "
        "| load |\n|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    rows = []
    for h, n in zip(hidden, layers, strict=True):
        rows += calibrate_size(h, n, args)
    ratios = [r["ratio"] for r in rows]
    inside = sum(0.67 <= x <= 1.5 for x in ratios)
    print(
        f"predicted / measured: {min(ratios):.2f} to {max(ratios):.2f}; {inside} of "
        f"{len(ratios)} within [0.67, 1.5]; load average now {load()}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
