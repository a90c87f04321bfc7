"""Compile a run's every jitted function for a TPU slice, without the TPU: does it fit?

    python -m tools.aot --config=configs/gspo_paper.py --preset=Qwen3-8B \\
        --topology=v5p:4x4x4 --config.response_length=16384 --config.mesh.data=1 \\
        --config.mesh.fsdp=-1 --config.micro_batch_size=64

Run it before renting the slice. It needs libtpu importable (`pip install -r
requirements-tpu.txt`, docs/tpu.md) but no TPU and no weights: the model comes from
`--preset` (published Qwen3 / Qwen3.5 shapes), else the config's `model.hf_path` (its config.json
only), else the config's scratch model. For the topology's chips it builds the config's
mesh (`config.mesh`), the parameter / optimizer / batch shardings the trainer uses, and
lowers and compiles, as `jax.ShapeDtypeStruct`s carrying those shardings, the functions
one RL step calls:

    rollout reshard   sampling.RolloutLayout: the policy's rollout copy, once per RL step
                      (sampling.rollout_layout "tensor" only)
    sampler prefill   the run's engine (sampling.engine): continuous.prefill_pages (one
                      prefill per prompt, written into pages) or static.prefill (static)
    sampler decode    continuous.engine_loop (its loop, one replica per data-parallel chip
                      group) or static.decode (static), every response response_length
                      tokens long
    logprobs          train_step.make_logprobs_fn: π_old (and π_ref) recompute (padded
                      rows, every response response_length long, also with packing)
    advantages        rollout.make_advantage_fn (or the token-level-KL variant)
    train step        train_step.make_train_step: ppo_epochs × num_mini_batches updates

It prints one table, per chip: arguments, XLA's temporaries, outputs (donated buffers
counted once), what else stays resident while the function runs (the optimizer state
during sampling and log-probs; the reference params with a KL term), their total against
the chip's HBM, compile time, and the model FLOPs per chip of one call (analytic: XLA's
cost analysis counts a loop body once, so it undercounts scans). It exits 1 naming the
function and the shortfall when one does not fit (XLA:TPU itself refuses to compile a
program larger than HBM; that error is reported the same way).

Then an op-by-op roofline ESTIMATE per function and per RL step (tools/roofline.py): each
op of the optimised HLO with its executed matmul FLOPs (dots and convolutions x loop trip
counts; splash attention's added from its block sizes) and HBM bytes, timed as the larger
of its compute and HBM time at per-op-class efficiencies, summed; every collective's wire
bytes over the links of the torus axes its group spans, and a latency per ring step
(tools.hlo_stats reads them). Printed: seconds by phase (each pass of the RL
step once), the train step's MFU (model FLOPs, its own π_old pass included) beside its HFU
(executed FLOPs), decode tokens/s/chip. Estimates, not measurements; `--json=FILE` writes
them machine-readably (with each function's memory).
`--hbm_top=N` also prints, per function, the N largest contributors to its HBM bytes
(`hlo_stats.hbm_uses`: instruction, result shape, bytes per execution x executions, alike
instructions such as one per unrolled layer grouped, and the jax op they come from).

The rollout batch is taken at its worst case: every prompt at `prompt_length` (the largest
bucket the sampler can pick) and every response `response_length` long. With `config.packing`
the train step is compiled for the packed rows of a long-tailed batch instead
(`PACKED_LENGTHS`: lognormal, mean response_length / 4, sigma 1, capped), its model FLOPs
those of that batch's real tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from typing import Any

if __name__ == "__main__":  # the command line only: importing this module changes nothing
    from gspo_jax.notices import quiet_known_notices

    quiet_known_notices()

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from gspo_jax import advantages as advantages_lib
from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.config import specs
from gspo_jax.config import validate as config_lib
from gspo_jax.models import lora
from gspo_jax.models.attention import resolve_impl
from gspo_jax.rollout import stage as rollout
from gspo_jax.sampling import static
from gspo_jax.sampling.replicas import replica_count
from gspo_jax.train_step import TrainState, batch_ndims, make_logprobs_fn, make_train_step, optim
from tools import hlo_stats, roofline
from tools.qwen35_presets import QWEN35_PRESETS

GiB = 2**30

# HBM per chip, GiB (Google Cloud TPU system-architecture pages, cloud.google.com/tpu/docs/
# v4, /v5e, /v5p, /v6e): v4 32 GiB HBM2, v5e 16 GiB HBM2, v5p 95 GiB HBM2e, v6e 32 GiB.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}

# Published shapes (the config.json of each Hugging Face repo, architecture fields only).
# Qwen3-0.6B and Qwen3-30B-A3B as in tests/fixtures/models/published_configs.json;
# Qwen3-8B per its model card (36 layers, 32 query / 8 kv heads, 8.2B parameters of which
# 6.95B non-embedding, untied), which these widths reproduce exactly.
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen3-8B": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_hidden_layers=36,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "Qwen3-30B-A3B": dict(
        _QWEN3,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_hidden_layers=48,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=768,
        norm_topk_prob=True,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    **QWEN35_PRESETS,  # Qwen3.5-0.8B, Qwen3.5-35B-A3B: tools/qwen35_presets.py
}
FUNCTIONS = ("prefill", "decode", "logprobs", "advantages", "train_step")


# ------------------------------------------------------------------------------- set-up


def topology_devices(name: str, num_slices: int = 1):
    """The devices of a TPU topology such as "v5p:4x4x4" (libtpu, no TPU needed); with
    `num_slices` > 1, that many such slices (devices carry their `slice_index`)."""
    from jax.experimental import topologies

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices
    except Exception as e:  # no libtpu, or a name libtpu does not know
        raise ValueError(
            f"cannot describe TPU topology {name!r}: {e}. Needs libtpu importable "
            "(pip install -r requirements-tpu.txt) and a name like v5e:2x4 or v5p:4x4x4"
        ) from e


def hbm_bytes(topology: str) -> int:
    generation = topology.split(":")[0]
    if generation not in HBM_GIB:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(HBM_GIB)}")
    return HBM_GIB[generation] * GiB


def model_config_for(config, preset: str | None) -> models.ModelConfig:
    """The run's ModelConfig: a published preset, else what the trainer builds
    (`config.model_config`: the checkpoint's config.json, or the config's scratch model);
    numerics (dtypes, remat, MoE and attention kernels) from config.model."""
    m = config.model
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"--preset={preset!r}: known presets {sorted(PRESETS)}")
        hf = PRESETS[preset]
        layers = hf.get("text_config", hf)["num_hidden_layers"]
        return models.ModelConfig.from_hf_config(hf, **specs.model_numerics(config, layers))
    if m.hf_path:
        return specs.model_config(config, tokenizer=None)
    import tempfile

    from gspo_jax import data

    with tempfile.TemporaryDirectory() as tmp:  # the scratch model's vocabulary
        return specs.model_config(config, data.make_char_tokenizer(tmp))


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


def _train_batch(step_config, mesh, B: int, L: int, T: int) -> dict:
    """The train batch as the trainer builds it: `train_step.batch_ndims`'s entries."""
    shapes = {
        "tokens": (B, L),
        "attention_mask": (B, L),
        "response_mask": (B, T),
        "sampler_logprobs": (B, T),
        "ref_logprobs": (B, T),
        "advantages": (B, T),  # [B] unless token-level advantages
    }
    ints = ("tokens", "attention_mask")
    return {
        name: _batch_sds(mesh, shapes[name][:ndim], jnp.int32 if name in ints else jnp.float32)
        for name, ndim in batch_ndims(step_config).items()
    }


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


