"""Compile the continuous sampler's engine for TPU chips, ahead of time, with the Pallas
ragged paged attention kernel: does the TPU path compile, what does it hold in HBM, and
which collectives does one decoded token cost?

Nothing runs (no TPU needed): libtpu describes the chips, jax lowers and compiles
`continuous.engine_loop` (impl="pallas": `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
inside the decode loop) on `jax.ShapeDtypeStruct`s. Qwen3-0.6B widths in bfloat16, with
`--layers` of its 28 layers (compile time grows with the unrolled layers; memory per layer
is printed so the full model's can be read off).

`--kv-dtype int8` stores the pages in int8 with per-token scales (`models.Int8Pages`, head
major) and the engine reads them with our own kernel (`models.paged_int8_kernel`; use a
`--page-size` that is a multiple of 128 with it).

`--chips 1` (the default) compiles for one chip. `--chips N --layout tensor|trainer`
compiles for N chips of the topology (mesh fsdp = N) in that rollout layout
(`sampling.RolloutLayout`): "tensor" splits weights, KV heads and vocabulary over the chips
(the kernel runs per chip in a shard_map); "trainer" is the trainer's FSDP rules with the
weights gathered whole once per call. The collectives per decoded token are read from the
optimised HLO (those inside the engine's while_loop).

    PYTHONPATH=/work/main/.libtpu python benchmarks/continuous_aot.py --topology=v5e:2x2
    PYTHONPATH=/work/main/.libtpu python benchmarks/continuous_aot.py --topology=v5e:2x4 \
        --chips 8 --layout tensor
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import models, sampling, sharding
from gspo_jax.models import partition
from gspo_jax.sampling import continuous
from tools import hlo_stats

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
    ap.add_argument("--chips", type=int, default=1, help="chips of the topology to compile for")
    ap.add_argument("--layout", choices=("tensor", "trainer"), default="tensor")
    ap.add_argument("--kv-dtype", choices=("bfloat16", "int8"), default="bfloat16")
    ap.add_argument(
        "--shared-prefix", choices=("on", "off"), default="on",
        help="int8: a prompt's pages read once for its rows (sampling.shared_prefix_attention)",
    )  # fmt: skip
    args = ap.parse_args()
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices
    devices = list(devices)[: args.chips]
    mesh = sharding.make_mesh({"data": 1, "fsdp": len(devices), "tensor": 1, "expert": 1}, devices)
    layout = args.layout if len(devices) > 1 else "trainer"
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
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

    abstract = models.abstract_params(cfg)
    if layout == "tensor":
        shardings = sampling.rollout_shardings(cfg, abstract, mesh, "tensor")
        with partition.layout(sharding.ROLLOUT_RULES):
            heads = partition.spec(mesh, ("kv_heads",), (cfg.num_kv_heads,))[0]
            vocab = partition.spec(mesh, ("vocab",), (cfg.vocab_size,))[0]
    else:  # the trainer's FSDP layout: the engine gathers each weight whole once per call
        shardings = sharding.tree_shardings(abstract, models.logical_axes(cfg), mesh)
        heads = vocab = None
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )
    K2, C = 2 * cfg.num_kv_heads, cfg.head_dim
    P_ = jax.sharding.PartitionSpec
    pages = tuple(_pages(mesh, heads, N * plan.prompt_pages, plan.page_size, K2, C, args.kv_dtype)
                  for _ in range(cfg.num_layers))  # fmt: skip
    key = jax.eval_shape(lambda: jax.random.key(0))
    logits = jax.sharding.NamedSharding(mesh, P_(None, vocab))
    arrays = (
        params,
        pages,
        jax.ShapeDtypeStruct((N,), jnp.int32, sharding=one),
        jax.ShapeDtypeStruct((N, cfg.vocab_size), jnp.float32, sharding=logits),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=one),
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=one),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
    )
    # One replica per data-parallel chip group (the trainer layout: each chip its own rows).
    replicas, local = continuous.replica_axes(mesh, layout, N, plan)
    static = {
        "num_sequences": N * G,
        "max_new_tokens": T,
        "page_plan": local,
        "replicas": replicas,
        "temperature": 1.0,
        "top_k": None,
        "top_p": None,
        "impl": "pallas",
        "layout": layout,
        "drain_levels": 0,  # one loop: its collectives are those of one decoded token
        "shared_prefix": args.shared_prefix == "on",
    }
    start = time.perf_counter()
    # The mesh in context tells Pallas's lowering which chips it compiles for.
    with jax.set_mesh(mesh):
        compiled = continuous.engine_loop.lower(cfg, *arrays, **static).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    # Per chip: a replica's pages (its prompts' and its share of the budget), its kv heads.
    D = len(devices) if replicas else 1
    head_shards = len(devices) if heads is not None else 1
    pool = (1 + N // D * plan.prompt_pages + local.num_pages) * plan.page_size
    pool *= K2 * C * 2 if args.kv_dtype == "bfloat16" else K2 * (C + 4)  # int8 + f32 scales
    pool //= head_shards
    where = "one chip" if len(devices) == 1 else f"{len(devices)} chips, layout {layout!r}"
    where += f", replicas over {'x'.join(replicas)}" if replicas else ""
    print(f"compiled for {args.topology} ({where}) in {seconds:.0f} s, {args.layers} layers")
    print(per_token_collectives(text, args.layers))
    print(
        f"pallas kernel in the program: {'ragged_paged_attention' in text or 'tpu_custom_call' in text}"
    )
    print(f"int8 kernel in the program: {'int8_paged_attention' in text}")
    print(
        f"page pool per layer per chip: {pool / GiB:.3f} GiB ({local.num_pages} response "
        f"pages of {plan.page_size} tokens + {N // D * plan.prompt_pages} prompt pages per "
        f"replica, 1/{head_shards} of the kv heads)"
    )
    for name in ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes"):
        print(f"{name:28s} {getattr(mem, name) / GiB:.3f} GiB")
    print(f"full 28 layers: pool {28 * pool / GiB:.2f} GiB per chip ({args.kv_dtype})")
    return np.asarray(0)


def _pages(mesh, heads, num_pages, page_size, K2, C, kv_dtype):
    """One layer's prompt pages as the prefill hands them over: bf16 [pages, page_size, 2K,
    C], or `models.Int8Pages` (head major: int8 [pages, 2K, page_size, C] and f32 scales
    [pages, 2K, page_size]), split over the kv heads."""
    P_ = jax.sharding.PartitionSpec

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    if kv_dtype == "int8":
        return models.Int8Pages(
            sds((num_pages, K2, page_size, C), jnp.int8, P_(None, heads, None, None)),
            sds((num_pages, K2, page_size), jnp.float32, P_(None, heads, None)),
        )
    return sds((num_pages, page_size, K2, C), jnp.bfloat16, P_(None, None, heads, None))


LOOP = 10**6  # stands for the engine loop's unknown trip count


def per_token_collectives(text: str, layers: int) -> str:
    """The collectives inside the engine's while_loop (one decoded token for every slot):
    count and bytes per step per chip, by kind. The attention's own block loops nest inside
    and count once per block (their trip counts are unknown as well)."""
    per_kind: dict[str, list] = {}
    shapes: dict[tuple, float] = {}
    for c in hlo_stats.collectives(text, unknown_trip_count=LOOP):
        if c.count < LOOP:  # outside the loop: once per call
            continue
        n = c.count / LOOP if c.count < LOOP**2 else c.count / LOOP**2  # nested: per block
        shapes[(c.kind, c.shape)] = shapes.get((c.kind, c.shape), 0) + n
        k = per_kind.setdefault(c.kind, [0.0, 0.0, 0])
        k[0] += n
        k[1] += n * c.bytes
        k[2] = max(k[2], c.bytes)
    if not per_kind:
        return "collectives per decoded token: none"
    rows = [
        f"  {kind:18s} {v[0]:6.0f} per step, {v[1] / 1e6:8.3f} MB per step per chip, "
        f"largest {v[2] / 1e3:.1f} kB"
        for kind, v in sorted(per_kind.items())
    ]
    total = sum(v[0] for v in per_kind.values())
    rows += [f"    {n:4.0f} x {kind} {shape[:70]}" for (kind, shape), n in sorted(shapes.items())]
    return f"collectives per decoded token ({layers} layers): {total:.0f}\n" + "\n".join(rows)


if __name__ == "__main__":
    main()
