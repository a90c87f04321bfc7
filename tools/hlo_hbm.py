"""HBM bytes one call of a compiled program reads and writes, per device, from its
optimised HLO (`hbm_bytes`), and where they go (`hbm_uses`); re-exported by
tools/hlo_stats.py, whose docstring says what is counted."""

from __future__ import annotations

import dataclasses
import re

from tools.hlo_parse import (
    _DTYPE_BYTES,
    _OPCODES,
    _arrays,
    _counts,
    _Instr,
    _nbytes,
    _operands,
    _parse,
    _show,
)

# no HBM traffic of their own (control flow, aliases, bookkeeping); collectives are ICI
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "async-start",
    "async-done", "async-update", "send", "send-done", "recv",
    "recv-done", "add-dependency", "domain",
}  # fmt: skip


def _fusion_bodies(comps) -> set[str]:
    """Computations a fusion calls: their ops run on chip, only the fusion's operands and
    results move through HBM."""
    return {
        m.group(1)
        for instrs in comps.values()
        for ins in instrs
        if ins.opcode == "fusion" and (m := re.search(r"calls=%?([\w.\-]+)", ins.rest))
    }


_SPACED = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")


def _spaced(type_str: str, *, scalars: bool = True) -> list[tuple[int, bool]]:
    """(bytes, in HBM) of each array of a type: a layout naming a memory space `S(n)`,
    n > 0 (XLA:TPU's VMEM, SMEM, host memory), is not HBM."""
    out = []
    for d, dims, layout in _SPACED.findall(type_str):
        if d in _DTYPE_BYTES and (scalars or dims):
            space = _SPACE.search(layout or "")
            n = _nbytes([(d, tuple(int(x) for x in dims.split(",") if x))])
            out.append((n, not space or space.group(1) == "0"))
    return out


def _hbm(spaced) -> int:
    return sum(n for n, in_hbm in spaced if in_hbm)


def _async_bytes(types: dict[str, str], ins: _Instr) -> int:
    """An async slice `((operands), destination, context)` or copy `(destination, source,
    context)`: reads what it moves from its source, writes it to its destination; each
    counts when it is in HBM (a prefetch into VMEM reads HBM only)."""
    sources = [_spaced(types.get(o, "")) for o in _operands(ins)]
    k = sum(len(src) for src in sources)
    arrays = _spaced(ins.type_str, scalars=False)  # without the context scalars
    dest = arrays[:1] if ins.opcode == "copy-start" else arrays[k:]
    moved = sum(n for n, _ in dest)
    read = moved if any(h for src in sources for _, h in src) else 0
    return read + _hbm(dest)


_IN_PLACE = ("dynamic-update-slice", "scatter")
_VIEWS = ("bitcast", "reshape", "pad", "convert", "copy", "transpose")  # a slice of it: no more


def _through(by: dict, name: str) -> str:
    """`name` followed back through bitcasts and reshapes (they move no bytes)."""
    for _ in range(64):
        i = by.get(name)
        if i is None or i.opcode not in ("bitcast", "reshape"):
            break
        name = _operands(i)[0]
    return name


def _param_read(comps, body, name: str, full: int, in_place=False, depth=0) -> int:
    """Bytes a fusion body reads of its parameter `name` (`full` bytes): a dynamic-slice or
    gather of it what it takes, a nested fusion what its own body reads, a bitcast,
    reshape, pad, convert, copy or transpose what its users read, an update in place of it
    (`in_place`) nothing; any other use, or being the body's result, all of it."""
    if name == body[-1].name:
        return full
    total = 0
    for u in (i for i in body if name in _operands(i)):
        ops = _operands(u)
        callee = re.search(r"calls=%?([\w.\-]+)", u.rest) if u.opcode == "fusion" else None
        if u.opcode in ("dynamic-slice", "gather") and ops[0] == name:
            total += sum(n for n, _ in _spaced(u.type_str))
        elif u.opcode in _IN_PLACE and ops[0] == name and ops.count(name) == 1 and in_place:
            continue
        elif u.opcode in _VIEWS and ops[0] == name and depth < 8:  # scaled to its input's
            size = sum(n for n, _ in _spaced(u.type_str)) or 1  # bytes (a pad's real share)
            share = min(1.0, sum(n for n, _ in _spaced(_type_of(body, name))) / size)
            r = _param_read(comps, body, u.name, full, in_place, depth + 1)
            if r >= full:
                return full
            total += int(share * r)
        elif callee and depth < 8 and ops.count(name) == 1:
            inner = comps.get(callee.group(1), [])
            k = ops.index(name)
            p = next((i for i in inner if i.opcode == "parameter" and _index(i) == k), None)
            total += _param_read(comps, inner, p.name, full, False, depth + 1) if p else full
        else:
            return full
    return min(total, full)