# ---------------------------------------------------------------------------- compile


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


def _abstract_run(config, model_config, devices, num_processes) -> _Abstract:
    """The config validated for `devices`, and its mesh, shardings and abstract state."""
    c = config
    processes = num_processes or len({d.process_index for d in devices})
    config_lib.validate(c, num_devices=len(devices), num_processes=processes)
    mesh = sharding_lib.make_mesh(
        config_lib.mesh_shape(c, len(devices)), devices, dcn_data=c.mesh.dcn_data
    )
    cfg = dataclasses.replace(
        model_config,
        attention_impl=resolve_impl(
            model_config.attention_impl, dtype=model_config.dtype, platform="tpu"
        ),
    )
    tx = optim.make_optimizer(specs.optim_spec(c))
    abstract = models.abstract_params(cfg)
    param_sh = sharding_lib.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    # With LoRA only the adapters train: the optimizer state is theirs alone.
    trained, trained_sh = lora.trainable(abstract), lora.trainable(param_sh)
    opt_sh = sharding_lib.optimizer_state_shardings(tx, trained, trained_sh, mesh)
    return _Abstract(
        c=c,
        cfg=cfg,
        mesh=mesh,
        chips=len(devices),
        N=c.rollout_batch_size,
        G=c.num_return_sequences_in_group,
        P=c.prompt_length,
        T=c.response_length,
        step_config=specs.step_config(c, cfg),
        tx=tx,
        abstract=abstract,
        param_sh=param_sh,
        opt_sh=opt_sh,
        params=_sds(abstract, param_sh),
        opt_state=_sds(jax.eval_shape(tx.init, trained), opt_sh),
        # LoRA's π_ref is the base itself (the adapters off): nothing more stays resident.
        needs_ref=bool(c.use_kl_loss or c.add_token_level_kl) and not cfg.lora_rank,
    )


def compile_run(
    config, model_config, devices, *, functions=FUNCTIONS, num_processes=None
) -> list[Report]:
    """Lowers and compiles the RL step's functions for `devices` (a topology's); returns a
    Report per function (memory per chip, compile seconds, model FLOPs per chip).
    `num_processes` (default: the topology's hosts) only enters the config validation."""
    a = _abstract_run(config, model_config, devices, num_processes)
    reports: list[Report] = []
    if "prefill" in functions or "decode" in functions:
        reports += _compile_sampler(a, functions)  # sets its mesh (the rollout's may differ)
    with jax.set_mesh(a.mesh):
        if "logprobs" in functions:
            reports.append(_compile_logprobs(a))
        if "advantages" in functions:
            reports.append(_compile_advantages(a))
        if "train_step" in functions:
            reports.append(_compile_train_step(a))
    return reports


def _decode_flops_per_token(cfg, P: int, T: int) -> float:
    """One decoded token: the weights once, attention over P + T/2 keys on average."""
    per_token = 2 * _matmul_params(cfg) + 2 * cfg.hidden_size * cfg.vocab_size
    return per_token + _mixing_flops(cfg, P + T / 2)


