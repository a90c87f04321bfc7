"""What tools.aot's compile steps share: the per-chip `Report` of one compiled function,
`_compile` (lower, compile, read memory, FLOPs and the optimised HLO's costs), the
ShapeDtypeStruct helpers, the analytic model FLOPs, and `_Abstract` (one run's abstract
params, optimizer state, shardings and sizes). tools/aot.py and tools/aot_rollout.py both
import it."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from tools import hlo_stats

GiB = 2**30


@dataclasses.dataclass
class Report:
    """One compiled function, per chip (bytes), plus its compile seconds and model FLOPs."""

    name: str
    compile_s: float
    args: int = 0
    temp: int = 0
    out: int = 0
    alias: int = 0
    resident: int = 0  # live state the function does not take (e.g. optimizer moments)
    flops: float = 0.0  # model FLOPs of one call, per chip
    error: str | None = None  # XLA's message when it refused to compile (e.g. out of HBM)
    needed: int | None = None  # bytes XLA said it needed, when it refused for memory
    # the roofline estimate's inputs (tools/roofline.py), per chip per call:
    xla_flops: float = 0.0  # XLA's cost analysis (loop bodies counted once)
    xla_bytes: float = 0.0  # XLA's cost analysis 'bytes accessed' (loop bodies once)
    hlo_bytes: float = 0.0  # the same count from the HLO, loops x trip counts (hlo_stats)
    collectives: list = dataclasses.field(default_factory=list)  # hlo_stats.Collective
    unknown_loops: int = 0  # while loops of unknown trip count (counted loop_trips times)
    # where hlo_bytes comes from: hlo_stats.HbmUse, largest first (--hbm_top prints them)
    hbm_uses: list = dataclasses.field(default_factory=list, repr=False)
    # each instruction's executed matmul FLOPs and HBM bytes (hlo_stats.OpCost): the
    # roofline's input; the continuous decode's are analytic (`_engine_ops`)
    ops: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def hbm(self) -> float:
        """HBM bytes per call: the HLO's count with loop trip counts (hlo_stats)."""
        return self.hlo_bytes

    @property
    def total(self) -> int:
        if self.needed is not None:
            return self.needed + self.resident
        return self.args + self.temp + self.out - self.alias + self.resident


