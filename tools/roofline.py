"""An ESTIMATE of a compiled function's time per chip, op by op, from its optimised HLO.

ESTIMATES, not measurements: nothing here ran on the chips it names. The same code predicts
this CPU's measured times (benchmarks/calibrate_roofline.py): that is its check.

Inputs, per compiled function and per chip (tools/aot.py collects them):

- every instruction of the optimised HLO that computes or moves HBM bytes
  (`hlo_stats.op_costs`): its executed matmul FLOPs (dots and convolutions, the ones in its
  fusion body included, x the trip counts of the loops around it) and its HBM bytes
  (`hlo_stats.hbm_bytes`' rule). Grouped-matmul kernels (XLA:TPU's ragged-dot,
  megablox's gmm / tgmm) carry their FLOPs as a cost estimate, read as matmuls; other
  Pallas kernels carry none in the HLO: splash attention's are added analytically from its operand shapes and block size
  (`kernel_cost`); the continuous engine's decode, whose paged attention kernel takes
  whole page pools as operands, is costed analytically by tools/aot.py, its bytes per
  context position from the pool's storage (`paged_kv_bytes_per_position`: bf16 pages, or
  int8 pages and their per-token scales);
- every collective with its execution count (`hlo_stats.collectives`).

The model, per chip:

    op time     = count x max(FLOPs / (peak x eff[class]), HBM bytes / (HBM bw x eff["HBM"]))
                  class: "matmul", "vocab matmul" (a dimension of the vocabulary's size: the
                  unembedding and its gradients), "attention kernel" (Pallas) or
                  "elementwise" (no matmul FLOPs: HBM time only)
                  (a CPU's matmul adds its larger input's bytes / matmul_pack_bw to its
                  FLOP time: the panels it packs; measured for a CPU, 0 for a TPU: not
                  modelled)
    ops         = sum of op times (one op at a time, as a TPU core runs them), plus
                  count x op_s, a fixed cost per op execution: measured for a CPU
                  (benchmarks/calibrate_roofline.py), 0 for a TPU (not modelled)
    wire bytes  = collective bytes x ring factor: all-gather, reduce-scatter, all-to-all
                  (n-1)/n, all-reduce 2(n-1)/n (a reduce-scatter then an all-gather),
                  collective-permute 1 (n devices in the group)
    ICI         = sum of count x wire bytes / (axis bandwidth x eff["ICI"]): a group of n
                  chips spans the fewest torus axes whose sizes multiply to n, and gets
                  those axes' links only: 2 links per axis x the one-way link bandwidth (a
                  bidirectional ring; on an axis without wraparound the middle link carries
                  n/2 shards each way, about what a ring's links carry)
    latency     = sum of count x ring steps x hop latency (steps: the spanned axes' sizes
                  - 1, summed; x2 for an all-reduce; 1 for a permute)

    estimate    = [max(ops, ICI) + latency,  ops + ICI + latency]
                  (collectives hidden under compute, to not hidden at all)

No estimate is below executed FLOPs / peak (every efficiency is at most 1). MFU = model FLOPs
/ (estimate x peak), HFU = executed FLOPs / (estimate x peak), printed side by side.

Chip table: peak, HBM and ICI figures as published (the pages in CHIPS, retrieved 2026-11).
The efficiencies and the hop latency are this module's ASSUMPTIONS (no TPU was at hand to
measure them), stated in EFFICIENCY; the CPU calibration checks the model's structure with
measured CPU figures, not these numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GiB = 2**30

# Per-op-class efficiencies on TPU: ASSUMPTIONS, not measured. Large bf16 matmuls on the
# MXU run near peak, less the pipeline fill of each tile ("matmul", "vocab matmul" 0.8);
# splash attention is a Pallas kernel doing block-by-block softmax bookkeeping between its
# matmuls on the VPU (0.6; its causal block skipping is counted in its FLOPs, not here);
# streaming ops reach ~85 % of HBM bandwidth (ragged paged attention is reported at up to
# ~86 % of it); a ring collective ~80 % of its links' bandwidth.
EFFICIENCY = {
    "matmul": 0.8,
    "vocab matmul": 0.8,
    "attention kernel": 0.6,
    "HBM": 0.85,
    "ICI": 0.8,
}
_HOP = 1e-6  # seconds per ring step of a collective: an ASSUMPTION (~1 us per ICI hop)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: peak dense FLOP/s, HBM size and bandwidth, its inter-chip links,
    and the efficiency of each op class on it."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (a CPU: its measured matmul FLOP/s)
    hbm_gib: float
    hbm_bw: float  # bytes/s
    link_bw: float  # bytes/s one way, per ICI link (NVLink: per direction, the switch's share)
    torus_axes: int  # 2 (v5e, v6e), 3 (v4, v5p); 1 for a switch (GPUs) or none (CPU)
    source: str
    hop_s: float = _HOP
    efficiency: dict = dataclasses.field(default_factory=lambda: dict(EFFICIENCY))
    # bytes/s at which a call's freshly allocated buffers are first touched (a CPU's page
    # faults: XLA:CPU allocates a call's temporaries and outputs anew); 0: no such cost
    # (an accelerator's HBM is allocated once)
    first_touch_bw: float = 0.0
    # seconds every op execution costs on top of its FLOPs and bytes (launch, dispatch):
    # a CPU's is measured (XLA:CPU runs each op as a thunk); 0 for the accelerators: NOT
    # MODELLED, an assumption that under-states programs of many small ops (a decode step)
    op_s: float = 0.0
    # bytes/s at which a matmul packs its larger input before computing, added to its
    # compute time: a CPU's is measured (XLA:CPU's matmuls copy that operand into cache-sized
    # panels; a matmul of 8 rows spends most of its time there); 0 for the accelerators: NOT
    # MODELLED (the MXU / tensor cores stream their operands while they compute, the
    # roofline's max of compute and HBM time stands)
    matmul_pack_bw: float = 0.0

    @property
    def ici_bw(self) -> float:
        """Bidirectional bytes/s over all the chip's links (the published per-chip figure)."""
        return self.link_bw * 2 * 2 * self.torus_axes


CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s; 3-D torus,
    # 6 links of 45 GB/s each way (jax-ml.github.io/scaling-book/tpus, "TPU specs").
    "v4": Chip("TPU v4", 275e12, 32, 1200e9, 45e9, 3, "cloud.google.com/tpu/docs/v4"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, 1,600 Gbps
    # ICI one way per chip over a 2-D torus's 4 links: 50 GB/s per link each way.
    "v5e": Chip("TPU v5e", 197e12, 16, 819e9, 50e9, 2, "cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, 4,800 Gbps
    # one way per chip over a 3-D torus's 6 links: 100 GB/s per link each way.
    "v5p": Chip("TPU v5p", 459e12, 95, 2765e9, 100e9, 3, "cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, 800 GB/s
    # bidirectional ICI per chip (2-D torus, 4 links: 100 GB/s per link each way).
    "v6e": Chip("TPU v6e", 918e12, 32, 1638e9, 100e9, 2, "cloud.google.com/tpu/docs/v6e"),
    # nvidia.com/en-us/data-center/h100 (SXM): 1,979 TFLOP/s bf16 with sparsity = 989.5
    # dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional through a switch.
    "h100": Chip("H100 SXM", 989.5e12, 80, 3.35e12, 225e9, 1,
                 "nvidia.com/en-us/data-center/h100"),
    # nvidia.com/en-us/data-center/h200: the H100's compute, 141 GB HBM3e at 4.8 TB/s.
    "h200": Chip("H200 SXM", 989.5e12, 141, 4.8e12, 225e9, 1,
                 "nvidia.com/en-us/data-center/h200"),
}  # fmt: skip


def chip_for(topology: str) -> Chip:
    """The chip of a topology name such as "v5p:4x4x4" (or a bare "h100")."""
    generation = topology.split(":")[0].lower()
    if generation not in CHIPS:
        raise ValueError(f"unknown chip {generation!r} in {topology!r}; known: {sorted(CHIPS)}")
    return CHIPS[generation]


def torus_dims(topology: str) -> tuple[int, ...]:
    """ "v5p:4x4x4" -> (4, 4, 4); a bare chip name -> ()."""
    _, _, dims = topology.partition(":")
    return tuple(int(d) for d in dims.split("x")) if dims else ()


def ring_factor(kind: str, n: int) -> float:
    """Bytes each chip sends per byte hlo_stats counts, for a group of n devices."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    factors = {
        "all-gather": share,
        "reduce-scatter": share,
        "all-to-all": share,
        "all-reduce": 2 * share,
        "collective-permute": 1.0,
    }
    if kind not in factors:
        raise ValueError(f"unknown collective kind {kind!r}; known: {sorted(factors)}")
    return factors[kind]


def spanned_axes(group: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The torus axes a group of `group` chips spans: the fewest (largest first) whose
    sizes multiply to at least `group`; without dims (a switch), one axis of `group`."""
    if not dims:
        return (group,)
    out, covered = [], 1
    for d in sorted(dims, reverse=True):
        if covered >= group:
            break
        out.append(min(d, -(-group // covered)))
        covered *= d
    return tuple(out)


def collective_time(chip: Chip, c, dims: tuple[int, ...]) -> tuple[float, float, float]:
    """(wire bytes per chip, ICI seconds, latency seconds) of all executions of one
    collective (hlo_stats.Collective-like: kind, bytes, count, group_size)."""
    if c.group_size <= 1:
        return 0.0, 0.0, 0.0
    wire = c.count * c.bytes * ring_factor(c.kind, c.group_size)
    axes = spanned_axes(c.group_size, dims)
    links = 2 * len(axes)
    seconds = wire / (links * chip.link_bw * chip.efficiency["ICI"])
    steps = 1 if c.kind == "collective-permute" else sum(d - 1 for d in axes)
    steps *= 2 if c.kind == "all-reduce" else 1
    return wire, seconds, c.count * steps * chip.hop_s


# ------------------------------------------------------------------- Pallas kernels


def _qkv_arrays(types) -> list[tuple[tuple[int, ...], int]]:
    """([B, heads, L, C], bytes per element) of a kernel's floating-point operands of 3 or
    4 dimensions (a micro-batch of one row comes as [heads, L, C])."""
    from tools import hlo_parse

    out = []
    for t in types:
        for d, s in hlo_parse._arrays(t):
            if len(s) in (3, 4) and d in ("bf16", "f32", "f16"):
                out.append(((1,) * (4 - len(s)) + tuple(s), hlo_parse._DTYPE_BYTES[d]))
    return out


# matmuls of one (query block, key block) pair, x2 FLOPs each: forward q·kᵀ and p·v; dq
# recomputes q·kᵀ, do·vᵀ and forms ds·k; dkv recomputes q·kᵀ, do·vᵀ and forms pᵀ·do, dsᵀ·q;
# the fused backward (one kernel, dq partials per key block as an extra output) all five
_SPLASH_FLOPS = {"fwd": 4, "dq": 6, "dkv": 8, "fused": 10}


def kernel_cost(op) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of one execution of a Pallas kernel op (hlo_stats.OpCost with
    cls "kernel"): splash attention's from its operand shapes [B, heads, L, C] ([heads, L,
    C] for one row) and block
    size (attention._splash_block: the causal mask skips blocks above the diagonal, so
    (n + 1) / 2n of the n x n blocks run, each in full; K and V are re-read for each query
    block); any other kernel: no FLOPs, the HLO's bytes."""
    name = op.op.removeprefix("kernel:")
    if "splash_mha" not in name:
        return 0.0, float(op.bytes)
    from gspo_jax.models.attention import _splash_block
    from tools import hlo_parse

    kind = next((k for k in ("dkv", "dq", "fwd") if f"_{k}" in name), "fwd")
    arrays = _qkv_arrays(op.operands)
    if not arrays:
        return 0.0, float(op.bytes)
    rank = max(len(s) for t in op.operands for _, s in hlo_parse._arrays(t))
    if kind == "dkv" and any(len(s) > rank for _, s in hlo_parse._arrays(op.shape)):
        kind = "fused"  # use_fused_bwd_kernel: dq partials per key block come out too
    (B, H, L, C), _ = max(arrays, key=lambda a: a[0][1])
    (_, K, _, _), kv_size = min(arrays, key=lambda a: a[0][1])
    n = L // _splash_block(L)
    frac = (n + 1) / (2 * n)
    flops = _SPLASH_FLOPS[kind] * B * H * C * L * L * frac
    reread = (n * frac - 1) * 2 * B * K * L * C * kv_size
    return flops, float(op.bytes) + max(reread, 0.0)


LANES = 128  # a TPU vector register's lanes: an array's minor dimension pads to them


def paged_kv_bytes_per_position(pool) -> float:
    """HBM bytes the continuous decode's paged attention kernel reads per context position
    of one layer, per chip (the pool's shard): a float pool [pages, page_size, 2K, C] (jax's
    ragged paged attention) 2K·C x its itemsize; an int8 pool (`models.Int8Pages`, head
    major: q [pages, 2K, page_size, C] int8, scale [pages, 2K, page_size] f32; our kernel,
    `models.paged_int8_kernel`) 2K·C bytes plus 2K scales of 4 bytes, a page's scale row
    padded to whole 128-lane rows (page_size 16: 8x the scale bytes; 128 or more: none).
    `pool`: arrays or ShapeDtypeStructs (with a sharding: its shard's shape)."""

    def shard(x):
        sharding = getattr(x, "sharding", None)
        return sharding.shard_shape(x.shape) if sharding is not None else x.shape

    def itemsize(x):
        return x.dtype.itemsize if hasattr(x.dtype, "itemsize") else int(x.dtype(0).nbytes)

    if hasattr(pool, "q") and hasattr(pool, "scale"):
        _, K2, ps, C = shard(pool.q)
        padded = -(-ps // LANES) * LANES
        return K2 * C * itemsize(pool.q) + K2 * itemsize(pool.scale) * padded / ps
    _, _, K2, C = shard(pool)
    return K2 * C * itemsize(pool)


# ------------------------------------------------------------------------ estimates


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One function's estimated seconds per call, per chip, by op class."""

    classes: dict  # class -> {"flops", "bytes", "s"}: op classes and "ICI" (bytes: wire)
    ops_s: float  # sum of per-op times
    ici_s: float
    latency_s: float
    collectives: int  # inter-chip collective executions per call
    executed_flops: float
    hbm_bytes: float
    wire_bytes: dict  # per collective kind: wire bytes per chip per call

    @property
    def low_s(self) -> float:
        return max(self.ops_s, self.ici_s) + self.latency_s

    @property
    def high_s(self) -> float:
        return self.ops_s + self.ici_s + self.latency_s

    @property
    def bound(self) -> str:
        """The class that takes the most time."""
        return max(self.classes, key=lambda k: self.classes[k]["s"]) if self.classes else "-"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "est_seconds": [self.low_s, self.high_s],
            "bound": self.bound,
        }


def op_time(chip: Chip, cls: str, flops: float, nbytes: float, packed: float = 0.0) -> float:
    """Seconds of one execution of one op: its matmul time (with its packing, `packed`
    bytes at `chip.matmul_pack_bw`, where the chip has one) or its HBM time, the larger."""
    eff = chip.efficiency
    compute = flops / (chip.peak_flops * eff[cls]) if flops else 0.0
    if flops and packed and chip.matmul_pack_bw:
        compute += packed / chip.matmul_pack_bw
    return max(compute, nbytes / (chip.hbm_bw * eff["HBM"]))


def estimate(
    chip: Chip, ops, collectives=(), dims: tuple[int, ...] = (), fresh_bytes: float = 0.0
) -> Estimate:
    """`ops`: hlo_stats.OpCost-like (cls, flops, bytes, count, op, operands); a "kernel"
    op's FLOPs and bytes come from `kernel_cost` unless its flops are already set (an
    analytic op); `collectives`: hlo_stats.Collective-like; `dims`: the torus's axes;
    `fresh_bytes`: the call's temporaries and outputs, first touched at
    `chip.first_touch_bw` (class "first touch"; a CPU's page faults); every op execution
    costs `chip.op_s` more (class "per-op cost": a CPU's measured dispatch; 0 on TPU)."""
    classes: dict[str, dict] = {}
    total_s = flops_sum = bytes_sum = 0.0
    for op in ops:
        cls, flops, nbytes = op.cls, op.flops, float(op.bytes)
        if cls == "kernel":
            cls = "attention kernel"
            if not flops:
                flops, nbytes = kernel_cost(op)
        seconds = op.count * op_time(chip, cls, flops, nbytes, getattr(op, "packed_bytes", 0))
        row = classes.setdefault(cls, {"flops": 0.0, "bytes": 0.0, "s": 0.0})
        row["flops"] += op.count * flops
        row["bytes"] += op.count * nbytes
        row["s"] += seconds
        total_s += seconds
        flops_sum += op.count * flops
        bytes_sum += op.count * nbytes
    if chip.op_s:
        executions = sum(op.count for op in ops)
        classes["per-op cost"] = {"flops": 0.0, "bytes": 0.0, "s": executions * chip.op_s}
        total_s += executions * chip.op_s
    if chip.first_touch_bw and fresh_bytes:
        seconds = fresh_bytes / chip.first_touch_bw
        classes["first touch"] = {"flops": 0.0, "bytes": float(fresh_bytes), "s": seconds}
        total_s += seconds
    ici = latency = 0.0
    count = 0
    wire_by_kind: dict[str, float] = {}
    for c in collectives:
        wire, seconds, lat = collective_time(chip, c, dims)
        if c.group_size > 1:  # a group of one device moves nothing between chips (XLA
            count += c.count  # keeps some as copies: their bytes are in the HBM count)
            wire_by_kind[c.kind] = wire_by_kind.get(c.kind, 0.0) + wire
        ici += seconds
        latency += lat
    if count:
        classes["ICI"] = {"flops": 0.0, "bytes": sum(wire_by_kind.values()), "s": ici}
    return Estimate(classes, total_s, ici, latency, count, flops_sum, bytes_sum, wire_by_kind)


def mfu(flops: float, seconds: float, chip: Chip) -> float:
    """FLOPs per chip / (seconds x peak): MFU with model FLOPs, HFU with executed FLOPs."""
    return flops / (seconds * chip.peak_flops) if seconds > 0 else 0.0


# ------------------------------------------------------------------------- the RL step

PHASES = {  # aot's function names -> the RL step's phases
    "rollout reshard": "rollout reshard",
    "sampler prefill": "prefill",
    "sampler decode": "decode",
    "logprobs": "log-prob pass",
    "advantages": "advantages",
    "train step": "updates",
}
_KINDS = (("all-gather", "AG"), ("all-reduce", "AR"), ("reduce-scatter", "RS"),
          ("all-to-all", "A2A"), ("collective-permute", "CP"))  # fmt: skip
_CLASSES = ("matmul", "vocab matmul", "attention kernel", "elementwise", "ICI")


def estimates(reports, chip: Chip, dims: tuple[int, ...] = ()) -> list[tuple[Any, Estimate]]:
    """(report, Estimate) of each compiled report (aot.Report-like: name, ops,
    collectives, error); reports XLA refused are left out."""
    return [(r, estimate(chip, r.ops, r.collectives, dims)) for r in reports if r.error is None]


def _s(seconds: float) -> str:
    return f"{seconds:.3g}"


def _range(lo: float, hi: float, fmt=_s) -> str:
    a, b = fmt(lo), fmt(hi)
    return a if a == b else f"{a} to {b}"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def step_summary(rows, chip: Chip, *, decoded_tokens: float, logprob_calls: int) -> dict:
    """The RL step from the functions' estimates, each pass counted once: the log-prob
    function `logprob_calls` times (π_ref with a KL term, π_old for the token-level KL
    reward; 0 when the train step runs π_old itself and nothing else needs it)."""
    lo = hi = 0.0
    phases = {}
    for r, e in rows:
        times = logprob_calls if r.name == "logprobs" else 1
        phases[PHASES.get(r.name, r.name)] = (r, e, times)
        lo += times * e.low_s
        hi += times * e.high_s
    out: dict[str, Any] = {"est_seconds": [lo, hi], "phases": phases}
    if "updates" in phases:
        r, e, _ = phases["updates"]
        out["train_step_mfu"] = [mfu(r.flops, e.high_s, chip), mfu(r.flops, e.low_s, chip)]
        out["train_step_hfu"] = [
            mfu(e.executed_flops, e.high_s, chip),
            mfu(e.executed_flops, e.low_s, chip),
        ]
    if "decode" in phases and decoded_tokens:
        _, e, _ = phases["decode"]
        out["decode_tokens_per_s_per_chip"] = [decoded_tokens / e.high_s, decoded_tokens / e.low_s]
    return out


def format_estimates(
    reports, chip: Chip, *, decoded_tokens: float, logprob_calls: int = 0, dims=(), notes=()
) -> str:
    """The estimate table per function and the RL step's summary; `decoded_tokens`: tokens
    each chip decodes in one RL step (responses x response_length / chips)."""
    rows = estimates(reports, chip, dims)
    eff = chip.efficiency
    title = (
        f"ESTIMATED time per chip on {chip.name} (op-by-op roofline, not a measurement; "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s bf16, HBM {chip.hbm_bw / 1e9:.0f} GB/s, "
        f"ICI {chip.link_bw / 1e9:.0f} GB/s per link each way; assumed efficiencies: "
        + ", ".join(f"{k} {v:.2f}" for k, v in eff.items())
        + f"; {chip.hop_s * 1e6:.0f} us per ring step):"
    )
    lines = [
        title,
        "| function | model TFLOP | executed TFLOP | HBM GB | wire GB: "
        + " / ".join(k for _, k in _KINDS)
        + " | s by class: "
        + " / ".join(_CLASSES)
        + " | latency s | est. s | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, e in rows:
        wire = " / ".join(f"{e.wire_bytes.get(kind, 0) / 1e9:.3g}" for kind, _ in _KINDS)
        by = " / ".join(_s(e.classes.get(c, {}).get("s", 0.0)) for c in _CLASSES)
        lines.append(
            f"| {r.name} | {r.flops / 1e12:.2f} | {e.executed_flops / 1e12:.2f} "
            f"| {e.hbm_bytes / 1e9:.1f} | {wire} | {by} | {_s(e.latency_s)} "
            f"| {_range(e.low_s, e.high_s)} | {e.bound} |"
        )
    s = step_summary(rows, chip, decoded_tokens=decoded_tokens, logprob_calls=logprob_calls)
    lines += ["", "ESTIMATED RL step, seconds (collectives hidden to not hidden):"]
    lines += ["| phase | calls per RL step | est. s | share |", "|---|---|---|---|"]
    lo = s["est_seconds"][0]
    for phase, (_, e, times) in s["phases"].items():
        share = times * e.low_s / lo if lo else 0.0
        lines.append(f"| {phase} | {times} | {_range(e.low_s, e.high_s)} | {share:.0%} |")
    lines.append(f"| RL step | | {_range(*s['est_seconds'])} | |")
    if "train_step_mfu" in s:
        lines.append(
            f"train step (est.): MFU {_range(*s['train_step_mfu'], fmt=_pct)}, "
            f"HFU {_range(*s['train_step_hfu'], fmt=_pct)} of {chip.name} peak"
        )
    if "decode_tokens_per_s_per_chip" in s:
        lo_t, hi_t = s["decode_tokens_per_s_per_chip"]
        lines.append(
            f"decode (est.): {_range(lo_t, hi_t, fmt=lambda x: f'{x:,.0f}')} tokens/s/chip"
        )
    lines += list(notes)
    lines.append(
        "Assumptions: executed FLOPs = the HLO's dots and convolutions x loop trip counts, "
        "splash attention's added from its block sizes; each op's time = max(FLOPs / (peak "
        "x class efficiency), HBM bytes / (bandwidth x HBM efficiency)), ops summed; "
        "collectives' wire bytes over the links of the torus axes their group spans; the "
        "efficiencies are assumptions (tools/roofline.py), checked only for the model's "
        "structure on a CPU (benchmarks/calibrate_roofline.py)."
    )
    return "\n".join(lines)


def json_summary(reports, chip: Chip, *, decoded_tokens: float, logprob_calls: int, dims=()):
    """The machine-readable estimate: {"chip", "functions": {name: {model_flops,
    executed_flops, hbm_bytes, ici_wire_bytes, est_seconds: [low, high]}}, "rl_step"}."""
    rows = estimates(reports, chip, dims)
    s = step_summary(rows, chip, decoded_tokens=decoded_tokens, logprob_calls=logprob_calls)
    functions = {
        r.name: {
            "model_flops": r.flops,
            "executed_flops": e.executed_flops,
            "hbm_bytes": e.hbm_bytes,
            "ici_wire_bytes": sum(e.wire_bytes.values()),
            "est_seconds": [e.low_s, e.high_s],
            "calls_per_rl_step": logprob_calls if r.name == "logprobs" else 1,
            "by_class": e.classes,
            "bound": e.bound,
        }
        for r, e in rows
    }
    rl = {k: v for k, v in s.items() if k != "phases"}
    return {"chip": chip.name, "functions": functions, "rl_step": rl}