def rollout_layout(config, cfg, mesh_sizes) -> str:
    """The run's resolved `sampling.rollout_layout` for model `cfg` on a mesh of these
    axis sizes."""
    return sharding_lib.resolve_rollout_layout(
        config.sampling.rollout_layout, dict(mesh_sizes), kv_heads=cfg.num_kv_heads
    )


def _compile_sampler(a: _Abstract, functions) -> list[Report]:
    """The sampler's prefill, then its decode on the prefill's outputs (as compiled, with
    their shardings); the reports of those among `functions`. The run's engine
    (`sampling.engine`): the continuous one is `_compile_continuous`."""
    if a.c.sampling.engine == "continuous":
        return _compile_continuous(a, functions)
    with jax.set_mesh(a.mesh):
        return _compile_static(a, functions)


def _compile_static(a: _Abstract, functions) -> list[Report]:
    """The static engine's prefill and decode (`_compile_sampler`)."""
    cfg, N, P, T = a.cfg, a.N, a.P, a.T
    tokens_NP = _batch_sds(a.mesh, (N, P), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=a.rep)
    segments = len(static.cache_segments(T, static.auto_segment_count(T)))
    prefill_kwargs = {
        "num_samples": a.G,
        "share_prefix": True,
        "max_new_tokens": T,
        "segments": segments,
    }
    reports = []
    report, compiled = _compile(
        "sampler prefill",
        static.prefill,
        cfg,
        a.params,
        tokens_NP,
        tokens_NP,
        key,
        resident=a.idle,
        flops=_forward_flops(cfg, N, P, 1) / a.chips,
        vocab=cfg.vocab_size,
        **prefill_kwargs,
    )
    if "prefill" in functions:
        reports.append(report)
    if "decode" not in functions or compiled is None:
        return reports
    shapes = jax.eval_shape(
        lambda p, t, k: static.prefill(cfg, p, t, t, k, **prefill_kwargs),
        a.abstract,
        jax.ShapeDtypeStruct((N, P), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )
    prompt, state, first_logits = _sds(shapes, compiled.output_shardings)[:3]
    # T steps of B rows: the weights once per token, attention over P + t/2 keys.
    per_token = _decode_flops_per_token(cfg, P, T)
    report, _ = _compile(
        "sampler decode",
        static.decode,
        cfg,
        a.params,
        prompt,
        state,
        first_logits,
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=a.rep),  # eos ids
        jax.ShapeDtypeStruct((), jnp.int32, sharding=a.rep),  # pad id
        temperature=float(a.c.sampling.temperature),
        top_k=a.c.sampling.top_k,
        top_p=a.c.sampling.top_p,
        resident=a.idle,
        flops=per_token * a.B * T / a.chips,
        vocab=cfg.vocab_size,
        loop_trips=T,  # the token loop stops early when every row ended: T at worst
    )
    reports.append(report)
    return reports


def _compile_continuous(a: _Abstract, functions) -> list[Report]:
    """The continuous engine as the run lays it out (`sampling.rollout_layout`): the
    rollout copy of the params ("rollout reshard", the tensor layout only), the prefill
    into pages ("sampler prefill") and the engine's loop ("sampler decode": one replica per
    data-parallel chip group, `continuous.replica_axes`). Worst case: every response
    response_length long, so a slot is refilled only when its sequence has decoded them
    all: ⌈sequences / slots⌉ x response_length loop steps per replica."""
    from gspo_jax import sampling

    c, cfg = a.c, a.cfg
    s = c.sampling
    layout = rollout_layout(c, cfg, a.mesh.shape)
    own = int(s.rollout_mesh.tensor)
    mesh = sampling.rollout_mesh(a.mesh.devices.flat, own) if own else a.mesh
    layout = "tensor" if own else layout
    reports = []
    params = a.params
    if layout == "tensor":  # the reshard: from the trainer's params to the rollout's copy
        copy = sampling.RolloutLayout(cfg, mesh, layout)
        # across two meshes (own): no context mesh, the shardings are explicit
        with contextlib.nullcontext() if own else jax.set_mesh(mesh):
            report, _ = _compile("rollout reshard", copy.jitted(a.params), a.params)
        reports.append(report)
        out = jax.eval_shape(lambda p: models.rollout_params(cfg, p), a.abstract)
        params = _sds(out, sampling.rollout_shardings(cfg, out, mesh, layout))
    # The engine compiles on the rollout's own mesh (sampling.rollout_mesh) or the trainer's.
    with jax.set_mesh(mesh):
        return reports + _compile_engine(
            dataclasses.replace(a, mesh=mesh), functions, params, layout
        )


