"""A roofline estimate of a compiled function's time: compute, HBM and inter-chip traffic.

ESTIMATES, not measurements. tools/aot.py feeds it, per compiled function and per chip: the
model's FLOPs (analytic), the HBM bytes (hlo_stats.hbm_bytes: XLA's 'bytes accessed' rule
with loop bodies x their trip counts, arrays XLA:TPU keeps in VMEM left out; `hbm_bytes`
here is the fallback that scales XLA's
own count), and every collective of the optimised HLO with its execution count
(tools.hlo_stats). The model:

    compute  = model FLOPs / peak bf16 FLOP/s
    HBM      = HBM bytes / HBM bandwidth
    ICI      = sum over collectives of count x bytes x ring factor / ICI bandwidth
    latency  = number of collective executions x per-collective latency

    estimate (overlapped)  = max(compute, HBM, ICI) + latency   collectives hidden under compute
    estimate (serial ICI)  = max(compute, HBM) + ICI + latency  collectives not overlapped

Ring factors (bytes as hlo_stats counts them, n devices in the group): all-gather and
reduce-scatter (n-1)/n, all-reduce 2(n-1)/n (a reduce-scatter then an all-gather),
all-to-all (n-1)/n, collective-permute 1. The ICI bandwidth is the chip's bidirectional
figure over all its links, so the ICI time is a lower bound (a collective over one torus
axis uses only that axis's links); an all-to-all on a torus is bisection-bound and
slower still.

Chip table: the figures and the pages they come from (retrieved 2026-11). Per-collective
latency is not a published figure: 10 us per collective is this module's assumption (a ring
step per hop of ~1 us over a few hops plus the launch), the same for every chip.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: peak dense bf16 FLOP/s, HBM size and bandwidth, ICI bandwidth."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_gib: float
    hbm_bw: float  # bytes/s
    ici_bw: float  # bytes/s per chip, bidirectional, all links
    latency_s: float  # per collective execution (assumption, see the module docstring)
    source: str


_LATENCY = 10e-6
CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s. ICI per
    # chip is not on that page: 6 links x 45 GB/s each way (jax-ml.github.io/scaling-book/
    # tpus, "TPU specs" table) = 540 GB/s bidirectional.
    "v4": Chip("TPU v4", 275e12, 32, 1200e9, 540e9, _LATENCY, "cloud.google.com/tpu/docs/v4"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, 400 GB/s
    # bidirectional ICI per chip (1,600 Gbps one way).
    "v5e": Chip("TPU v5e", 197e12, 16, 819e9, 400e9, _LATENCY, "cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, 1200 GB/s
    # bidirectional ICI per chip (4,800 Gbps one way).
    "v5p": Chip("TPU v5p", 459e12, 95, 2765e9, 1200e9, _LATENCY, "cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, 800 GB/s
    # bidirectional ICI per chip.
    "v6e": Chip("TPU v6e", 918e12, 32, 1638e9, 800e9, _LATENCY, "cloud.google.com/tpu/docs/v6e"),
    # nvidia.com/en-us/data-center/h100 (SXM): 1,979 TFLOP/s bf16 with sparsity = 989.5
    # dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional.
    "h100": Chip(
        "H100 SXM", 989.5e12, 80, 3.35e12, 900e9, _LATENCY, "nvidia.com/en-us/data-center/h100"
    ),
    # nvidia.com/en-us/data-center/h200: the H100's compute, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s.
    "h200": Chip("H200 SXM", 989.5e12, 141, 4.8e12, 900e9, _LATENCY, "nvidia.com/en-us/data-center/h200"),
}  # fmt: skip


def chip_for(topology: str) -> Chip:
    """The chip of a topology name such as "v5p:4x4x4" (or a bare "h100")."""
    generation = topology.split(":")[0].lower()
    if generation not in CHIPS:
        raise ValueError(f"unknown chip {generation!r} in {topology!r}; known: {sorted(CHIPS)}")
    return CHIPS[generation]


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


def hbm_bytes(xla_bytes: float, xla_flops: float, model_flops: float) -> float:
    """HBM bytes of one call. XLA's cost analysis counts a while loop's body once (scanned
    layers, micro-batches, decode steps, log-prob chunks); its FLOPs undercount the same
    way, so its bytes are scaled by model FLOPs / XLA FLOPs when that ratio is above 1
    (the loops that hold the FLOPs are taken to hold the bytes in the same proportion)."""
    if xla_flops > 0 and model_flops > xla_flops:
        return xla_bytes * model_flops / xla_flops
    return xla_bytes


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One function's estimated seconds per call, per chip, by resource."""

    compute_s: float
    hbm_s: float
    ici_s: float
    latency_s: float
    collectives: int  # collective executions per call
    ici_bytes: dict  # per kind: bytes x count (hlo_stats), before ring factors

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.ici_s) + self.latency_s

    @property
    def serial_s(self) -> float:
        return max(self.compute_s, self.hbm_s) + self.ici_s + self.latency_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "overlapped_s": self.overlapped_s,
            "serial_s": self.serial_s,
            "bound": self.bound,
        }

    @property
    def bound(self) -> str:
        times = {"compute": self.compute_s, "HBM": self.hbm_s, "ICI": self.ici_s}
        return max(times, key=times.get)


