"""Memory and speed of chunked vs full-logits log-probs (+ gradient), as ratios within one run.

Measures `jax.value_and_grad(sum(token_logprobs))` w.r.t. hidden and unembed for:
  naive      `token_logprobs_naive`: full [B·T, V] f32 logits, plain autodiff (the reference);
  chunked    `token_logprobs`: token-chunked forward + the library's custom VJP, which
             recomputes the logits once in vocabulary slices (all tokens per slice);
  vjp-token  alternative 1: the same custom-VJP math, but the backward loops over the
             forward's token chunks and accumulates ∂L/∂W (a W-sized temporary on XLA:CPU);
  remat      alternative 2: the token chunks under `jax.checkpoint`, plain autodiff inside.
The alternatives live here, not in the library, to show why they lost. For each: XLA's
compiled temporary memory (`memory_analysis().temp_size_in_bytes`: buffers other than the
arguments and the outputs — the outputs include ∂L/∂W, W-sized), the median wall time, and
the achieved FLOP/s over this machine's f32 matmul FLOP/s (a 2048^3 matmul timed in the same
rounds). "useful" FLOPs are the 3 matmuls of forward + backward (6·N·D·V); the chunked
variants also recompute the logits (8·N·D·V executed).

Target (docs/architecture.md, performance rules): chunked memory <= 1/8 of naive at <= 1.3x its time.

    python benchmarks/logprobs_memory.py            # small, then large (V = 151,936) with a
                                                    # chunk-size sweep: ~5 min on 2 idle CPU
                                                    # cores, ~9 min on a loaded machine
    python benchmarks/logprobs_memory.py --quick    # small size only
"""

from __future__ import annotations

import argparse
import statistics

import common
import jax
import jax.numpy as jnp

from gspo_jax.algorithm import logprobs as lp

# Shape letters: B batch, T tokens, D model width, V vocabulary, N = B·T tokens.

SMALL = {"B": 1, "T": 1024, "D": 512, "V": 32_768}
LARGE = {"B": 1, "T": 2048, "D": 1024, "V": 151_936}


def token_logprobs_remat(hidden_BTD, unembed_DV, targets_BT, *, chunk_size=256):
    """Chunked log-probs with `jax.checkpoint` per chunk and autodiff for the backward."""

    def one_chunk(hidden_BCD, targets_BC):
        z_BCV = lp._chunk_logits(hidden_BCD, unembed_DV, 1.0)
        logprob_BC, _, _ = lp._logprob_and_entropy(z_BCV, targets_BC, False)
        return logprob_BC

    one_chunk = jax.checkpoint(one_chunk, prevent_cse=False)
    hidden_KBCD, targets_KBC = lp._to_chunks(hidden_BTD, targets_BT, chunk_size)
    _, logprob_KBC = jax.lax.scan(
        lambda carry, xs: (carry, one_chunk(*xs)), None, (hidden_KBCD, targets_KBC)
    )
    return lp._from_chunks(logprob_KBC, hidden_BTD.shape[1])


def token_logprobs_vjp_token(hidden_BTD, unembed_DV, targets_BT, *, chunk_size=256):
    """The custom VJP with a token-chunked backward: ∂L/∂W accumulated over token chunks.

    Same math as the library's backward, but the loop runs over the forward's token chunks, so
    each step adds a [D, V] matmul result into the ∂L/∂W carry (a W-sized temporary on XLA:CPU,
    which does not fuse the add into the matmul).
    """

    @jax.custom_vjp
    def core(hidden_BTD, unembed_DV):
        return lp._forward(1.0, chunk_size, False, hidden_BTD, unembed_DV, targets_BT)[0]

    def fwd(hidden_BTD, unembed_DV):
        logprob_BT, _, lse_BT = lp._forward(
            1.0, chunk_size, False, hidden_BTD, unembed_DV, targets_BT
        )
        return logprob_BT, (hidden_BTD, unembed_DV, lse_BT)

    def bwd(residuals, g_BT):
        hidden_BTD, unembed_DV, lse_BT = residuals
        T = hidden_BTD.shape[1]
        hidden_KBCD, targets_KBC = lp._to_chunks(hidden_BTD, targets_BT, chunk_size)
        lse_KBC = lp._to_chunks(lse_BT[..., None], targets_BT, chunk_size)[0][..., 0]
        g_KBC = lp._to_chunks(g_BT[..., None], targets_BT, chunk_size)[0][..., 0]

        def one_chunk(d_unembed_DV, xs):
            hidden_BCD, targets_BC, lse_BC, g_BC = xs
            z_BCV = lp._chunk_logits(hidden_BCD, unembed_DV, 1.0)
            p_BCV = jnp.exp(z_BCV - lse_BC[..., None])
            onehot_BCV = jnp.arange(z_BCV.shape[-1]) == targets_BC[..., None]
            d_z_BCV = g_BC[..., None] * (onehot_BCV - p_BCV)
            d_hidden_BCD = jnp.einsum("bcv,dv->bcd", d_z_BCV, unembed_DV)
            return d_unembed_DV + jnp.einsum("bcd,bcv->dv", hidden_BCD, d_z_BCV), d_hidden_BCD

        d_unembed_DV, d_hidden_KBCD = jax.lax.scan(
            one_chunk, jnp.zeros_like(unembed_DV), (hidden_KBCD, targets_KBC, lse_KBC, g_KBC)
        )
        d_hidden_BTD = d_hidden_KBCD.transpose(1, 0, 2, 3).reshape(
            hidden_BTD.shape[0], -1, hidden_BTD.shape[2]
        )
        return d_hidden_BTD[:, :T], d_unembed_DV

    core.defvjp(fwd, bwd)
    return core(hidden_BTD, unembed_DV)