def _type_of(body, name: str) -> str:
    return next((i.type_str for i in body if i.name == name), "")


def _index(param: _Instr) -> int:
    return int(param.rest.split(")", 1)[0])


def _multi_output_bytes(comps, body, operands, result) -> int | None:
    """A multi-output fusion (its root a tuple, e.g. a scan step writing one chunk into the
    scan's stacked output and returning other values): each output that is a
    dynamic-update-slice or scatter (through bitcasts) into a parameter of its shape is
    updated in place, as XLA's dataflow analysis pairs them (GetInPlaceInputOutputPairs),
    so it writes only its update and that parameter is not read; any other output is
    written whole, and each parameter is read as far as `_param_read` says. None when
    the root's elements and the result's arrays do not pair up."""
    by = {i.name: i for i in body}
    elements = _operands(body[-1])
    if len(elements) != len(result):
        return None
    in_place, written = set(), 0
    for e, (n, in_hbm) in zip(elements, result, strict=True):
        d = by.get(_through(by, e))
        buf = by.get(_through(by, _operands(d)[0])) if d and d.opcode in _IN_PLACE else None
        if (
            buf is not None
            and buf.opcode == "parameter"
            and _arrays(buf.type_str) == _arrays(d.type_str)
        ):
            update = by.get(_operands(d)[1 if d.opcode == "dynamic-update-slice" else -1])
            in_place.add(buf.name)
            n = sum(m for m, _ in _spaced(update.type_str)) if update else n
        written += n if in_hbm else 0
    read = 0
    for p in (i for i in body if i.opcode == "parameter"):
        op = operands[_index(p)] if _index(p) < len(operands) else []
        full = sum(n for n, _ in op)
        read += _param_read(comps, body, p.name, full, p.name in in_place) if _hbm(op) else 0
    return written + read


