"""tools.aot's printed output: the per-chip memory table, what does not fit, the largest
HBM contributors, the train step's collective bytes against textbook FSDP, and the
one-paragraph description of the run being compiled."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gspo_jax import models
from gspo_jax.config import specs
from gspo_jax.config import validate as config_lib
from gspo_jax.models import lora
from gspo_jax.models.attention import resolve_impl
from tools.aot_common import GiB, Report
from tools.aot_rollout import rollout_layout


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
