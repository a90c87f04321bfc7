"""Forward and forward+backward throughput of a small dense and a small MoE model.

For each config: tokens/s of the jitted `models.forward` and of `jax.value_and_grad` of
a next-token cross-entropy through it, the model FLOPs per token, the achieved FLOP/s
and its ratio to this machine's f32 matmul FLOP/s (a 2048³ matmul timed right after each
measurement in the same run: absolute times on a shared machine drift, ratios less so).

FLOPs: the model FLOPs of benchmarks/common.py (the same model every benchmark uses):
forward = 2·N_active + 2·D·V (every position gets logits here) + causal attention over
L/2 keys on average; forward+backward = 3 × forward. N_active = matmul parameters a
token touches in the layer stack (q/k/v/o, dense MLP, router, top-k experts only).

The dense and MoE configs have the same active MLP width (dense F = 1024; MoE 16 experts
of F = 512, top-2), so their FLOPs per token nearly match and the ratio shows the cost of
routing, sorting and ragged matmuls. "moe-dense" is the exact all-experts reference
implementation (8x the expert FLOPs; its ratio uses the active count, so it looks slow).
On XLA:CPU `jax.lax.ragged_dot` itself lowers to a masked dense matmul over all E groups
(measured: a 4096x256 @ 16x256x512 ragged_dot takes 20x a plain matmul of the same useful
FLOPs), so on this CPU "moe-ragged" costs about what "moe-dense" does; TPU/GPU lower it
to grouped matmuls. The ratios of the MoE rows here measure that lowering, not the model.

    python benchmarks/forward.py                       # B=8, L=256, ~2 min on 2 cores
    python benchmarks/forward.py --batch 2 --seq 128   # quicker
"""

from __future__ import annotations

import argparse
import dataclasses

import common
import jax
import jax.numpy as jnp

from gspo_jax import models

DENSE = models.ModelConfig(
    arch="qwen3",
    vocab_size=16384,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    qk_norm=True,
    tie_word_embeddings=True,
)
MOE = dataclasses.replace(
    DENSE,
    arch="qwen3_moe",
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    moe_impl="ragged",
)


def bench(name: str, cfg: models.ModelConfig, batch: int, seq: int, reps: int):
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
    mask = jnp.ones((batch, seq), jnp.int32)

    def loss(p):
        logits = models.forward(cfg, p, tokens, mask)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    fwd = jax.jit(lambda p: models.forward(cfg, p, tokens, mask))
    fwd_bwd = jax.jit(jax.value_and_grad(loss))
    n_tokens = batch * seq
    per_token = common.forward_flops(cfg, 1, seq, seq) / seq
    rows = []
    for label, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", fwd_bwd, 3)):
        seconds = common.median_seconds(fn, params, reps=reps)
        # The machine is shared: measure the matmul reference right next to each timing.
        peak = common.matmul_rate()
        achieved = mult * per_token * n_tokens / seconds
        rows.append(
            (
                name,
                label,
                n_tokens / seconds,
                mult * per_token / 1e6,
                achieved / 1e9,
                peak / 1e9,
                achieved / peak,
            )
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-moe-dense", action="store_true")
    args = parser.parse_args()

    configs = [("dense", DENSE), ("moe-ragged", MOE)]
    if not args.skip_moe_dense:
        configs.append(("moe-dense", dataclasses.replace(MOE, moe_impl="dense")))
    rows = []
    for name, cfg in configs:
        rows += bench(name, cfg, args.batch, args.seq, args.reps)

    print(
        f"devices: {jax.devices()[0].device_kind} x{jax.device_count()}  batch={args.batch} seq={args.seq}"
    )
    for name, cfg in configs:
        print(
            f"  {name}: {models.param_count(cfg) / 1e6:.2f}M params, "
            f"{models.param_count(cfg, active=True) / 1e6:.2f}M active"
        )
    header = ("config", "pass", "tokens/s", "MFLOP/token", "GFLOP/s", "matmul GFLOP/s", "ratio")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, label, tps, mflop, gflops, peak, ratio in rows:
        print(
            f"| {name} | {label} | {tps:,.0f} | {mflop:.1f} | {gflops:.1f} | {peak:.0f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