def make_step(fn):
    def loss(hidden_BTD, unembed_DV, targets_BT):
        return jnp.sum(fn(hidden_BTD, unembed_DV, targets_BT))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def inputs(B, T, D, V):
    k_h, k_w, k_y = jax.random.split(jax.random.key(0), 3)
    hidden_BTD = jax.random.normal(k_h, (B, T, D), jnp.float32)
    unembed_DV = jax.random.normal(k_w, (D, V), jnp.float32) * D**-0.5
    targets_BT = jax.random.randint(k_y, (B, T), 0, V)
    return hidden_BTD, unembed_DV, targets_BT


def gib(x: float) -> str:
    return f"{x / 2**30:.3f}"


def compare(name, shape, variants, warmup, repeats):
    """Compiles every variant (memory), then times the timed ones round-robin.

    Round-robin (each round runs every variant once, plus a few 2048^3 matmuls) so that load
    from other processes on a shared machine hits all variants alike; the matmul FLOP/s is the
    median over the same rounds.
    """
    B, T, D, V = shape["B"], shape["T"], shape["D"], shape["V"]
    N = B * T
    args = inputs(B, T, D, V)
    print(
        f"\n## {name}: B={B} T={T} D={D} V={V:,}  (one [B·T, V] f32 logits = {gib(N * V * 4)} GiB)"
    )
    compiled, temp = {}, {}
    for label, fn, _, _ in variants:
        compiled[label] = make_step(fn).lower(*args).compile()
        temp[label] = compiled[label].memory_analysis().temp_size_in_bytes
    timed = [label for label, _, _, is_timed in variants if is_timed]
    mm, mm_args, mm_flops = common.matmul_fn(2048)
    for _ in range(warmup):
        common.seconds(mm, *mm_args)
        for label in timed:
            common.seconds(compiled[label], *args)
    times = {label: [] for label in timed}
    mm_rates = []
    for _ in range(repeats):
        mm_rates.append(mm_flops / min(common.seconds(mm, *mm_args) for _ in range(3)))
        for label in timed:
            times[label].append(common.seconds(compiled[label], *args))
    rate = statistics.median(mm_rates)
    print(
        f"f32 matmul 2048^3, median over the rounds: {rate / 1e9:.1f} GFLOP/s; "
        f"times: median of {repeats} round-robin rounds after {warmup} warm-up"
    )
    t_naive = statistics.median(times["naive"])
    print(
        "| variant | temp GiB | mem / naive | time s | time / naive "
        "| useful FLOP/s / matmul | executed FLOP/s / matmul |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, _, matmuls, is_timed in variants:
        row = f"| {label} | {gib(temp[label])} | {temp[label] / temp['naive']:.3f} "
        if is_timed:
            t = statistics.median(times[label])
            row += (
                f"| {t:.3f} | {t / t_naive:.3f} "
                f"| {6 * N * D * V / t / rate:.3f} | {matmuls * 2 * N * D * V / t / rate:.3f} |"
            )
        else:
            row += "| – | – | – | – |"
        print(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small size")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, small size")
    parser.add_argument("--large_repeats", type=int, default=2, help="timed rounds, large size")
    parser.add_argument(
        "--large_chunk_sizes",
        default="128,256,512,1024",
        help="comma-separated chunk sizes of the large-size sweep (each adds ~1 min)",
    )
    cli = parser.parse_args()
    sweep = [int(c) for c in cli.large_chunk_sizes.split(",")]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")

    def chunked(c):
        return lambda h, w, y: lp.token_logprobs(h, w, y, chunk_size=c)

    def vjp_token(c):
        return lambda h, w, y: token_logprobs_vjp_token(h, w, y, chunk_size=c)

    def remat(c):
        return lambda h, w, y: token_logprobs_remat(h, w, y, chunk_size=c)

    # (label, function, matmuls executed per forward + backward, timed?)
    naive = ("naive", lp.token_logprobs_naive, 3, True)
    compare(
        "small",
        SMALL,
        [
            naive,
            ("chunked c=256", chunked(256), 4, True),
            ("chunked c=128", chunked(128), 4, True),
            ("vjp-token c=256", vjp_token(256), 4, True),
            ("remat c=256", remat(256), 4, True),
        ],
        warmup=1,
        repeats=cli.repeats,
    )
    if cli.quick:
        return
    # The alternatives are only compiled here (memory); timing them at this size would add
    # minutes, and the small size already ranks them.
    compare(
        "large (chunk-size sweep)",
        LARGE,
        [
            naive,
            *[(f"chunked c={c}", chunked(c), 4, True) for c in sweep],
            ("vjp-token c=256", vjp_token(256), 4, False),
            ("remat c=256", remat(256), 4, False),
        ],
        warmup=1,
        repeats=cli.large_repeats,
    )


if __name__ == "__main__":
    main()
