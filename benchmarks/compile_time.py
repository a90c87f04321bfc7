"""Compile time of the train step against model depth, on this CPU and for a TPU topology.

The train step (the differentiated full-sequence pass, 4 mini-batches, micro-batch
accumulation, AdamW) is traced, lowered and compiled ahead of time for Qwen3-0.6B widths
(d = 1024, 16/8 heads × 128, MLP 3072, vocab 151,936, tied) cut to each depth of
`--layers`; nothing runs. With unrolled layers the compiled program grows with depth;
with scanned layers it should not.

    python benchmarks/compile_time.py                                   # CPU, 4/28/48 layers
    python benchmarks/compile_time.py --topology v5e:2x4                # TPU AOT (needs libtpu)

A TPU topology needs libtpu importable (`pip install -r requirements-tpu.txt`, see
docs/tpu.md); the mesh is fsdp over every chip of the topology. The machine may be shared:
interleave runs you compare (`--repeat`) and read ratios, not absolute seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax
import jax.numpy as jnp

from configs import base
from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.config import specs
from gspo_jax.train_step import TrainState, make_train_step, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from tools import aot

QWEN3_0_6B = {
    "arch": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_heads": 16,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
    "qk_norm": True,
    "max_position_embeddings": 40960,
}


def devices_for(topology: str | None):
    if topology is None:
        return jax.devices()[:1], "cpu"
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices, "tpu"


def compile_train_step(num_layers: int, args, devices) -> tuple[float, float]:
    """(trace + lower seconds, compile seconds) of one train step."""
    extra = {}
    if args.attention_impl is not None:
        extra["attention_impl"] = args.attention_impl
    cfg = models.ModelConfig(
        num_layers=num_layers,
        param_dtype="float32",
        dtype="bfloat16",
        remat="full",
        **QWEN3_0_6B,
        **extra,
    )
    config = base.get_config()
    config.rollout_batch_size = args.batch // 8
    config.num_return_sequences_in_group = 8
    config.num_mini_batches = 4
    config.micro_batch_size = args.micro
    config.prompt_length = args.prompt
    config.response_length = args.response
    config.packing = False  # the padded step (packing compiles one step per bucket)
    step_config = specs.step_config(config, cfg)
    tx = optim.make_optimizer(specs.optim_spec(config))
    n = len(devices)
    mesh = sharding_lib.make_mesh({"data": 1, "fsdp": n, "tensor": 1, "expert": 1}, devices)
    abstract = models.abstract_params(cfg)
    param_sh = sharding_lib.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    opt_sh = sharding_lib.optimizer_state_shardings(tx, abstract, param_sh, mesh)
    rep = sharding_lib.replicated(mesh)
    state_sh = TrainState(step=rep, params=param_sh, opt_state=opt_sh)

    def sds(tree, shardings):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )

    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        params=sds(abstract, param_sh),
        opt_state=sds(jax.eval_shape(tx.init, abstract), opt_sh),
    )
    B, T, L = args.batch, args.response, args.prompt + args.response
    batch = aot._train_batch(step_config, mesh, B, L, T)
    fn = make_train_step(step_config, tx, state_shardings=state_sh, mesh=mesh)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = fn.lower(state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="4,28,48", help="comma-separated depths")
    parser.add_argument("--topology", default=None, help="TPU topology, e.g. v5e:2x4")
    parser.add_argument("--batch", type=int, default=64, help="responses per rollout")
    parser.add_argument("--micro", type=int, default=8, help="micro-batch size")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over --layers")
    parser.add_argument("--attention-impl", default=None, help="model.attention_impl")
    args = parser.parse_args()
    devices, _ = devices_for(args.topology)
    where = args.topology or f"cpu x{len(devices)}"
    print(
        f"train step, Qwen3-0.6B widths, {where}, B={args.batch} micro={args.micro} "
        f"L={args.prompt}+{args.response}, bf16 compute, full remat; jax {jax.__version__}"
    )
    print("| layers | round | trace+lower s | compile s |")
    print("|---|---|---|---|")
    for r in range(args.repeat):
        for n in (int(x) for x in args.layers.split(",")):
            lower_s, compile_s = compile_train_step(n, args, devices)
            print(f"| {n} | {r} | {lower_s:.1f} | {compile_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