def _instr_bytes(comps, types: dict[str, str], ins: _Instr) -> int:
    """HBM bytes one execution of `ins` reads and writes: its operands and its result, each
    when XLA placed it in HBM (not VMEM: `_spaced`); an in-place dynamic-update-slice
    or scatter (alone, as a fusion's root or as one output of a multi-output fusion:
    `_multi_output_bytes`) moves only its update, a gather or dynamic-slice reads only
    what it takes, an async copy or slice what it moves (`_async_bytes`)."""
    if ins.opcode.endswith("-start"):
        return _async_bytes(types, ins)
    operands = [_spaced(types.get(o, "")) for o in _operands(ins)]
    full = [sum(n for n, _ in op) for op in operands]
    result = _spaced(ins.type_str)
    out, out_full = _hbm(result), sum(n for n, _ in result)
    callee = re.search(r"calls=%?([\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
    body = comps.get(callee.group(1), []) if callee else []
    root = body[-1].opcode if body else ""
    if root == "tuple" and (n := _multi_output_bytes(comps, body, operands, result)) is not None:
        return n
    if root not in ("dynamic-update-slice", "gather", "dynamic-slice"):  # through reshapes
        root = next((i.opcode for i in body if i.opcode in ("gather", "dynamic-slice")), root)
    if "dynamic-update-slice" in (ins.opcode, root) and out_full in full:
        i = full.index(out_full)  # the buffer updated in place: its update written into it
        rest = operands[:i] + operands[i + 1 :]
        written = sum(n for op in rest for n, _ in op) if out else 0
        return sum(_hbm(op) for op in rest) + written
    if "scatter" in (ins.opcode, root) and out_full in full and len(operands) > 2:
        i = full.index(out_full)  # scattered in place (a KV cache's page writes): the
        rest = operands[:i] + operands[i + 1 :]  # indices and updates read, updates written
        written = sum(n for n, _ in operands[-1]) if out else 0
        return sum(_hbm(op) for op in rest) + written
    if {"gather", "dynamic-slice"} & {ins.opcode, root} and operands:
        i = full.index(max(full))  # reads only the rows it takes
        rest = operands[:i] + operands[i + 1 :]
        read = out_full if _hbm(operands[i]) else 0
        return read + out + sum(_hbm(op) for op in rest)
    return out + sum(_hbm(op) for op in operands)


@dataclasses.dataclass(frozen=True)
class HbmUse:
    """HBM traffic of `instructions` instructions alike (same op, result shape, bytes and
    count; e.g. one per unrolled layer), per device."""

    op: str  # opcode; a fusion as "fusion:<its root's opcode>", e.g. "fusion:convert"; an
    # async copy or slice with the memory spaces it moves between, "copy-start:HBM->VMEM"
    shape: str  # the result, e.g. "bf16[1024,151936]"
    bytes: int  # read + written by one execution of one instruction (see hbm_bytes)
    count: int  # executions per call of the program (product of enclosing trip counts)
    instructions: int  # how many instructions share op, shape, bytes and count
    name: str  # the first of them
    computation: str  # the HLO computation holding it
    source: str = ""  # its jax op_name (metadata), shortened: where in the model it comes from

    @property
    def total(self) -> int:
        """Bytes per call: bytes x count x instructions."""
        return self.bytes * self.count * self.instructions


def _space_name(type_str: str) -> str:
    space = _SPACE.search(type_str)
    n = space.group(1) if space else "0"
    return {"0": "HBM", "1": "VMEM"}.get(n, f"S({n})")


def _op(comps, ins: _Instr, types: dict[str, str]) -> str:
    if ins.opcode in ("copy-start", "slice-start"):  # which way it moves: e.g. HBM->VMEM
        source = types.get((_operands(ins) or [""])[0], "")
        k = len(_spaced(source))
        arrays = _SPACED.findall(ins.type_str)
        dest = arrays[0] if ins.opcode == "copy-start" else (arrays[k:] or [("", "", "")])[0]
        return f"{ins.opcode}:{_space_name(source)}->{_space_name(dest[2])}"
    if ins.opcode != "fusion":
        return ins.opcode
    callee = re.search(r"calls=%?([\w.\-]+)", ins.rest)
    body = comps.get(callee.group(1), []) if callee else []
    return f"fusion:{body[-1].opcode}" if body else "fusion"


def _source(ins: _Instr) -> str:
    """The op_name of the instruction's metadata, without the jit(...)/ prefixes and
    transforms: e.g. "while/body/dot_general"."""
    m = re.search(r'op_name="([^"]*)"', ins.rest)
    if not m:
        return ""
    parts = [p for p in m.group(1).split("/") if not p.startswith(("jit(", "pjit("))]
    return "/".join(parts)[-80:]


def hbm_uses(hlo_text: str, *, unknown_trip_count: int = 1) -> list[HbmUse]:
    """Every instruction's HBM traffic (hbm_bytes' count), alike instructions grouped,
    largest total first: where a program's HBM bytes go."""
    comps, entry = _parse(hlo_text)
    counts = _counts(comps, entry, unknown_trip_count)
    groups: dict[tuple, HbmUse] = {}
    for comp in sorted(set(comps) - _fusion_bodies(comps)):
        if not counts[comp]:
            continue
        types = {i.name: i.type_str for i in comps[comp]}
        for ins in comps[comp]:
            if ins.opcode in _FREE or ins.opcode in _OPCODES or ins.opcode.endswith("-done"):
                continue
            nbytes = _instr_bytes(comps, types, ins)
            if not nbytes:
                continue
            key = (_op(comps, ins, types), _show(_arrays(ins.type_str)), nbytes, counts[comp])
            if key in groups:
                groups[key] = dataclasses.replace(
                    groups[key], instructions=groups[key].instructions + 1
                )
            else:
                groups[key] = HbmUse(*key, 1, ins.name, comp, _source(ins))
    return sorted(groups.values(), key=lambda u: (-u.total, u.op, u.shape))


def hbm_bytes(hlo_text: str, *, unknown_trip_count: int = 1) -> int:
    """HBM bytes one call of the program reads and writes, per device: every instruction
    outside fusions (a fusion counts its operands and results) x its execution count, as
    XLA's cost analysis counts 'bytes accessed' but with loop bodies x their trip counts,
    and only arrays in HBM: XLA:TPU's layouts name other memory spaces (`S(1)`: VMEM), and
    an operand prefetched into VMEM by an async copy or slice is read from HBM once, by
    that copy, not by each instruction that then reads it (its VMEM-only glue, e.g. a
    ConcatBitcast of the slices, moves nothing). Collectives are left to `collectives`
    (ICI). `hbm_uses` says which instructions the bytes come from."""
    return sum(u.total for u in hbm_uses(hlo_text, unknown_trip_count=unknown_trip_count))
