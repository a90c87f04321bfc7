"""Per-chip temporaries of one attention call, forward + backward, against sequence length.

Compiles (ahead of time, for a TPU topology; needs libtpu, no TPU) the gradient of one
causal GQA self-attention with Qwen3-0.6B's heads (16 query / 8 kv heads of 128), one
sequence per chip, bf16, with each `model.attention_impl`, and prints XLA's temporaries
per chip. The einsum ("xla") materialises [H, L, L] f32 scores and their cotangent; the
splash kernel keeps scores in VMEM, so its temporaries should grow linearly with L.

    python benchmarks/attention_memory.py --topology v5e:2x2 --lengths 4096,8192,16384
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gspo_jax import sharding as sharding_lib
from gspo_jax.models.attention import self_attention

H, K, C = 16, 8, 128
GiB = 2**30


def temporaries(impl: str, length: int, mesh) -> float | str:
    n = mesh.size
    rows = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES))

    def loss(q, k, v, mask):
        return jnp.sum(self_attention(impl, q, k, v, mask).astype(jnp.float32))

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows)

    q = arg((n, length, H, C), jnp.bfloat16)
    kv = arg((n, length, K, C), jnp.bfloat16)
    mask = arg((n, length), jnp.int32)
    with jax.set_mesh(mesh):
        try:
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, mask).compile()
        except jax.errors.JaxRuntimeError as e:
            return "does not compile: " + str(e).splitlines()[0][:120]
    return compiled.memory_analysis().temp_size_in_bytes / GiB


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--impls", default="splash,xla")
    args = parser.parse_args()
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices
    sizes = {"data": len(devices), "fsdp": 1, "tensor": 1, "expert": 1}
    mesh = sharding_lib.make_mesh(sizes, devices)
    print(f"attention fwd+bwd, {H}/{K} heads x {C}, one row per chip, bf16, {args.topology}")
    print("| L | " + " | ".join(f"{i} temp GiB/chip" for i in args.impls.split(",")) + " |")
    print("|---|" + "---|" * len(args.impls.split(",")))
    for length in (int(x) for x in args.lengths.split(",")):
        cells = []
        for impl in args.impls.split(","):
            t = temporaries(impl, length, mesh)
            cells.append(f"{t:.3f}" if isinstance(t, float) else t)
        print(f"| {length} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