def _compile_engine(a: _Abstract, functions, params, layout: str) -> list[Report]:
    """The continuous engine's prefill and loop on `a.mesh` with the rollout copy
    `params` in `layout` (`_compile_continuous`)."""
    from gspo_jax import sampling
    from gspo_jax.sampling import continuous

    c, cfg, N, P, T, G = a.c, a.cfg, a.N, a.P, a.T, a.G
    s = c.sampling
    reports = []
    tokens_NP = _batch_sds(a.mesh, (N, P), jnp.int32)
    page_size = int(s.page_size)
    report, compiled = _compile(
        "sampler prefill",
        continuous.prefill_pages,
        cfg,
        params,
        tokens_NP,
        tokens_NP,
        resident=a.idle,
        flops=_forward_flops(cfg, N, P, 1) / a.chips,
        vocab=cfg.vocab_size,
        num_samples=G,
        share_prefix=True,
        page_size=page_size,
        layout=layout,
        kv_dtype=s.kv_dtype,
    )
    if "prefill" in functions:
        reports.append(report)
    if "decode" not in functions or compiled is None:
        return reports
    shapes = jax.eval_shape(
        lambda p, t: continuous.prefill_pages(
            cfg,
            p,
            t,
            t,
            num_samples=G,
            share_prefix=True,
            page_size=page_size,
            layout=layout,
            kv_dtype=s.kv_dtype,
        ),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
        jax.ShapeDtypeStruct((N, P), jnp.int32),
    )
    pages, plen, logits = _sds(shapes, compiled.output_shardings)[:3]
    plan = continuous.plan(
        N * G,
        P,
        T,
        num_slots=s.num_slots,
        page_size=page_size,
        kv_budget_tokens=s.kv_budget_tokens,
        replicas=replica_count(a.mesh, layout),
    )
    replicas, local = continuous.replica_axes(a.mesh, layout, N, plan)
    waves = -(-(N * G) // plan.num_slots)
    key = jax.eval_shape(lambda: jax.random.key(0))
    report, compiled = _compile(
        "sampler decode",
        continuous.engine_loop,
        cfg,
        params,
        pages,
        plen,
        logits,
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=a.rep),
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=a.rep),  # eos ids
        jax.ShapeDtypeStruct((), jnp.int32, sharding=a.rep),  # pad id
        resident=a.idle,
        flops=_decode_flops_per_token(cfg, P, T) * a.B * T / a.chips,
        vocab=cfg.vocab_size,
        loop_trips=waves * T,
        num_sequences=N * G,
        max_new_tokens=T,
        page_plan=local,
        temperature=float(s.temperature),
        top_k=s.top_k,
        top_p=s.top_p,
        impl=models.paged_attention_impl(cfg.attention_impl, "tpu", cfg.head_dim, s.kv_dtype),
        drain_levels=0,  # the worst case drains nothing: one loop, its trips counted
        layout=layout,
        replicas=replicas,
        shared_prefix=bool(s.shared_prefix_attention),
    )
    if report.error is None:
        # What a chip reads per step: the weights as the loop holds them (compute dtype,
        # whole over fsdp in the trainer's layout), not as they were handed in.
        out = jax.eval_shape(lambda p: models.rollout_params(cfg, p), a.abstract)
        held = _sds(out, sampling.rollout_shardings(cfg, out, a.mesh, layout))
        pool = pages[0][0] if cfg.is_hybrid else pages[0]  # (pools, DeltaNet states)
        kv = (pool, local, P, T, waves, _shared_prompts(a, pool, local, replicas))
        report.hlo_bytes = _engine_hbm_bytes(cfg, held, *kv)
        report.ops = _engine_ops(cfg, compiled.as_text(), held, *kv, a.B / a.chips)
    reports.append(report)
    return reports


def _shared_prompts(a: _Abstract, pool, local, replicas) -> float:
    """The resident prompts per replica whose whole pages a decode step reads once (int8
    pages, `sampling.shared_prefix_attention`, G > 1: `resident_prompts`), else 0."""
    shared = a.c.sampling.shared_prefix_attention and a.G > 1
    if not (shared and isinstance(pool, models.Int8Pages)):
        return 0.0
    per_replica = a.N * a.G // math.prod(a.mesh.shape[x] for x in replicas)
    return resident_prompts(per_replica, local.num_slots, a.G)


