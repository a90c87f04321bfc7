"""Rollout-sampler speed: decode ms/step against its FLOP floor, prefill sharing, tokens/s.

Everything is measured in one run and reported as ratios (absolute times on a shared
machine drift; ratios within a run do not):

  matmul rate   f32 1024×1024 matmul FLOP/s of this machine, the floor's yardstick
  decode        ms per decode step of `static.decode` (B = N·G rows, eos_ids=() so every
                row runs all T steps; T − 1 `models.decode_step_shared` steps, token 0 comes
                from the prefill)
  floor         one step's model FLOPs (benchmarks/common.py: B rows through the layer
                stack and the unembedding, attending to the mean cache length P + T/2),
                divided by the matmul rate
  matmuls only  the step's weight matmuls alone (same shapes, same while_loop, nothing else):
                what this machine's XLA:CPU reaches on [B, D] × [D, F] products; decode /
                matmuls only is the per-round ratio of the two (attention, norms, sampling
                and loop overhead on top of the matmuls), the least load-sensitive number
  data parallel the same decode with the prompts (so their G rows) split over the D
                XLA:CPU devices this script creates (--devices, default 2 = this machine's
                cores) and params replicated: jit follows the inputs' shardings, as `sample`
                does on a pod's data axis. On one device the step's small ops run ~1.3 of
                2 cores (XLA:CPU only splits a matmul over threads when its output is wide)
  prefill       `static.prefill` at G = 8 with the shared prefix vs G = 1 (~1: the group
                costs nothing), and G = 8 without sharing vs with
  tokens/s      whole `sample` calls (prefill + decode) vs (a) a naive loop: T jitted steps,
                each re-running `models.forward` over the fixed padded [B, P + T] sequence
                (one compile; 8 of its T steps timed, all cost the same) and (b) a per-token
                Python loop over the model's cached decode step (one dispatch per token:
                the dispatch-bound style; `common.python_loop_sampler`)

Decode rows are measured in interleaved rounds — each round times the matmul rate and then
the decode — and report the median over rounds of the per-round ratio.

Benchmark model: Qwen3-style, d = 256, 4 layers, 4 query heads × 64, 2 kv heads, MLP 512,
vocab 4096, tied embeddings (3.4 M parameters), random init.

    python benchmarks/sampler.py              # N=4, G=8, P=64, T=128; about 2 minutes
    python benchmarks/sampler.py --profile    # also: the top XLA ops of one decode step
    python benchmarks/sampler.py --devices 1  # no data-parallel split (the row is 1 device)
    python benchmarks/sampler.py --cores 1 --devices 1 --decode-only   # the one-core bound alone

One core: the default run also starts itself again pinned to one core (`--cores 1`), and
reports decode / floor there, both measured on that core. That ratio is the step's
core-time over the floor's: a perfect split of the same work over the machine's cores
(each as fast as the one) would give the same ratio, so it is what the multi-core decode
could reach, not what it can beat.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

import common
import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import models, sampling
from gspo_jax.sampling import static

MODEL = models.ModelConfig(
    arch="qwen3",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def make_prompts(n: int, length: int, vocab: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, vocab, (n, length)).astype(np.int32)
    return jnp.asarray(tokens), jnp.ones((n, length), jnp.int32)


def prefill_fn(cfg, params, tokens, mask, g, share, t, segments=1):
    key = jax.random.key(1)

    def run():
        return static.prefill(
            cfg,
            params,
            tokens,
            mask,
            key,
            num_samples=g,
            share_prefix=share,
            max_new_tokens=t,
            segments=segments,
        )

    return run


def decode_fn(cfg, params):
    """`static.decode` at τ = 1 with no end token. Runs wherever its inputs live (one
    device, or rows sharded over a mesh)."""
    eos, pad = np.zeros((0,), np.int32), np.int32(0)

    def run(prompt, state, logits):
        out = static.decode(
            cfg, params, prompt, state, logits, eos, pad, temperature=1.0, top_k=None, top_p=None
        )
        return jax.block_until_ready(out)

    return run


def time_decode_once(prefill, run, t) -> float:
    """Seconds per model step of one `_decode` call (its donated state comes fresh)."""
    args = jax.block_until_ready(prefill()[:3])
    holder = {}
    elapsed = common.seconds(lambda: holder.setdefault("out", run(*args)))
    assert int(holder["out"][0].step) == t, "decode stopped early: expected all T steps"
    return elapsed / (t - 1)


def matmul_chain_fn(cfg, params, batch, steps):
    """The decode step's weight matmuls alone, chained through a while_loop."""
    layers = [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(cfg.num_layers)]
    D = cfg.hidden_size
    emb = params["embed"]["embedding"]

    @jax.jit
    def run(x_BD):
        def body(_, x):
            for p in layers:
                a, m = p["attn"], p["mlp"]
                q = x @ a["q_proj"]["kernel"].reshape(D, -1)
                k = x @ a["k_proj"]["kernel"].reshape(D, -1)
                v = x @ a["v_proj"]["kernel"].reshape(D, -1)
                kv = jnp.concatenate([k, v], axis=-1)
                x = x + (q + kv[:, : q.shape[1]]) @ a["o_proj"]["kernel"].reshape(-1, D)
                g = x @ m["gate_proj"]["kernel"]
                u = x @ m["up_proj"]["kernel"]
                x = x + (jax.nn.silu(g) * u) @ m["down_proj"]["kernel"]
            logits = x @ emb.T
            return x + 1e-6 * logits[:, :D]

        return jax.lax.fori_loop(0, steps, body, x_BD)

    x = jax.random.normal(jax.random.key(4), (batch, D), jnp.float32)
    run(x).block_until_ready()

    def once():
        return common.seconds(run, x) / steps

    return once


