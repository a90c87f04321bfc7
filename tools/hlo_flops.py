"""Executed matmul FLOPs of a compiled program (`executed_flops`) and every
instruction's cost for the roofline (`op_costs`: FLOPs, HBM bytes, executions), from its
optimised HLO; re-exported by tools/hlo_stats.py."""

from __future__ import annotations

import dataclasses
import math
import re

from tools.hlo_hbm import (
    _FREE,
    _fusion_bodies,
    _instr_bytes,
    _op,
    _source,
)
from tools.hlo_parse import (
    _OPCODES,
    _arrays,
    _counts,
    _Instr,
    _nbytes,
    _operands,
    _parse,
    _show,
)

_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
_DIM_LABELS = re.compile(r"\bdim_labels=([\w]+)_([\w]+)->([\w]+)")


def _dims(text: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", text)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _window_field(window: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([0-9x_]+)", window)
    if not m:
        return [default] * n
    return [int(x) for x in m.group(1).split("x")]


def _valid_taps(size: int, window: int, out: int, stride: int, pad_lo: int, lhs_dil: int,
                rhs_dil: int) -> int:  # fmt: skip
    """Multiply-adds along one spatial dimension of a convolution: over its `out` output
    positions, the kernel taps that land on the input rather than its padding (XLA:TPU
    writes a dot's batch dimensions as windows over padded spatial dimensions, so most
    taps are padding there)."""
    import numpy as np

    o = np.arange(out, dtype=np.int64)[:, None]
    if out * window <= 4_000_000:
        k = np.arange(window, dtype=np.int64)[None, :]
        pos = o * stride + k * rhs_dil - pad_lo
        ok = (pos >= 0) & (pos <= (size - 1) * lhs_dil) & (pos % lhs_dil == 0)
        return int(ok.sum())
    lo = np.maximum(0, -(-(pad_lo - o * stride) // rhs_dil))
    hi = np.minimum(window - 1, ((size - 1) * lhs_dil + pad_lo - o * stride) // rhs_dil)
    return int(np.maximum(hi - lo + 1, 0).sum()) // lhs_dil


def _conv_flops(ins: _Instr, types: dict[str, str]) -> float:
    """2 x multiply-adds of a convolution (XLA:TPU's form of every matmul): output
    batch x output features x input features per group x valid kernel taps per spatial
    dimension (`_valid_taps`), as XLA's HloCostAnalysis counts them."""
    labels = _DIM_LABELS.search(ins.rest)
    ops = _operands(ins)
    if not labels or len(ops) < 2:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs = (_arrays(types.get(o, "")) for o in ops[:2])
    out = _arrays(ins.type_str)
    if not lhs or not rhs or not out:
        return 0.0
    lhs_s, rhs_s, out_s = lhs[0][1], rhs[0][1], out[0][1]
    spatial = sorted(c for c in out_l if c.isdigit())
    window = _WINDOW.search(ins.rest)
    window = window.group(1) if window else ""
    n = len(spatial)
    sizes = _window_field(window, "size", n, 1)
    strides = _window_field(window, "stride", n, 1)
    lhs_dil = _window_field(window, "lhs_dilate", n, 1)
    rhs_dil = _window_field(window, "rhs_dilate", n, 1)
    pads = re.search(r"\bpad=([0-9_x-]+)", window)
    pad_lo = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * n
    taps = 1
    for j, d in enumerate(spatial):
        taps *= _valid_taps(
            lhs_s[lhs_l.index(d)], sizes[j], out_s[out_l.index(d)], strides[j], pad_lo[j],
            lhs_dil[j], rhs_dil[j],
        )  # fmt: skip
    outer = out_s[out_l.index("b")] * out_s[out_l.index("f")]
    return 2.0 * outer * rhs_s[rhs_l.index("i")] * taps


def _dot_flops(ins: _Instr, types: dict[str, str]) -> float:
    """2 x output elements x the contracted size."""
    ops = _operands(ins)
    lhs = _arrays(types.get(ops[0], "")) if ops else []
    out = _arrays(ins.type_str)
    if not lhs or not out:
        return 0.0
    contracted = math.prod(lhs[0][1][i] for i in _dims(ins.rest, "lhs_contracting_dims"))
    return 2.0 * math.prod(out[0][1]) * contracted


def _larger_input(ins: _Instr, types: dict[str, str]) -> int:
    """Bytes of the larger of a dot's / convolution's two inputs (a decode's weights): what
    a CPU matmul packs into panels before computing. 0 for a dot with batch dimensions (an
    attention block's: XLA:CPU loops over its small per-batch matrices itself; charging
    them the packing over-predicted this CPU's decode, benchmarks/calibrate_roofline.py)."""
    if ins.opcode == "dot" and _dims(ins.rest, "lhs_batch_dims"):
        return 0
    return max((_nbytes(_arrays(types.get(o, ""))) for o in _operands(ins)[:2]), default=0)


def _matmul(ins: _Instr, types: dict[str, str]):
    """(flops, the dimensions of every operand and result, the larger input's bytes) of one
    dot / convolution."""
    f = _dot_flops(ins, types) if ins.opcode == "dot" else _conv_flops(ins, types)
    shapes = [_arrays(ins.type_str)] + [_arrays(types.get(o, "")) for o in _operands(ins)]
    dims = [d for arrays in shapes for _, s in arrays for d in s]
    return f, dims, _larger_input(ins, types)


def _matmuls(comps, comp: str, depth: int = 0):
    """`_matmul` of each dot / convolution of `comp` and the fusions it calls."""
    types = {i.name: i.type_str for i in comps.get(comp, [])}
    for ins in comps.get(comp, []):
        if ins.opcode in ("dot", "convolution"):
            yield _matmul(ins, types)
        elif ins.opcode == "fusion" and depth < 8:
            callee = re.search(r"calls=%?([\w.\-]+)", ins.rest)
            if callee:
                yield from _matmuls(comps, callee.group(1), depth + 1)


_KERNEL = re.compile(r'custom_call_target="tpu_custom_call"')
_KERNEL_FLOPS = re.compile(r'"cost_estimate"\s*:\s*\{\s*"flops"\s*:\s*"(\d+)"')
# Mosaic kernels that are grouped matmuls: XLA:TPU's own `ragged-dot-*` (jax.lax.ragged_dot)
# and megablox's gmm / tgmm. Their FLOPs are the cost estimate they carry (2 m k n: each
# row times its group's matrix), their class "matmul".
_GROUPED_MATMUL = re.compile(r"^(ragged-dot|gmm|tgmm)")


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One instruction outside fusions (a fusion with its body), per device per execution:
    its matmul FLOPs, its HBM bytes (as hbm_bytes counts them) and its class."""

    name: str
    op: str  # as HbmUse.op; a Pallas kernel as "kernel:<its name>", e.g. "kernel:splash_mha_dq"
    cls: str  # "matmul", "vocab matmul", "kernel" (Pallas: FLOPs 0 here) or "elementwise"
    # dot and convolution FLOPs; a grouped-matmul kernel's (ragged-dot, gmm, tgmm: class
    # "matmul") from its cost estimate; other Pallas kernels' are unknown to XLA: 0
    flops: float
    bytes: int  # HBM read + written
    count: int  # executions per call of the program
    computation: str
    shape: str  # the result
    operands: tuple = ()  # the operands' types (a kernel's shapes, for its analytic FLOPs)
    source: str = ""
    # the larger input of each of its dots / convolutions, bytes summed: what a CPU's matmul
    # packs before computing (roofline.Chip.matmul_pack_bw); 0 for other ops
    packed_bytes: int = 0


def _kernel_name(ins: _Instr) -> str:
    """A Pallas kernel's name without XLA's numeric suffix: its instruction name."""
    return re.sub(r"(\.\d+)+$", "", re.sub(r"\.clone.*$", "", ins.name))


def op_costs(
    hlo_text: str, *, vocab: int = 0, unknown_trip_count: int = 1, inner_trip_count=None
) -> list[OpCost]:
    """Every instruction of the program that computes or moves HBM bytes (collectives
    left to `collectives`), with its executed matmul FLOPs (dots and convolutions, those in
    its fusion body included) and HBM bytes, per device. `vocab` (> 0): a matmul with a
    dimension of that size is a "vocab matmul" (the unembedding and its gradients). A loop
    of unknown trip count runs `unknown_trip_count` times, or `inner_trip_count` times
    inside another such loop (e.g. paged attention's block loops inside the decode loop;
    None: `unknown_trip_count`)."""
    comps, entry = _parse(hlo_text)
    counts = _counts(comps, entry, unknown_trip_count, inner_trip_count)
    out = []
    for comp in sorted(set(comps) - _fusion_bodies(comps)):
        if not counts[comp]:
            continue
        types = {i.name: i.type_str for i in comps[comp]}
        for ins in comps[comp]:
            if ins.opcode in _FREE or ins.opcode in _OPCODES or ins.opcode.endswith("-done"):
                continue
            if ins.opcode in ("dot", "convolution"):
                found = [_matmul(ins, types)]
            elif ins.opcode == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", ins.rest)
                found = list(_matmuls(comps, callee.group(1))) if callee else []
            else:
                found = []
            flops = sum(f for f, _, _ in found)
            packed = sum(b for _, _, b in found)
            nbytes = _instr_bytes(comps, types, ins)
            kernel = ins.opcode == "custom-call" and _KERNEL.search(ins.rest)
            if not flops and not nbytes and not kernel:
                continue
            grouped = kernel and _GROUPED_MATMUL.match(_kernel_name(ins))
            estimate = _KERNEL_FLOPS.search(ins.rest) if grouped else None
            if estimate:
                flops = float(estimate.group(1))
                cls, op = "matmul", f"kernel:{_kernel_name(ins)}"
            elif kernel:
                cls, op = "kernel", f"kernel:{_kernel_name(ins)}"
            elif flops:
                is_vocab = vocab and any(vocab in dims for _, dims, _ in found)
                cls, op = ("vocab matmul" if is_vocab else "matmul"), _op(comps, ins, types)
            else:
                cls, op = "elementwise", _op(comps, ins, types)
            out.append(
                OpCost(
                    ins.name, op, cls, flops, nbytes, counts[comp], comp,
                    _show(_arrays(ins.type_str)),
                    tuple(types.get(o, "") for o in _operands(ins)), _source(ins),
                    packed if flops and not kernel else 0,
                )
            )  # fmt: skip
    return out


def executed_flops(hlo_text: str, *, unknown_trip_count: int = 1) -> float:
    """Matmul FLOPs one call of the program executes, per device: every dot and
    convolution x its execution count (loop bodies x their trip counts), grouped-matmul
    kernels (`ragged_dot` on TPU, megablox) at the cost estimate they carry; other Pallas
    kernels, whose FLOPs XLA does not know, left out: tools/roofline.py adds them)."""
    return sum(c.flops * c.count for c in op_costs(hlo_text, unknown_trip_count=unknown_trip_count))