def resident_prompts(num_sequences: int, num_slots: int, group: int) -> float:
    """Distinct prompts among the slots at a step of the engine's worst case (every
    response as long as the longest, so slots refill in waves of `num_slots` consecutive
    sequences; sequence b continues prompt b // G), averaged over the waves: 8 at the
    paper's geometry (64 sequences on 64 slots, G = 8); with fewer slots than sequences a
    wave of S sequences spans ⌈S / G⌉ prompts, or one more where it starts mid-group."""
    waves = -(-num_sequences // num_slots)
    spans = []
    for w in range(waves):
        first, last = w * num_slots, min((w + 1) * num_slots, num_sequences) - 1
        spans.append(last // group - first // group + 1)
    return sum(spans) / waves


def _engine_hbm_bytes(cfg, params, pool, local, P: int, T: int, waves: int, shared=0.0):
    """HBM bytes per chip of the engine's loop, analytic: per step the chip's weights
    (`params` as the loop holds them) once and its slots' real context (P + T/2
    positions on average; pages of the full-attention layers only, bytes per position
    `roofline.paged_kv_bytes_per_position`: an int8 pool's pages and scales, our kernel
    reading them), and a hybrid model's per-slot DeltaNet states (f32, read and written),
    waves x T steps. `shared` > 0 (int8 pages, `sampling.shared_prefix_attention`):
    the shared-prefix attention (`models.paged_prefix`) reads a prompt's whole pages,
    ⌊P / page_size⌋ x page_size positions, once per step for all its resident rows, so the
    context is `shared` (the resident prompts per replica, `resident_prompts`) x those plus
    every slot's own part (the rest of its prompt and T/2); the prompts are assumed full
    length (P), as the slots' responses are (T). The HLO's count would be wrong here: the
    Pallas kernel takes each layer's whole page pool as an operand (it reads only the pages
    of each row's table)."""
    weights = _per_chip(params)
    full = cfg.num_layers - cfg.num_linear_layers
    per_position = full * roofline.paged_kv_bytes_per_position(pool)
    whole = P // local.page_size * local.page_size if shared else 0
    context = (shared * whole + local.num_slots * (P - whole + T / 2)) * per_position
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    context += local.num_slots * cfg.num_linear_layers * state * 4 * 2
    return float(waves * T * (weights + context))


def _engine_ops(cfg, hlo, params, pool, local, P, T, waves, shared, rows_per_chip) -> list:
    """The engine loop's ops for the roofline, analytic (as `_engine_hbm_bytes`): per
    step, the weights' matmuls (the HLO's matmul FLOPs; bytes: the chip's weights once)
    and the ragged paged attention (FLOPs: q·k and p·v over each row's P + T/2
    positions, shared prompt pages or not; bytes: its slots' real context, a resident
    prompt's whole pages once with `shared`), waves x T steps. The attention is priced
    so whether it is a Pallas kernel or XLA's ragged paged attention (head dims the
    kernels refuse, `models.paged_attention_impl`): the latter's matmuls sit in block
    loops of data-dependent trip count inside the decode loop, left out of the weights'
    matmuls (`inner_trip_count=0`; counted like the decode loop they would be an upper
    bound, Qwen3.5-0.8B's 44x its model FLOPs), while loops of known trip count (scanned
    layers) keep theirs."""
    steps = waves * T
    weights = float(_per_chip(params))
    context = _engine_hbm_bytes(cfg, params, pool, local, P, T, waves, shared) / steps - weights
    ops = hlo_stats.op_costs(
        hlo, vocab=cfg.vocab_size, unknown_trip_count=steps, inner_trip_count=0
    )
    matmul = sum(op.flops * op.count for op in ops) / steps
    full = cfg.num_layers - cfg.num_linear_layers
    attention = 4 * full * cfg.num_heads * cfg.head_dim * (P + T / 2)
    attention *= rows_per_chip * T / steps
    kernel = "kernel:int8 shared-prefix attention" if shared else "kernel:ragged_paged_attention"
    return [
        hlo_stats.OpCost("weights", "decode weights (analytic)", "matmul", matmul,
                         int(weights), steps, "engine", "-"),
        hlo_stats.OpCost("attention", f"{kernel} (analytic)", "kernel",
                         attention, int(context), steps, "engine", "-"),
    ]  # fmt: skip


def _compile_logprobs(a: _Abstract) -> Report:
    tokens_BL = _batch_sds(a.mesh, (a.B, a.L), jnp.int32)
    report, _ = _compile(
        "logprobs",
        # padded: its packed rows (a bucket per batch) are data dependent
        make_logprobs_fn(dataclasses.replace(a.step_config, packing=False)),
        a.params,
        tokens_BL,
        tokens_BL,
        a.T,
        resident=a.idle,
        flops=_forward_flops(a.cfg, a.B, a.L, a.T) / a.chips,
        vocab=a.cfg.vocab_size,
    )
    return report


def _compile_advantages(a: _Abstract) -> Report:
    rewards = _batch_sds(a.mesh, (a.B,), jnp.float32)
    valid = _batch_sds(a.mesh, (a.B,), jnp.bool_)
    running = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=a.rep),
        jax.eval_shape(advantages_lib.init_running_moments),
    )
    args = [rewards, valid, running]
    if a.c.add_token_level_kl:
        args += [_batch_sds(a.mesh, (a.B, a.T), jnp.float32)] * 3
    fn = rollout.make_advantage_fn(specs.advantage_spec(a.c), a.mesh).jitted
    report, _ = _compile("advantages", fn, *args, resident=a.idle)
    return report


def train_step_model_flops(a: _Abstract) -> float:
    """Model FLOPs of one train step, all chips: 3 forwards (forward + backward) per update
    over ppo_epochs passes of the rollout, plus 1 forward for the step's own π_old pass
    when it runs one (old_policy.runs_pass: recomputed π_old, a rollout correction, MoE
    routing)."""
    forward = _forward_flops(a.cfg, a.B, a.L, a.T)
    return (3 * a.c.ppo_epochs + runs_old_pass(a.step_config)) * forward


def runs_old_pass(step_config) -> bool:
    from gspo_jax.algorithm import old_policy

    return old_policy.runs_pass(step_config)


def logprob_calls(config) -> int:
    """How often one RL step calls the log-prob function (rollout/stage.py): π_ref with a KL
    term, and π_old for the token-level KL reward when it is recomputed; the train step's
    own π_old pass is inside the train step."""
    needs_ref = bool(config.use_kl_loss or config.add_token_level_kl)
    old = bool(config.add_token_level_kl) and config.old_logprobs_source == "recompute"
    return int(needs_ref) + int(old)


# `config.packing`: the response lengths the packed train step is compiled for (its packed
# rows are data dependent): the rollout benchmark's long tail, lognormal of mean
# response_length / 4, sigma 1, capped at response_length (mean 2,048 at a cap of 8,192).
PACKED_LENGTHS = {"mean_fraction": 0.25, "sigma": 1.0, "seed": 0}