def naive_sampler(cfg, params, tokens_NP, mask_NP, g, t, steps=8):
    """Re-encodes the whole padded sequence with `models.forward` at every step. Every step
    costs the same (fixed shape), so `run` times the first `steps` of the T and returns
    seconds per token step."""
    tokens_BP = jnp.repeat(tokens_NP, g, axis=0)
    mask_BP = jnp.repeat(mask_NP, g, axis=0)
    B, P = tokens_BP.shape

    @jax.jit
    def step(tokens_BL, mask_BL, s, key):
        logits = models.forward(cfg, params, tokens_BL, mask_BL)
        last = jax.lax.dynamic_index_in_dim(logits, P + s - 1, axis=1, keepdims=False)
        tok = jax.random.categorical(jax.random.fold_in(key, s), last).astype(jnp.int32)
        tokens_BL = jax.lax.dynamic_update_slice(tokens_BL, tok[:, None], (0, P + s))
        mask_BL = jax.lax.dynamic_update_slice(mask_BL, jnp.ones((B, 1), jnp.int32), (0, P + s))
        return tokens_BL, mask_BL

    def run():
        tokens_BL = jnp.concatenate([tokens_BP, jnp.zeros((B, t), jnp.int32)], axis=1)
        mask_BL = jnp.concatenate([mask_BP, jnp.zeros((B, t), jnp.int32)], axis=1)
        key = jax.random.key(2)
        jax.block_until_ready(step(tokens_BL, mask_BL, jnp.int32(0), key))

        def steps_loop(tokens_BL, mask_BL):
            for s in range(steps):
                tokens_BL, mask_BL = step(tokens_BL, mask_BL, jnp.int32(s), key)
            return tokens_BL

        return common.seconds(steps_loop, tokens_BL, mask_BL) / steps

    return run


def _decode_hlo(prefill, params, cfg) -> str:
    """The compiled `_decode` program's text (its op names map profile events to jax ops)."""
    prompt, state, logits = prefill()[:3]
    return (
        static.decode.lower(
            cfg, params, prompt, state, logits, np.zeros((0,), np.int32), np.int32(0),
            temperature=1.0, top_k=None, top_p=None,
        )
        .compile()
        .as_text()
    )  # fmt: skip


def profile_decode(prefill, run, cfg, params, steps: int, top: int = 16):
    """Time per decode step by jax operation (jax.profiler trace of one `_decode` call,
    XLA:CPU ops mapped back to the einsum / primitive they came from)."""
    text = _decode_hlo(prefill, params, cfg)
    args = jax.block_until_ready(prefill()[:3])
    total, _ = common.profile_ops(run, *args, compiled_text=text)
    print(
        f"\nDecode step by operation (profiler on, {sum(total.values()) / 1e6 / steps:.3f} ms "
        "per step in all; dot_general = q/k/v/o and MLP projections, ...d,dv->...v = the "
        "unembedding, the other einsums attention):"
    )
    for name, ns in total.most_common(top):
        print(f"  {ns / 1e6 / steps:7.3f} ms  {name}")


