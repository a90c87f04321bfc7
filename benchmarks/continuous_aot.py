"""Compile the continuous sampler's engine for one TPU chip, ahead of time, with the Pallas
ragged paged attention kernel: does the TPU path compile, and what does it hold in HBM?

Nothing runs (no TPU needed): libtpu describes the chip, jax lowers and compiles
`continuous._engine` (impl="pallas": `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
inside the decode loop) on `jax.ShapeDtypeStruct`s. Qwen3-0.6B widths in bfloat16, with
`--layers` of its 28 layers (compile time grows with the unrolled layers; memory per layer
is printed so the full model's can be read off).

    PYTHONPATH=/work/main/.libtpu python benchmarks/continuous_aot.py --topology=v5e:2x2
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import models
from gspo_jax.sampling import continuous

GiB = 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-budget-tokens", type=int, default=160 * 1024)
    args = ap.parse_args()
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices[0]
    one = jax.sharding.SingleDeviceSharding(device)
    cfg = models.ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=args.layers,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )
    N, G, P, T = args.prompts, args.group, args.prompt_len, args.max_new_tokens
    plan = continuous.plan(
        N * G,
        P,
        T,
        num_slots=args.slots,
        page_size=args.page_size,
        kv_budget_tokens=args.kv_budget_tokens,
    )

    def sds(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)

    params = sds(models.abstract_params(cfg))
    K2, C = 2 * cfg.num_kv_heads, cfg.head_dim
    pages = tuple(
        jax.ShapeDtypeStruct(
            (N * plan.prompt_pages, plan.page_size, K2, C), jnp.bfloat16, sharding=one
        )
        for _ in range(cfg.num_layers)
    )
    key = jax.eval_shape(lambda: jax.random.key(0))
    arrays = (
        params,
        pages,
        jax.ShapeDtypeStruct((N,), jnp.int32, sharding=one),
        jax.ShapeDtypeStruct((N, cfg.vocab_size), jnp.float32, sharding=one),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=one),
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=one),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
    )
    static = {
        "num_sequences": N * G,
        "max_new_tokens": T,
        "page_plan": plan,
        "temperature": 1.0,
        "top_k": None,
        "top_p": None,
        "impl": "pallas",
    }
    start = time.perf_counter()
    # The mesh in context tells Pallas's lowering which chip it compiles for.
    with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("data",))):
        compiled = continuous._engine.lower(cfg, *arrays, **static).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    pool = (1 + N * plan.prompt_pages + plan.num_pages) * plan.page_size * K2 * C * 2
    print(f"compiled for {args.topology} (one chip) in {seconds:.0f} s, {args.layers} layers")
    print(
        f"pallas kernel in the program: {'ragged_paged_attention' in text or 'tpu_custom_call' in text}"
    )
    print(
        f"page pool per layer: {pool / GiB:.3f} GiB ({plan.num_pages} response pages of "
        f"{plan.page_size} tokens + {N * plan.prompt_pages} prompt pages)"
    )
    for name in ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes"):
        print(f"{name:28s} {getattr(mem, name) / GiB:.3f} GiB")
    print(f"full 28 layers: pool {28 * pool / GiB:.2f} GiB per chip (bf16)")
    return np.asarray(0)


if __name__ == "__main__":
    main()
