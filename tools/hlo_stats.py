"""The collectives and HBM traffic of a compiled program, read from its optimised HLO text.

    collectives(hlo_text)       -> list[Collective]  every collective, with how often it runs
    collective_bytes(hlo_text)  -> {kind: bytes}     per device: sum of bytes x count
    while_trip_counts(hlo_text) -> {while: n}        XLA's known trip count of each while
    hbm_bytes(hlo_text)         -> bytes             HBM read + written per device per call
    hbm_uses(hlo_text)          -> list[HbmUse]      where those bytes go, largest first
    op_costs(hlo_text)          -> list[OpCost]      every op's FLOPs and bytes (roofline)
    executed_flops(hlo_text)    -> FLOPs             matmul FLOPs executed per device

Import them from here; they live in tools/hlo_parse.py (HLO text -> computations, loop
trip counts), tools/hlo_hbm.py (HBM bytes) and tools/hlo_flops.py (FLOPs, op costs).

`hlo_text` is `jax.jit(f).lower(...).compile().as_text()` (after SPMD partitioning, so every
shape is one device's shard). Used by tools/aot.py's roofline estimate and by the layout tests.

What "bytes" means, per device and per execution (the ring factor (n-1)/n and the
per-collective latency are the roofline's job, tools/roofline.py):

    all-gather          result bytes (the gathered array each device ends with)
    all-reduce          operand bytes (= result bytes)
    reduce-scatter      operand bytes (= result bytes x group size)
    all-to-all          operand bytes (= result bytes)
    collective-permute  operand bytes (= result bytes: what each device sends)

Async pairs (`all-gather-start` / `-done`, ...) are counted once, at the start. XLA:TPU's
async collective fusions clone one collective into its start, body and done fusions, all
with the same channel id: those clones are counted once. A fusion computation XLA:TPU names
`all-reduce-scatter*` (an all-reduce whose result is sliced) is reported as reduce-scatter.

`count` = how often the collective runs in one call of the program: the product of the
trip counts of the while loops enclosing it, through the call graph (while body and
condition, fusions, calls, async computations, conditional branches). A trip count is
XLA's (backend_config `"known_trip_count":{"n":"..."}`), else read off a condition
`i < N` (XLA:TPU leaves loops unannotated; see `_trip_count`). A while with neither counts
once, or `unknown_trip_count` times (its name is in `unknown_trip_loops`); a conditional
branch counts as if always taken (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
import re

from tools.hlo_flops import OpCost, executed_flops, op_costs
from tools.hlo_hbm import HbmUse, hbm_bytes, hbm_uses
from tools.hlo_parse import (
    _CHANNEL,
    _OPCODES,
    KINDS,
    _arrays,
    _counts,
    _Instr,
    _nbytes,
    _parse,
    _show,
    _trip_count,
)

__all__ = [
    "KINDS",
    "Collective",
    "HbmUse",
    "OpCost",
    "collective_bytes",
    "collectives",
    "executed_flops",
    "hbm_bytes",
    "hbm_uses",
    "op_costs",
    "unknown_trip_loops",
    "while_trip_counts",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program: bytes per device per execution, executions per call."""

    kind: str  # one of KINDS
    shape: str  # the counted array(s), e.g. "bf16[8,1024]" or "(f32[4], f32[8])"
    dtype: str  # dtype of the (first) counted array
    bytes: int  # per device, per execution (see the module docstring)
    count: int  # executions per call of the program (product of enclosing trip counts)
    computation: str  # the HLO computation holding the instruction
    group_size: int = 1  # devices taking part in each group (replica_groups)
    name: str = ""  # the HLO instruction's name


def _group_size(rest: str) -> int:
    """Devices per group, from any of HLO's replica_groups spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:  # mesh['axis_0'=4,'axis_1'=2] {'axis_0'}
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:  # iota form: [num_groups, group_size]<=[...]
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", rest)
    if m:  # explicit: {{0,1,2,3},{4,5,6,7}}
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if m:  # collective-permute: the devices that send or receive
        return len(set(re.findall(r"\d+", m.group(1))))
    return 1


def _counted_arrays(ins: _Instr, kind: str):
    arrays = _arrays(ins.type_str)
    tupled = ins.opcode.endswith("-start") and ins.type_str.startswith("(")
    if tupled and kind in ("all-gather", "collective-permute"):  # (operands, results, ...)
        arrays = [a for a in arrays if a[1]]  # drop u32[] context scalars
        arrays = arrays[len(arrays) // 2 :]
    return arrays


def collectives(hlo_text: str, *, unknown_trip_count: int = 1) -> list[Collective]:
    """Every collective of the program (see the module docstring for bytes and count); a
    loop whose trip count XLA does not know runs `unknown_trip_count` times (a caller
    that knows it, e.g. the sampler's decode loop of max_new_tokens steps, says so)."""
    comps, entry = _parse(hlo_text)
    counts = _counts(comps, entry, unknown_trip_count)
    found: dict[tuple, Collective] = {}
    for comp, instrs in comps.items():
        for ins in instrs:
            kind = _OPCODES.get(ins.opcode)
            if kind is None or counts[comp] == 0:
                continue
            arrays = _counted_arrays(ins, kind)
            group = _group_size(ins.rest)
            nbytes = _nbytes(arrays)
            if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # XLA:TPU's all-reduce + slice fusion
            elif kind == "reduce-scatter":
                nbytes *= group
            channel = _CHANNEL.search(ins.rest)
            key = (kind, channel.group(1)) if channel else (comp, ins.name)
            c = Collective(
                kind, _show(arrays), arrays[0][0] if arrays else "", nbytes,
                counts[comp], comp, group, ins.name,
            )  # fmt: skip
            if key not in found or c.count > found[key].count:
                found[key] = c
    return list(found.values())


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Per kind: sum over collectives of bytes x count, per device per call (all KINDS)."""
    total = dict.fromkeys(KINDS, 0)
    for c in collectives(hlo_text):
        total[c.kind] += c.bytes * c.count
    return total


def while_trip_counts(hlo_text: str) -> dict[str, int]:
    """{while instruction name: XLA's known trip count}; loops XLA could not count are
    left out (see unknown_trip_loops)."""
    comps, _ = _parse(hlo_text)
    out = {}
    for comp, instrs in comps.items():
        for ins in instrs:
            n = _trip_count(comps, comp, ins) if ins.opcode == "while" else None
            if n is not None:
                out[ins.name] = n
    return out


def unknown_trip_loops(hlo_text: str) -> list[str]:
    """While loops without a known trip count (collectives() counts their bodies once)."""
    comps, _ = _parse(hlo_text)
    return [
        ins.name
        for comp, instrs in comps.items()
        for ins in instrs
        if ins.opcode == "while" and _trip_count(comps, comp, ins) is None
    ]