def pin_to_cores(n: int) -> None:
    """Restricts this process to its first `n` allowed CPUs (before XLA starts its threads)."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= n <= len(allowed):
        raise SystemExit(f"--cores {n}: need 1 to {len(allowed)} (the CPUs this process may use)")
    os.sched_setaffinity(0, allowed[:n])


def decode_rounds(cfg, params, tokens, mask, G, T, rounds, floor_flops):
    """Per-round (decode s/step, matmul FLOP/s, decode / floor), interleaved as in main."""
    segments = static.auto_segment_count(T)
    prefill = prefill_fn(cfg, params, tokens, mask, G, True, T, segments)
    run = decode_fn(cfg, params)
    time_decode_once(prefill, run, T)  # compile
    out = []
    for _ in range(rounds):
        rate = common.matmul_rate(n=1024, reps=3)
        step = time_decode_once(prefill, run, T)
        out.append((step, rate, step / (floor_flops / rate)))
    return out


def one_core_bound(args) -> dict | None:
    """decode / floor of this benchmark re-run pinned to one core (a child process: XLA's
    thread pool is sized when the backend starts). None where affinity is not available."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    cmd = [
        sys.executable, os.path.abspath(__file__), "--cores", "1", "--devices", "1",
        "--decode-only", "--rounds", str(args.rounds), "--prompts", str(args.prompts),
        "--group", str(args.group), "--prompt-len", str(args.prompt_len),
        "--new-tokens", str(args.new_tokens),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"one-core run failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="N")
    ap.add_argument("--group", type=int, default=8, help="G")
    ap.add_argument("--prompt-len", type=int, default=64, help="P (all real tokens)")
    ap.add_argument("--new-tokens", type=int, default=128, help="T")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the non-decode rows")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved matmul/decode rounds")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--devices",
        type=int,
        default=2,
        help="XLA:CPU devices: the data-parallel decode row shards "
        "the rows over them, as the sampler shards over a pod's data axis",
    )
    ap.add_argument(
        "--cores",
        type=int,
        default=0,
        help="pin the process to this many CPUs (0: all it may use; the default run also "
        "measures a one-core child, `--cores 1`)",
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="only the decode / floor rounds on one device; prints one JSON line",
    )
    args = ap.parse_args()
    if args.cores:
        pin_to_cores(args.cores)  # before XLA sizes its thread pool
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the first computation
    cfg, N, G = MODEL, args.prompts, args.group
    P, T, reps = args.prompt_len, args.new_tokens, args.reps
    B = N * G
    params = models.init_params(cfg, jax.random.key(0))
    tokens, mask = make_prompts(N, P, cfg.vocab_size)
    segments = static.auto_segment_count(T)
    print(
        f"model: {models.param_count(cfg) / 1e6:.2f}M params ({common.matmul_params(cfg) / 1e6:.2f}M in "
        f"matmuls), N={N} G={G} B={B} P={P} T={T}, decode segments {segments}, "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    )

    floor_flops = common.decode_step_flops(cfg, B, P + T / 2)
    if args.decode_only:
        rounds = decode_rounds(cfg, params, tokens, mask, G, T, args.rounds, floor_flops)
        step, rate, ratio = (statistics.median(r[i] for r in rounds) for i in range(3))
        print(json.dumps({"cores": len(os.sched_getaffinity(0)), "step_ms": step * 1e3,
                          "rate_gflops": rate / 1e9, "decode/floor": ratio}))  # fmt: skip
        return
    run = decode_fn(cfg, params)
    prefill = prefill_fn(cfg, params, tokens, mask, G, True, T, segments)
    prefill_1 = prefill_fn(cfg, params, tokens, mask, G, True, T, 1)
    chain = matmul_chain_fn(cfg, params, B, T - 1)
    # Data parallel: prompts (so the decode rows, G per prompt) split over D devices,
    # params replicated; jit follows the inputs' shardings (what `sample` does on a mesh).
    D = jax.device_count()
    if N % D:
        ap.error(f"--prompts {N} must be a multiple of --devices {D} (prompts split evenly)")
    mesh = jax.make_mesh((D,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    prefill_dp = prefill_fn(
        cfg,
        jax.device_put(params, replicated),
        jax.device_put(tokens, rows_sharding),
        jax.device_put(mask, rows_sharding),
        G,
        True,
        T,
        segments,
    )
    run_dp = decode_fn(cfg, jax.device_put(params, replicated))
    decodes = {
        "decode": (prefill, run),
        "decode_1": (prefill_1, run),
        "decode_dp": (prefill_dp, run_dp),
    }
    for pre, fn in decodes.values():
        time_decode_once(pre, fn, T)  # compile
    rows = collections.defaultdict(list)
    for _ in range(args.rounds):
        rate = common.matmul_rate(n=1024, reps=3)
        floor_s = floor_flops / rate
        rows["rate"].append(rate)
        for name, (pre, fn) in decodes.items():
            rows[name].append(time_decode_once(pre, fn, T))
        rows["chain"].append(chain())
        for name in (*decodes, "chain"):
            rows[name + "/floor"].append(rows[name][-1] / floor_s)
        rows["decode/chain"].append(rows["decode"][-1] / rows["chain"][-1])
    med = {k: statistics.median(v) for k, v in rows.items()}
    rate = med["rate"]
    floor_ms = floor_flops / rate * 1e3

    pre_g1 = common.median_seconds(
        lambda: jax.block_until_ready(prefill_fn(cfg, params, tokens, mask, 1, True, T)()),
        reps=reps,
    )
    pre_g8 = common.median_seconds(
        lambda: jax.block_until_ready(prefill_fn(cfg, params, tokens, mask, G, True, T)()),
        reps=reps,
    )
    pre_g8_ns = common.median_seconds(
        lambda: jax.block_until_ready(prefill_fn(cfg, params, tokens, mask, G, False, T)()),
        reps=reps,
    )

    def full(share):
        def go():
            out = sampling.sample(
                cfg,
                params,
                tokens,
                mask,
                jax.random.key(3),
                num_samples=G,
                max_new_tokens=T,
                eos_ids=(),
                buckets=(P,),
                share_prefix=share,
            )
            return jax.block_until_ready(out.tokens)

        return go

    sample_s = common.median_seconds(full(True), reps=reps)
    sample_ns_s = common.median_seconds(full(False), reps=reps)
    one = one_core_bound(args)
    loop_s = common.median_seconds(
        common.python_loop_sampler(cfg, params, tokens, mask, G, T), reps=1
    )
    naive_s = naive_sampler(cfg, params, tokens, mask, G, T)() * T  # s per T-token call

    one_core_row = []
    if one is not None:
        cores = len(os.sched_getaffinity(0))
        note = (
            f"{one['step_ms']:.3f} ms/step at {one['rate_gflops']:.1f} GFLOP/s, both on that "
            f"core: a perfect split over {cores} cores gives this ratio"
        )
        one_core_row = [("decode / floor, pinned to 1 core", f"{one['decode/floor']:.2f}x", note)]
    table = [
        ("f32 matmul rate (1024^3)", f"{rate / 1e9:.1f} GFLOP/s", f"median of {args.rounds} rounds"),
        ("decode FLOP floor", f"{floor_ms:.3f} ms/step", f"{floor_flops / 1e6:.1f} MFLOP, B={B}, mean cache {P + T // 2} keys"),
        ("decode step", f"{med['decode'] * 1e3:.3f} ms", f"{segments} cache segments"),
        ("decode / floor", f"{med['decode/floor']:.2f}x", f"target <= 2x (best round {min(rows['decode/floor']):.2f}x)"),
        ("decode step, 1 segment", f"{med['decode_1'] * 1e3:.3f} ms", f"{med['decode_1/floor']:.2f}x floor"),
        (f"decode step, data parallel x{D}", f"{med['decode_dp'] * 1e3:.3f} ms", f"{med['decode_dp/floor']:.2f}x floor (best round {min(rows['decode_dp/floor']):.2f}x): rows over {D} XLA:CPU devices"),
        *one_core_row,
        ("matmuls only", f"{med['chain'] * 1e3:.3f} ms", f"{med['chain/floor']:.2f}x floor: XLA:CPU bound"),
        ("decode / matmuls only", f"{med['decode/chain']:.2f}x", "the step's overhead over its weight matmuls (least load-sensitive)"),
        ("prefill G=1", f"{pre_g1 * 1e3:.2f} ms", f"N={N} prompts of {P}"),
        (f"prefill G={G} shared", f"{pre_g8 * 1e3:.2f} ms", f"{pre_g8 / pre_g1:.2f}x G=1"),
        (f"prefill G={G} not shared", f"{pre_g8_ns * 1e3:.2f} ms", f"{pre_g8_ns / pre_g8:.2f}x shared"),
        ("sample() shared", f"{B * T / sample_s:,.0f} tok/s", f"{sample_s * 1e3:.0f} ms per call"),
        ("sample() not shared", f"{B * T / sample_ns_s:,.0f} tok/s", f"{sample_s / sample_ns_s:.2f}x shared's speed"),
        ("per-token Python loop", f"{B * T / loop_s:,.0f} tok/s", f"decode_step_shared per token; sample() is {loop_s / sample_s:.1f}x"),
        ("naive re-encode loop", f"{B * T / naive_s:,.0f} tok/s", f"forward per token; sample() is {naive_s / sample_s:.0f}x"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in table)
    print(f"\n| {'quantity':<{width}} | value | note |\n|{'-' * (width + 2)}|---|---|")
    for name, value, note in table:
        print(f"| {name:<{width}} | {value} | {note} |")
    if args.profile:
        profile_decode(prefill, run, cfg, params, T - 1)


if __name__ == "__main__":
    main()
