"""The collectives and HBM traffic of a compiled program, read from its optimised HLO text.

    collectives(hlo_text)       -> list[Collective]  every collective, with how often it runs
    collective_bytes(hlo_text)  -> {kind: bytes}     per device: sum of bytes x count
    while_trip_counts(hlo_text) -> {while: n}        XLA's known trip count of each while
    hbm_bytes(hlo_text)         -> bytes             HBM read + written per device per call
    hbm_uses(hlo_text)          -> list[HbmUse]      where those bytes go, largest first

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
import functools
import math
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# HLO opcodes -> kind; "-start" forms are the async halves ("-done" ones are not counted)
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in KINDS}
_OPCODES |= {"ragged-all-to-all": "all-to-all", "collective-broadcast": "collective-permute"}

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEES = re.compile(r"\b(calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


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


@dataclasses.dataclass
class _Instr:
    name: str
    type_str: str
    opcode: str
    rest: str  # operands and attributes


def _split_type(text: str) -> tuple[str, str]:
    """'(a[1], b[2]) op(...)' -> ('(a[1], b[2])', 'op(...)'): a tuple type has spaces."""
    if not text.startswith("("):
        head, _, tail = text.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[: i + 1], text[i + 1 :].lstrip()
    raise ValueError(f"unbalanced tuple type in HLO: {text[:200]!r}")


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
    """{computation: instructions} and the ENTRY computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            type_str, tail = _split_type(m.group(2))
            opcode, _, rest = tail.partition("(")
            comps[current].append(_Instr(m.group(1), type_str, opcode.strip(), rest))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
    return comps, entry


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (d, tuple(int(x) for x in dims.split(",") if x))
        for d, dims in _ARRAY.findall(type_str)
        if d in _DTYPE_BYTES
    ]


def _nbytes(arrays) -> int:
    return int(sum(math.prod(s) * _DTYPE_BYTES[d] for d, s in arrays))


def _show(arrays) -> str:
    shown = [f"{d}[{','.join(map(str, s))}]" for d, s in arrays]
    return shown[0] if len(shown) == 1 else "(" + ", ".join(shown) + ")"


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


def _operands(ins: _Instr) -> list[str]:
    return re.findall(r"%([\w.\-]+)", ins.rest.split(")", 1)[0])


def _constant(comps, comp: str, name: str, depth: int = 0) -> int | None:
    """The integer value of `name` in `comp` when it is a constant (through copies)."""
    ins = next((i for i in comps[comp] if i.name == name), None)
    if ins is None or depth > 8:
        return None
    if ins.opcode == "constant":
        m = re.match(r"\s*(-?\d+)\s*\)", ins.rest)
        return int(m.group(1)) if m else None
    if ins.opcode in ("copy", "bitcast", "convert") and _operands(ins):
        return _constant(comps, comp, _operands(ins)[0], depth + 1)
    return None


def _find(comps, comp: str, name: str) -> _Instr | None:
    return next((i for i in comps[comp] if i.name == name), None)


def _compares(comps, comp: str, name: str, outer: dict, depth: int = 0):
    """The compares an `and` of compares (through fusions) makes of `name` in `comp`, as
    (direction, [(computation, operand)] x 2); `outer` maps a fusion's parameters to the
    caller's operands."""
    ins = _find(comps, comp, name)
    if ins is None or depth > 8:
        return
    if ins.opcode == "compare":
        d = re.search(r"direction=(\w+)", ins.rest)
        sides = [outer.get(o, (comp, o)) for o in _operands(ins)]
        if d and len(sides) == 2:
            yield d.group(1), sides
    elif ins.opcode == "and":
        for o in _operands(ins):
            yield from _compares(comps, comp, o, outer, depth + 1)
    elif ins.opcode == "fusion":
        callee = re.search(r"calls=%?([\w.\-]+)", ins.rest)
        if callee and callee.group(1) in comps and comps[callee.group(1)]:
            body, args = callee.group(1), _operands(ins)
            params = {
                i.name: outer.get(args[int(m.group(1))], (comp, args[int(m.group(1))]))
                for i in comps[body]
                if i.opcode == "parameter"
                and (m := re.match(r"\s*(\d+)", i.rest))
                and int(m.group(1)) < len(args)
            }
            yield from _compares(comps, body, comps[body][-1].name, params, depth + 1)


def _bounds(comps, cond: str) -> dict[int, int]:
    """{loop-state tuple index i: N} for each bound `i < N` (`i <= N`: N + 1) the
    condition's ROOT makes, alone or in an `and` (the sampler's `step < T & ~all_done`)."""
    out: dict[int, int] = {}
    if cond not in comps or not comps[cond]:
        return out
    for direction, sides in _compares(comps, cond, comps[cond][-1].name, {}):
        values = [_constant(comps, c, o) for c, o in sides]
        if (values[0] is None) == (values[1] is None):
            continue
        var_first = values[0] is None
        d = direction if var_first else {"GT": "LT", "GE": "LE"}.get(direction, "")
        if d not in ("LT", "LE"):
            continue
        limit = (values[1] if var_first else values[0]) + (d == "LE")
        gte = _find(comps, *(sides[0] if var_first else sides[1]))
        index = gte and re.search(r"index=(\d+)", gte.rest)
        if gte is not None and gte.opcode == "get-tuple-element" and index:
            i = int(index.group(1))
            out[i] = min(limit, out.get(i, limit))
    return out