def packed_step_config(a: _Abstract):
    """(the step config with the packed rows `make_train_step` would pick for a batch of
    PACKED_LENGTHS responses and full-length prompts, the fraction of the padded batch's
    tokens that are real). Unchanged (and 1.0) without `packing`."""
    sc = a.step_config
    if not sc.packing or sc.pack_rows:
        return sc, 1.0
    from gspo_jax.sharding.split import num_micro
    from gspo_jax.train_step import packing, step

    mean = PACKED_LENGTHS["mean_fraction"] * a.T
    sigma = PACKED_LENGTHS["sigma"]
    rng = np.random.default_rng(PACKED_LENGTHS["seed"])
    draw = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, a.B)
    lengths = np.clip(np.round(draw), 1, a.T).astype(np.int32)
    mask = np.ones((a.B, a.L), np.int32)
    mask[:, a.P :] = np.arange(a.T)[None] < lengths[:, None]
    mini = a.B // sc.num_mini_batches
    splits = sc.num_mini_batches * num_micro(sc.micro_batch_size, mini)
    _, group = step._micro_batching(sc, mini)
    cpu = jax.devices("cpu")[0]  # the count runs here, off the TPU mesh being compiled for
    auto = (jax.sharding.AxisType.Auto,)
    with jax.set_mesh(jax.make_mesh((1,), ("host",), axis_types=auto, devices=[cpu])):
        needed, _ = packing.rows_needed(sc, jax.device_put(mask, cpu), a.T, splits, group)
    shards = sharding_lib.data_parallel_size(a.mesh)
    rows = packing.bucket_rows(int(needed), a.B // splits, shards)
    return dataclasses.replace(sc, pack_rows=rows), float(mask.sum() / mask.size)


def _compile_train_step(a: _Abstract) -> Report:
    """The train step on a train state whose params and optimizer state it donates; π_ref
    (a KL term) is what else stays resident. With `packing`, its packed rows are those of
    PACKED_LENGTHS (`packed_step_config`) and its model FLOPs those of the real tokens."""
    rep = a.rep
    state_sh = TrainState(step=rep, params=a.param_sh, opt_state=a.opt_sh)
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        params=a.params,
        opt_state=a.opt_state,
    )
    batch = _train_batch(a.step_config, a.mesh, a.B, a.L, a.T)
    step_config, real = packed_step_config(a)
    flops = train_step_model_flops(a) * real / a.chips
    report, _ = _compile(
        "train step",
        make_train_step(step_config, a.tx, state_shardings=state_sh, mesh=a.mesh),
        state,
        batch,
        resident=_per_chip(a.params) if a.needs_ref else 0,
        flops=flops,
        vocab=a.cfg.vocab_size,
    )
    return report


# ------------------------------------------------------------------------------ output


