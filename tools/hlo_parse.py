"""Optimised HLO text read into computations and instructions, and how often each
computation runs in one call of the program (loop trip counts through the call graph):
what tools/hlo_stats.py (collectives), tools/hlo_hbm.py (HBM bytes) and
tools/hlo_flops.py (executed FLOPs, per-op costs) share. The trip-count rules are in
hlo_stats's docstring."""

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
