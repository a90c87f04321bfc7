"""tools.aot's rollout programs: the sampler's prefill and decode compiled for a TPU
topology as the run's engine makes them (`sampling.engine`: the static engine's
`static.prefill` / `static.decode`, or the continuous engine's `prefill_pages` /
`engine_loop`), with the decode's analytic HBM bytes and its weight matmuls for the
roofline (the continuous engine hands its attention kernel whole page pools, so the HLO's
own byte count says nothing about the pages a step reads). `tools.aot.compile_run` calls
`compile_sampler`."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.sampling import static
from gspo_jax.sampling.replicas import replica_count
from tools import hlo_stats, roofline
from tools.aot_common import (
    Report,
    _Abstract,
    _batch_sds,
    _compile,
    _forward_flops,
    _matmul_params,
    _mixing_flops,
    _per_chip,
    _sds,
)


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


def compile_sampler(a: _Abstract, functions) -> list[Report]:
    """The sampler's prefill, then its decode on the prefill's outputs (as compiled, with
    their shardings); the reports of those among `functions`. The run's engine
    (`sampling.engine`): the continuous one is `_compile_continuous`."""
    if a.c.sampling.engine == "continuous":
        return _compile_continuous(a, functions)
    with jax.set_mesh(a.mesh):
        return _compile_static(a, functions)


def _compile_static(a: _Abstract, functions) -> list[Report]:
    """The static engine's prefill and decode (`compile_sampler`)."""
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