def format_table(reports: list[Report], capacity: int) -> str:
    def gib(x):
        return f"{x / GiB:.2f}"

    header = (
        "| function | compile s | args GiB | temp GiB | out GiB | resident GiB | "
        f"total GiB (of {capacity / GiB:.0f}) | model TFLOP |"
    )
    lines = [
        header,
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        if r.error is not None and r.needed is None:
            lines.append(f"| {r.name} | {r.compile_s:.1f} | compile failed: {r.error} |")
            continue
        out = gib(r.out - r.alias) + (" (donated)" if r.alias else "")
        if r.needed is not None:  # XLA refused: only (a lower bound of) its total is known
            cells = ["-", "-", "-", gib(r.resident), ">= " + gib(r.total) + " (XLA: no fit)"]
        else:
            cells = [gib(r.args), gib(r.temp), out, gib(r.resident), gib(r.total)]
        flops = f"{r.flops / 1e12:.2f}" if r.flops else "-"
        lines.append(f"| {r.name} | {r.compile_s:.1f} | " + " | ".join(cells) + f" | {flops} |")
    return "\n".join(lines)


def shortfalls(reports: list[Report], capacity: int) -> list[str]:
    """One message per function that does not fit (or did not compile)."""
    out = []
    for r in reports:
        if r.error is not None and r.needed is None:
            out.append(f"{r.name} did not compile: {r.error}")
        elif r.total > capacity:
            least = "at least " if r.needed is not None else ""
            out.append(
                f"{r.name} needs {least}{r.total / GiB:.2f} GiB per chip, "
                f"{capacity / GiB:.0f} GiB HBM: {(r.total - capacity) / GiB:.2f} GiB short"
            )
    return out


def format_hbm_top(reports: list[Report], n: int, tokens: dict[str, int] | None = None) -> str:
    """The `n` largest HBM contributors of each compiled function (`hlo_stats.hbm_uses`:
    alike instructions grouped, e.g. one per unrolled layer), per chip per call; `tokens`
    {function: tokens per call} adds a per-token column (the decode's response_length)."""
    out = []
    for r in reports:
        if not r.hbm_uses:
            continue
        per = (tokens or {}).get(r.name)
        out.append(
            f"HBM traffic of {r.name}: {r.hlo_bytes / 1e9:.2f} GB per chip per call"
            + (f", {r.hlo_bytes / per / 1e9:.3f} GB per token" if per else "")
            + f"; the {min(n, len(r.hbm_uses))} largest of {len(r.hbm_uses)} contributors:"
        )
        out.append(
            "| GB | % | " + ("GB per token | " if per else "") + "op | result | MB per "
            "execution | executions | instructions | first of them | jax source |"
        )
        out.append("|---" * (9 + bool(per)) + "|")
        for u in r.hbm_uses[:n]:
            cells = [f"{u.total / 1e9:.2f}", f"{100 * u.total / r.hlo_bytes:.1f}"]
            cells += [f"{u.total / per / 1e9:.4f}"] if per else []
            cells += [u.op, u.shape, f"{u.bytes / 1e6:.2f}", str(u.count)]
            cells += [str(u.instructions), u.name, u.source or "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def fsdp_traffic(config, cfg, reports: list[Report]) -> str | None:
    """The train step's collective bytes per micro-batch against textbook FSDP's: each
    weight gathered three times in the compute dtype (forward, remat, backward) and its
    gradient reduce-scattered in the parameter dtype, per chip."""
    train = next((r for r in reports if r.name == "train step" and r.error is None), None)
    if train is None:
        return None
    sizes = specs.batch_sizes(config)
    micro = config.ppo_epochs * sizes["responses"] // sizes["micro_batch"]
    n = models.param_count(cfg)
    fsdp = n * (3 * jnp.dtype(cfg.dtype).itemsize + jnp.dtype(cfg.param_dtype).itemsize)
    moved = sum(c.bytes * c.count for c in train.collectives if c.group_size > 1) / micro
    return (
        f"train step collectives (est. input): {moved / 1e9:.2f} GB per micro-batch per chip "
        f"({micro} micro-batches) vs textbook FSDP {fsdp / 1e9:.2f} GB (weights gathered "
        f"3x in {cfg.dtype}, gradients reduce-scattered in {cfg.param_dtype}): "
        f"{moved / fsdp:.2f}x"
    )


def describe(config, cfg, topology: str, devices) -> str:
    c = config
    mesh = config_lib.mesh_shape(c, len(devices))
    impl = resolve_impl(cfg.attention_impl, dtype=cfg.dtype, platform="tpu")
    sizes = specs.batch_sizes(c)
    n = models.param_count(cfg)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    dcn = int(c.mesh.dcn_data)
    slices = f" x {dcn} slices" if dcn > 1 else ""
    return (
        f"{cfg.arch} {size} params ({cfg.num_layers} layers{_lora_note(cfg)}) "
        f"on {topology}{slices}: {len(devices)} chips, mesh "
        + " ".join(f"{k}={v}" for k, v in mesh.items())
        + (f" (data: {dcn} slices x {mesh['data'] // dcn})" if dcn > 1 else "")
        + f"\n{c.rollout_batch_size} prompts x {c.num_return_sequences_in_group} = "
        f"{sizes['responses']} responses of {c.prompt_length} + {c.response_length} tokens, "
        f"{c.num_mini_batches} mini-batches of {sizes['mini_batch']}, micro-batch "
        f"{sizes['micro_batch']}, {cfg.param_dtype} params, {cfg.dtype} compute, remat "
        f"{cfg.remat}, attention {impl}, MoE {cfg.moe_impl if cfg.num_experts else '-'}; "
        f"jax {jax.__version__}" + _engine_note(c, cfg, mesh)
    )


def _engine_note(config, cfg, mesh_sizes) -> str:
    """What the sampler rows stand for."""
    if config.sampling.engine != "continuous":
        return "\nsampler rows: the static engine (every row decodes response_length tokens)"
    layout = rollout_layout(config, cfg, mesh_sizes)
    where = (
        f"rollout layout {layout!r} (sampling.rollout_layout={config.sampling.rollout_layout!r})"
    )
    if tensor := int(config.sampling.rollout_mesh.tensor):
        chips = math.prod(dict(mesh_sizes).values())
        where = (
            f"on a rollout mesh of its own (sampling.rollout_mesh.tensor={tensor}: "
            f"{chips // tensor} replicas x tensor {tensor}, layout 'tensor')"
        )
    s = config.sampling
    shared = s.kv_dtype == "int8" and s.shared_prefix_attention
    shared = shared and config.num_return_sequences_in_group > 1
    context = (
        "a resident prompt's whole pages once (shared-prefix attention) and its rows' own context"
        if shared
        else "its rows' real context"
    )
    return (
        f"\nsampler rows: the continuous engine, {where}, at its "
        "worst case: every response response_length long (no slot refilled early); its "
        f"decode HBM bytes are analytic (each step: the chip's weights and {context}), the "
        "HLO handing the kernel whole page pools"
    )


def _lora_note(cfg) -> str:
    """ ", LoRA rank r on ...: N trainable (f32 + Adam: X GiB)" or "" without LoRA."""
    if not cfg.lora_rank:
        return ""
    n = lora.adapter_count(cfg)
    return (
        f", LoRA rank {cfg.lora_rank} on {','.join(cfg.lora_targets)}: {n / 1e6:.1f}M "
        f"trainable, f32 + Adam moments {3 * 4 * n / GiB:.2f} GiB in all"
    )


_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Experiment config file.", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5e:2x4 or v5p:4x4x4.")
_PRESET = flags.DEFINE_enum(
    "preset", None, list(PRESETS), "Published model shapes (no checkpoint needed)."
)
_FUNCTIONS = flags.DEFINE_list("functions", list(FUNCTIONS), f"Subset of {FUNCTIONS}.")
_JSON = flags.DEFINE_string("json", None, "Also write the reports to this JSON file.")
_HBM_TOP = flags.DEFINE_integer(
    "hbm_top",
    0,
    "Also print the N largest HBM contributors of each compiled function (instruction, "
    "result shape, bytes x executions; hlo_stats.hbm_uses), and write them to --json.",
    lower_bound=0,
)
_SLICES = flags.DEFINE_integer(
    "num_slices",
    1,
    "TPU slices of --topology each, joined by the data-center network (multi-slice); needs "
    "--config.mesh.dcn_data equal to it. Collectives across slices are estimated at ICI "
    "speed: DCN bandwidth is not modelled.",
    lower_bound=1,
)
_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    None,
    "JAX processes of the run, for the config's batch checks (default: the topology's "
    "hosts as libtpu describes them, e.g. 2 for v5e:2x4; a single-host v5litepod-8 runs 1).",
)