def _start(comps, caller: str, name: str, depth: int = 0) -> int:
    """A loop counter's initial value: a constant, or the bound of the loop it comes out of
    (the sampler's decode segments run one after another); else 0 (an upper bound)."""
    ins = _find(comps, caller, name)
    if ins is None or depth > 8:
        return 0
    value = _constant(comps, caller, name)
    if value is not None:
        return value
    if ins.opcode in ("copy", "bitcast", "convert") and _operands(ins):
        return _start(comps, caller, _operands(ins)[0], depth + 1)
    index = re.search(r"index=(\d+)", ins.rest)
    loop = _find(comps, caller, (_operands(ins) or [""])[0])
    if ins.opcode == "get-tuple-element" and index and loop and loop.opcode == "while":
        cond = re.search(r"condition=%?([\w.\-]+)", loop.rest)
        return _bounds(comps, cond.group(1)).get(int(index.group(1)), 0) if cond else 0
    return 0


def _step(comps, body: str | None, index: int) -> int:
    """How much the body adds to loop-state element `index` per trip: its ROOT tuple's
    element is `add(get-tuple-element(param, index), constant c)` -> c (XLA:TPU's windowed
    einsum loops count in 2s); else 1 (then the trip count is an upper bound)."""
    if not body or body not in comps or not comps[body]:
        return 1
    root = comps[body][-1]
    elems = _operands(root) if root.opcode == "tuple" else []
    add = _find(comps, body, elems[index]) if index < len(elems) else None
    if add is None or add.opcode != "add" or len(_operands(add)) != 2:
        return 1
    for counter, other in (_operands(add), _operands(add)[::-1]):
        gte, c = _find(comps, body, counter), _constant(comps, body, other)
        if gte is None or gte.opcode != "get-tuple-element" or not c or c < 1:
            continue
        index_of = re.search(r"index=(\d+)", gte.rest)
        if index_of and int(index_of.group(1)) == index:
            return c
    return 1


def _trip_count(comps, caller: str, ins: _Instr) -> int | None:
    """XLA's known trip count, else ceil((N - start) / step) from a condition `i < N`
    (XLA:TPU omits the annotation): i a tuple element of the loop state, N a constant,
    start that element of the while's operand (`_start`), step what the body adds to it
    (`_step`)."""
    trip = _TRIP.search(ins.rest)
    if trip:
        return int(trip.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", ins.rest)
    body = re.search(r"body=%?([\w.\-]+)", ins.rest)
    bounds = _bounds(comps, cond.group(1)) if cond else {}
    state = _find(comps, caller, (_operands(ins) or [""])[0])
    if not bounds or state is None or state.opcode != "tuple":
        return None
    elems = _operands(state)
    trips = [
        -(-(n - _start(comps, caller, elems[i])) // _step(comps, body and body.group(1), i))
        for i, n in bounds.items()
        if i < len(elems)
    ]
    return max(min(trips), 0) if trips else None


def _unknown_bodies(comps) -> set[str]:
    """Computations run inside a while loop of unknown trip count (its body and condition
    and everything they call), through the call graph."""
    edges: dict[str, set[str]] = {}
    roots = set()
    for caller, instrs in comps.items():
        for ins in instrs:
            callees = {c for _, c in _CALLEES.findall(ins.rest)}
            for branches in _BRANCHES.findall(ins.rest):
                callees |= set(re.findall(r"%?([\w.\-]+)", branches))
            edges.setdefault(caller, set()).update(callees)
            if ins.opcode == "while" and _trip_count(comps, caller, ins) is None:
                roots |= {
                    c for role, c in _CALLEES.findall(ins.rest) if role in ("body", "condition")
                }
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(edges.get(name, ()))
    return seen


def _call_graph(
    comps, unknown: int = 1, inner: int | None = None
) -> dict[str, list[tuple[str, int]]]:
    """{callee: [(caller, executions of the callee per execution of the caller)]}; a while
    whose trip count is unknown runs `unknown` times, or `inner` times when it is itself
    inside such a loop (None: `unknown` too)."""
    nested = _unknown_bodies(comps) if inner is not None else set()
    callers: dict[str, list[tuple[str, int]]] = {}
    for caller, instrs in comps.items():
        for ins in instrs:
            if ins.opcode in ("async-done", "async-update"):
                continue  # the same computation as its async-start: counted there
            n = 1
            if ins.opcode == "while":
                n = _trip_count(comps, caller, ins)
                if n is None:
                    n = inner if caller in nested else unknown
            for role, callee in _CALLEES.findall(ins.rest):
                times = n if role == "body" else (n + 1 if role == "condition" else 1)
                callers.setdefault(callee, []).append((caller, times))
            for branches in _BRANCHES.findall(ins.rest):
                for callee in set(re.findall(r"%?([\w.\-]+)", branches)):
                    callers.setdefault(callee, []).append((caller, 1))
            if ins.opcode == "call":  # XLA:CPU wraps a small while loop in one
                for callee in re.findall(r"\bto_apply=%?([\w.\-]+)", ins.rest):
                    callers.setdefault(callee, []).append((caller, 1))
    return callers


def _counts(comps, entry, unknown: int = 1, inner: int | None = None) -> dict[str, int]:
    """Executions of every computation per call of the program."""
    callers = _call_graph(comps, unknown, inner)

    @functools.cache
    def count(name: str) -> int:
        if name == entry:
            return 1
        return sum(count(c) * t for c, t in callers.get(name, []) if c in comps)

    return {name: count(name) for name in comps}


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


# ------------------------------------------------------------------------ HBM traffic

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


# ------------------------------------------------------------------- executed FLOPs

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