def _per_chip(tree) -> int:
    """Bytes per chip of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _sds(abstract, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _batch_sds(mesh, shape, dtype):
    """A batch input as the trainer places it: rows over the batch axes when they divide,
    else replicated (sharding.to_global's rule)."""
    dp = sharding_lib.data_parallel_size(mesh)
    if shape and shape[0] % dp == 0:
        s = sharding_lib.batch_sharding(mesh, len(shape))
    else:
        s = sharding_lib.replicated(mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=s)


def _hbm_needed(message: str) -> int | None:
    """Bytes XLA:TPU said a program needs when it refused it for HBM (None otherwise):
    "... HLO temporaries (548.20G) exceeds available HBM (15.75G)" or "Used 20.5G of
    15.48G hbm" (a lower bound: the first counts temporaries only)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    for pattern in (
        r"\(([\d.]+)([KMGT])\) exceeds available HBM",
        r"Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm",
    ):
        found = re.search(pattern, message)
        if found:
            return int(float(found.group(1)) * scale[found.group(2)])
    return None


def _compile(
    name, fn, *args, resident=0, flops=0.0, loop_trips=1, vocab=0, **kwargs
) -> tuple[Report, Any]:
    """Compiles `fn` for `args`; its Report (memory, model FLOPs, the collectives and the
    executed FLOPs and HBM bytes of each op of its HLO: a loop of unknown trip count runs
    `loop_trips` times; a matmul with a dimension of size `vocab` is a vocab matmul) and
    the compiled function."""
    t0 = time.perf_counter()
    try:
        compiled = fn.lower(*args, **kwargs).compile()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses programs larger than HBM
        message = str(e).strip()
        report = Report(name, time.perf_counter() - t0, resident=resident, flops=flops)
        report.error = message.splitlines()[0][:300]
        report.needed = _hbm_needed(message)
        return report, None
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    report = Report(
        name,
        seconds,
        args=int(mem.argument_size_in_bytes),
        temp=int(mem.temp_size_in_bytes),
        out=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        resident=resident,
        flops=flops,
    )
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    report.xla_flops = float(cost.get("flops", 0.0))
    report.xla_bytes = float(cost.get("bytes accessed", 0.0))
    hlo = compiled.as_text()
    report.collectives = hlo_stats.collectives(hlo, unknown_trip_count=loop_trips)
    report.hbm_uses = hlo_stats.hbm_uses(hlo, unknown_trip_count=loop_trips)
    report.hlo_bytes = float(sum(u.total for u in report.hbm_uses))
    report.ops = hlo_stats.op_costs(hlo, vocab=vocab, unknown_trip_count=loop_trips)
    report.unknown_loops = len(hlo_stats.unknown_trip_loops(hlo))
    return report, compiled


# ---------------------------------------------------------------------------- FLOPs


def _matmul_params(cfg: models.ModelConfig) -> int:
    """Weights a token multiplies (active experts only), without the unembedding."""
    total = 0
    leaves = jax.tree_util.tree_flatten_with_path(models.abstract_params(cfg))[0]
    for path, leaf in leaves:
        names = [getattr(k, "key", None) for k in path]
        if names[0] != "layers" or len(leaf.shape) < 3:  # norms, biases, embedding, head
            continue
        n = math.prod(leaf.shape)
        if names[-2] == "moe" and names[-1] != "router":
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        total += n
    return total


def _mixing_flops(cfg, keys: float) -> float:
    """One token's token mixing: attention's q·k and p·v over `keys` keys in each
    full-attention layer; a hybrid model's Gated DeltaNet layers, the recurrence's
    Sᵀk, k ⊗ δ and Sᵀq, 6·heads·d_k·d_v (the chunked form's intra-chunk products not
    counted: model FLOPs, as attention's are without its masked half)."""
    full = cfg.num_layers - cfg.num_linear_layers
    linear = cfg.num_linear_layers * cfg.linear_num_value_heads
    linear *= 6 * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return 4 * full * cfg.num_heads * cfg.head_dim * keys + linear


def _forward_flops(cfg, rows: int, length: int, logit_tokens: int) -> float:
    """2·(weights)·tokens + token mixing (causal attention: q·k and p·v over half the keys
    on average; `_mixing_flops`) + the unembedding on `logit_tokens` tokens per row."""
    dense = 2 * _matmul_params(cfg) * rows * length
    attention = _mixing_flops(cfg, length / 2) * rows * length
    logits = 2 * cfg.hidden_size * cfg.vocab_size * rows * logit_tokens
    return dense + attention + logits


@dataclasses.dataclass(frozen=True)
class _Abstract:
    """One RL step's inputs for a topology, as sharded `jax.ShapeDtypeStruct`s: the mesh,
    the model (its attention kernel resolved for TPU), the train step's config and
    optimizer, the parameters and optimizer state, and the batch dimensions."""

    c: Any  # the run's ConfigDict
    cfg: models.ModelConfig
    mesh: Any
    chips: int
    N: int  # prompts
    G: int  # responses per prompt
    P: int  # prompt tokens (the largest bucket)
    T: int  # response tokens
    step_config: Any
    tx: Any
    abstract: Any  # the parameters' shapes, unsharded
    param_sh: Any
    opt_sh: Any
    params: Any
    opt_state: Any
    needs_ref: bool  # π_ref stays resident (a KL term)

    @property
    def B(self) -> int:
        return self.N * self.G

    @property
    def L(self) -> int:
        return self.P + self.T

    @property
    def rep(self):
        return sharding_lib.replicated(self.mesh)

    @property
    def idle(self) -> int:
        """Bytes per chip the trainer keeps in HBM between the functions: the optimizer
        state (and π_ref)."""
        return _per_chip(self.opt_state) + (_per_chip(self.params) if self.needs_ref else 0)