def prepare_process() -> None:
    """Settings of an aot process (its entry point calls this first, before any jax backend
    starts; importing this module changes nothing): compiling needs libtpu, never a TPU, so
    jax's runtime stays on the CPU (a TPU VM's chips stay free for a run); several compile
    processes may load libtpu at once (it otherwise holds a lockfile); and libtpu does not
    probe the host's TPU metadata."""
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def main(argv) -> int:
    del argv
    if not _TOPOLOGY.value:
        raise app.UsageError("--topology is required (e.g. --topology=v5p:4x4x4)")
    unknown = sorted(set(_FUNCTIONS.value) - set(FUNCTIONS))
    if unknown:
        raise app.UsageError(f"--functions: unknown {unknown}; known {list(FUNCTIONS)}")
    config = _CONFIG.value
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        print(
            "tools.aot: error: libtpu is not installed, and compiling for a TPU needs it "
            "(not a TPU): pip install -r requirements-tpu.txt, or pip install "
            f'"jax[tpu]=={jax.__version__}" (docs/tpu.md)',
            file=sys.stderr,
        )
        return 2
    if _SLICES.value != config.mesh.dcn_data:
        raise app.UsageError(
            f"--num_slices={_SLICES.value} needs --config.mesh.dcn_data={_SLICES.value} "
            f"(it is {config.mesh.dcn_data}): the batch splits over the slices first"
        )
    devices = topology_devices(_TOPOLOGY.value, _SLICES.value)
    capacity = hbm_bytes(_TOPOLOGY.value)
    cfg = model_config_for(config, _PRESET.value)
    print(describe(config, cfg, _TOPOLOGY.value, devices), flush=True)
    reports = compile_run(
        config,
        cfg,
        devices,
        functions=tuple(_FUNCTIONS.value),
        num_processes=_PROCESSES.value,
    )
    print(format_table(reports, capacity))
    decoded = config.rollout_batch_size * config.num_return_sequences_in_group
    decoded *= config.response_length / len(devices)
    chip = roofline.chip_for(_TOPOLOGY.value)
    dims = roofline.torus_dims(_TOPOLOGY.value)
    calls = logprob_calls(config)
    step_config = specs.step_config(config, cfg)
    notes = [
        "train step model FLOPs: 3 forwards per update x ppo_epochs"
        + (" + 1 forward for its own π_old pass" if runs_old_pass(step_config) else "")
        + f"; the log-prob function runs {calls} time(s) per RL step"
        + (" (π_old is the train step's own pass)" if not calls else "")
    ]
    if _SLICES.value > 1:
        notes.append(
            f"{_SLICES.value} slices: the data axis's collectives cross the data-center "
            "network, estimated here at ICI speed (DCN bandwidth is not modelled): a low bound"
        )
    kwargs = {"decoded_tokens": decoded, "logprob_calls": calls, "dims": dims}
    print("\n" + roofline.format_estimates(reports, chip, notes=notes, **kwargs))
    traffic = fsdp_traffic(config, cfg, reports)
    if traffic:
        print(traffic)
    if _HBM_TOP.value:
        tokens = {"sampler decode": config.response_length}
        print("\n" + format_hbm_top(reports, _HBM_TOP.value, tokens))
    if _JSON.value:
        out = roofline.json_summary(reports, chip, **kwargs)
        for r in reports:  # memory and where the HBM bytes go, beside the estimate
            row = out["functions"].setdefault(r.name, {"model_flops": r.flops})
            row["error"] = r.error
            row["compile_s"] = r.compile_s
            row["memory"] = {
                k: getattr(r, k) for k in ("args", "temp", "out", "alias", "resident", "total")
            }
            row["hbm_uses"] = [dataclasses.asdict(u) for u in r.hbm_uses[: _HBM_TOP.value]]
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=2)
    problems = shortfalls(reports, capacity)
    for p in problems:
        print(f"DOES NOT FIT: {p}", file=sys.stderr)
    if not problems:
        peak = max(reports, key=lambda r: r.total)
        print(
            f"fits: peak {peak.total / GiB:.2f} GiB per chip ({peak.name}) of {capacity / GiB:.0f}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    prepare_process()
    app.run(lambda argv: sys.exit(main(argv)))