def estimate(chip: Chip, model_flops: float, hbm: float, collectives) -> Estimate:
    """`collectives`: hlo_stats.Collective-like objects (kind, bytes, count, group_size)."""
    ici = latency = 0.0
    count = 0
    by_kind: dict[str, int] = {}
    for c in collectives:
        ici += c.count * c.bytes * ring_factor(c.kind, c.group_size) / chip.ici_bw
        if c.group_size > 1:  # a group of one device moves nothing between chips (XLA
            count += c.count  # keeps some as copies: their bytes are in the HBM count)
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.bytes * c.count
    latency = count * chip.latency_s
    return Estimate(model_flops / chip.peak_flops, hbm / chip.hbm_bw, ici, latency, count, by_kind)


def mfu(model_flops: float, seconds: float, chip: Chip) -> float:
    """Model FLOPs utilisation: model FLOPs per chip / (seconds x peak)."""
    return model_flops / (seconds * chip.peak_flops) if seconds > 0 else 0.0


# ------------------------------------------------------------------------- the RL step

PHASES = {  # aot's function names -> the RL step's phases
    "sampler prefill": "prefill",
    "sampler decode": "decode",
    "logprobs": "π_old pass",
    "advantages": "advantages",
    "train step": "updates",
}
_KINDS = (("all-gather", "AG"), ("all-reduce", "AR"), ("reduce-scatter", "RS"),
          ("all-to-all", "A2A"), ("collective-permute", "CP"))  # fmt: skip


def estimates(reports, chip: Chip) -> list[tuple[Any, Estimate]]:
    """(report, Estimate) of each compiled report (aot.Report-like: name, flops, hbm,
    collectives, error); reports XLA refused are left out."""
    return [(r, estimate(chip, r.flops, r.hbm, r.collectives)) for r in reports if r.error is None]


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}" if x else "0"


def format_estimates(reports, chip: Chip, *, decoded_tokens: float) -> str:
    """The estimate table per function and the RL step's summary; `decoded_tokens`: tokens
    each chip decodes in one RL step (responses x response_length / chips)."""
    rows = estimates(reports, chip)
    title = (
        f"ESTIMATED time per chip on {chip.name} (roofline, not a measurement; "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s bf16, HBM {chip.hbm_bw / 1e9:.0f} GB/s, "
        f"ICI {chip.ici_bw / 1e9:.0f} GB/s, {chip.latency_s * 1e6:.0f} us per collective):"
    )
    lines = [
        title,
        "| function | model TFLOP | XLA TFLOP (loops once) | HBM GB | collective GB: "
        + " / ".join(k for _, k in _KINDS)
        + " | collectives | compute s | HBM s | ICI s | latency s | est. s | bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, e in rows:
        ici = " / ".join(_gb(e.ici_bytes.get(kind, 0)) for kind, _ in _KINDS)
        lines.append(
            f"| {r.name} | {r.flops / 1e12:.2f} | {r.xla_flops / 1e12:.2f} | {r.hbm / 1e9:.1f}"
            f" | {ici} | {e.collectives:,} | {_s(e.compute_s)} | {_s(e.hbm_s)} | {_s(e.ici_s)}"
            f" | {_s(e.latency_s)} | {_range(e)} | {e.bound} |"
        )
    lines += ["", *_step_summary(rows, chip, decoded_tokens)]
    return "\n".join(lines)


def _s(seconds: float) -> str:
    return f"{seconds:.3g}"


def _range(e: Estimate) -> str:
    lo, hi = _s(e.overlapped_s), _s(e.serial_s)
    return lo if lo == hi else f"{lo} to {hi}"


def _step_summary(rows, chip: Chip, decoded_tokens: float) -> list[str]:
    phases = {PHASES.get(r.name, r.name): (r, e) for r, e in rows}
    lo = sum(e.overlapped_s for _, e in phases.values())
    hi = sum(e.serial_s for _, e in phases.values())
    out = ["ESTIMATED RL step, seconds (collectives overlapped to serial):"]
    out += ["| phase | est. s | share |", "|---|---|---|"]
    for phase, (_, e) in phases.items():
        out.append(f"| {phase} | {_range(e)} | {e.overlapped_s / lo:.0%} |")
    out.append(f"| RL step | {_s(lo)} to {_s(hi)} | |")
    if "updates" in phases:
        r, e = phases["updates"]
        low, high = mfu(r.flops, e.serial_s, chip), mfu(r.flops, e.overlapped_s, chip)
        out.append(f"train step MFU (est.): {low:.0%} to {high:.0%} of {chip.name} peak")
    if "decode" in phases and decoded_tokens:
        _, e = phases["decode"]
        out.append(
            f"decode (est.): {decoded_tokens / e.serial_s:,.0f} to "
            f"{decoded_tokens / e.overlapped_s:,.0f} tokens/s/chip"
        )
    out.append(
        "Assumptions: model FLOPs analytic; HBM bytes and collectives read from the "
        "compiled HLO x loop trip counts; ring factors over the chip's bidirectional ICI on "
        "all links (a lower bound on ICI time); 10 us per collective; tools/roofline.py."
    )
    return out
