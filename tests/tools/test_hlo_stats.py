"""tools.hlo_stats: collectives, their bytes and execution counts, from HLO text.

Hand-written snippets pin each rule (bytes per kind, async pairs counted once, nested loops
multiply, XLA:TPU's unannotated loops and cloned async fusions); a program compiled on the
8 fake CPU devices checks the reader against XLA's real output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tools import hlo_flops, hlo_stats

# A scan (trip count 3, annotated) nested in a loop XLA:TPU left unannotated (`i < 4` from
# 0): the body all-gathers async, reduce-scatters and all-reduces a tuple; a conditional
# branch holds a collective-permute; ENTRY all-to-alls once.
NESTED = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {
  %p = (s32[], bf16[4,16]{1,0}) parameter(0)
  %x = bf16[4,16]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %ags = (bf16[4,16]{1,0}, bf16[32,16]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = bf16[32,16]{1,0} all-gather-done(%ags)
  %rs = bf16[4,16]{1,0} reduce-scatter(%agd), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %ar = (f32[10]{0}, f32[6]{0}) all-reduce(%y, %z), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  ROOT %t = (s32[], bf16[4,16]{1,0}) tuple(%i, %rs)
}

%inner_cond (p: (s32[], bf16[4,16])) -> pred[] {
  %p = (s32[], bf16[4,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%branch (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%q), channel_id=4, source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[8]{0} collective-permute-done(%cps)
}

%outer_body (p: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {
  %p = (s32[], bf16[4,16]{1,0}) parameter(0)
  %w = (s32[], bf16[4,16]{1,0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %k = f32[8]{0} conditional(%pr, %q, %q), branch_computations={%branch, %branch}
  ROOT %r = (s32[], bf16[4,16]{1,0}) tuple(%i, %x)
}

%cmp (param_0: s32[], param_1: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%param_0, %param_1), direction=LT
}

%outer_cond (p: (s32[], bf16[4,16])) -> pred[] {
  %p = (s32[], bf16[4,16]{1,0}) parameter(0)
  %limit = s32[]{:T(128)} constant(4)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %f = pred[] fusion(%i, %limit), kind=kLoop, calls=%cmp
}

ENTRY %main (x: bf16[4,16]) -> bf16[4,16] {
  %x = bf16[4,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = s32[] copy(%zero)
  %state = (s32[], bf16[4,16]{1,0}) tuple(%init, %x)
  %loop = (s32[], bf16[4,16]{1,0}) while(%state), condition=%outer_cond, body=%outer_body
  %a2a = f32[2,5]{1,0} all-to-all(%v), channel_id=5, replica_groups={{0,1}}, dimensions={0}
  ROOT %out = bf16[4,16]{1,0} get-tuple-element(%loop), index=1
}
"""

# XLA:TPU's async collective fusion: one all-gather (channel 9) cloned into start, body
# and done fusions of a loop body; an all-reduce + slice fusion named all-reduce-scatter.
TPU_CLONES = """HloModule t

%ag_start (p0: bf16[1,256]) -> bf16[1,1024] {
  %p0 = bf16[1,256]{1,0} parameter(0)
  ROOT %ag.1 = bf16[1,1024]{1,0} all-gather(%p0), channel_id=9, replica_groups=mesh['x'=4] {'x'}, dimensions={1}
}

%ag_done (p0: bf16[1,256]) -> bf16[1,1024] {
  %p0 = bf16[1,256]{1,0} parameter(0)
  ROOT %ag.2 = bf16[1,1024]{1,0} all-gather(%p0), channel_id=9, replica_groups=mesh['x'=4] {'x'}, dimensions={1}
}

%all-reduce-scatter.clone (in: f32[64]) -> f32[16] {
  %in = f32[64]{0} parameter(0)
  %ar = f32[64]{0} all-reduce(%in), channel_id=10, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %ds = f32[16]{0} dynamic-slice(%ar, %o), dynamic_slice_sizes={16}
}

%body (p: (s32[], bf16[1,256])) -> (s32[], bf16[1,256]) {
  %p = (s32[], bf16[1,256]{1,0}) parameter(0)
  %s = bf16[1,1024]{1,0} fusion(%x), kind=kCustom, calls=%ag_start
  %d = bf16[1,1024]{1,0} fusion(%x), kind=kCustom, calls=%ag_done
  %r = f32[16]{0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.clone
  ROOT %t = (s32[], bf16[1,256]{1,0}) tuple(%i, %x)
}

%cond (p: (s32[], bf16[1,256])) -> pred[] {
  %p = (s32[], bf16[1,256]{1,0}) parameter(0)
  %n = s32[] constant(7)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[1,256]) -> bf16[1,256] {
  %x = bf16[1,256]{1,0} parameter(0)
  %two = s32[] constant(2)
  %state = (s32[], bf16[1,256]{1,0}) tuple(%two, %x)
  %loop = (s32[], bf16[1,256]{1,0}) while(%state), condition=%cond, body=%body
  ROOT %out = bf16[1,256]{1,0} get-tuple-element(%loop), index=1
}
"""


# The sampler's segmented decode: two loops over one counter, one after the other, each
# `i < 100 & i <= bound & ~done` (XLA:TPU, no annotation); the second starts where the
# first stopped. Each body all-reduces 4 bytes per token: 41 + 59 = 100 tokens.
SEGMENTS = """HloModule s

%body (p: (s32[], pred[])) -> (s32[], pred[]) {
  %p = (s32[], pred[]) parameter(0)
  %ar = f32[] all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], pred[]) tuple(%i, %d)
}

%cond1 (p: (s32[], pred[])) -> pred[] {
  %p = (s32[], pred[]) parameter(0)
  %n = s32[] constant(100)
  %b = s32[] constant(40)
  %i = s32[] get-tuple-element(%p), index=0
  %lt = pred[] compare(%i, %n), direction=LT
  %le = pred[] compare(%i, %b), direction=LE
  %both = pred[] and(%lt, %le)
  %done = pred[] get-tuple-element(%p), index=1
  %more = pred[] not(%done)
  ROOT %go = pred[] and(%both, %more)
}

%cond2 (p: (s32[], pred[])) -> pred[] {
  %p = (s32[], pred[]) parameter(0)
  %n = s32[] constant(100)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%n, %i), direction=GT
}

ENTRY %main (d: pred[]) -> s32[] {
  %d = pred[] parameter(0)
  %zero = s32[] constant(0)
  %s1 = (s32[], pred[]) tuple(%zero, %d)
  %w1 = (s32[], pred[]) while(%s1), condition=%cond1, body=%body
  %i1 = s32[] get-tuple-element(%w1), index=0
  %c1 = s32[] copy(%i1)
  %s2 = (s32[], pred[]) tuple(%c1, %d)
  %w2 = (s32[], pred[]) while(%s2), condition=%cond2, body=%body
  ROOT %out = s32[] get-tuple-element(%w2), index=0
}
"""


def test_segmented_loops_run_from_where_the_last_one_stopped():
    assert hlo_stats.while_trip_counts(SEGMENTS) == {"w1": 41, "w2": 59}
    # one body computation, called by both loops: 41 + 59 executions of its all-reduce
    assert [(c.count, c.bytes) for c in hlo_stats.collectives(SEGMENTS)] == [(100, 4)]


# HBM bytes: a fusion counts its operands and result (not its body), a loop body x its trip
# count, an in-place dynamic-update-slice only its update, collectives nothing (ICI).
BYTES = """HloModule b

%fused (a: f32[10], b: f32[10]) -> f32[10] {
  %a = f32[10]{0} parameter(0)
  %b = f32[10]{0} parameter(1)
  %m = f32[10]{0} multiply(%a, %b)
  ROOT %s = f32[10]{0} add(%m, %b)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %y = f32[4]{0} add(%x, %x)
  %ar = f32[4]{0} all-reduce(%y), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[10], b: f32[10], buf: f32[100], u: f32[5], s: (s32[], f32[4])) -> f32[10] {
  %a = f32[10]{0} parameter(0)
  %b = f32[10]{0} parameter(1)
  %buf = f32[100]{0} parameter(2)
  %u = f32[5]{0} parameter(3)
  %s = (s32[], f32[4]{0}) parameter(4)
  %k = s32[] constant(7)
  %w = (s32[], f32[4]{0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %dus = f32[100]{0} dynamic-update-slice(%buf, %u, %k)
  %ss = ((f32[100]{0}), f32[8]{0}, u32[]) slice-start(%buf), slice={[0:8]}
  %ds = f32[6]{0} dynamic-slice(%buf, %k), dynamic_slice_sizes={6}
  ROOT %f = f32[10]{0} fusion(%a, %b), kind=kLoop, calls=%fused
}
"""


def test_hbm_bytes_by_hand():
    # fusion 3 x 40; loop body's add 3 x 48; in-place update 2 x (20 + 4); async slice
    # 2 x 32; dynamic slice 2 x 24 + its index 4
    assert hlo_stats.hbm_bytes(BYTES) == 120 + 3 * 48 + 48 + 64 + 52


# Where the HBM bytes go: two alike fused casts in a loop body of 5 trips (one per
# "layer", grouped), a fusion updating a buffer in place, and XLA:TPU's memory spaces: `x`
# prefetched into VMEM (`S(1)`) by an async copy, a slice of `b` by an async slice and
# reassembled there (ConcatBitcast), so only those reads from HBM count, and the dot
# reads its VMEM operand for free.
USES = """HloModule u

%cast (a: f32[64,32]) -> bf16[64,32] {
  %a = f32[64,32]{1,0} parameter(0)
  ROOT %c = bf16[64,32]{1,0} convert(%a)
}

%upd (b: bf16[1000], u: bf16[10], i: s32[]) -> bf16[1000] {
  %b = bf16[1000]{0} parameter(0)
  %u = bf16[10]{0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %d = bf16[1000]{0} dynamic-update-slice(%b, %u, %i)
}

%body (p: (s32[], f32[64,32])) -> (s32[], f32[64,32]) {
  %p = (s32[], f32[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[64,32]{1,0} get-tuple-element(%p), index=1
  %c0 = bf16[64,32]{1,0} fusion(%w), kind=kLoop, calls=%cast, metadata={op_name="jit(f)/while/body/convert_element_type"}
  %c1 = bf16[64,32]{1,0} fusion(%w), kind=kLoop, calls=%cast
  ROOT %t = (s32[], f32[64,32]{1,0}) tuple(%i, %w)
}

%cond (p: (s32[], f32[64,32])) -> pred[] {
  %p = (s32[], f32[64,32]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (s: (s32[], f32[64,32]), x: f32[256,128], y: f32[128,128], b: bf16[1000], u: bf16[10]) -> f32[256,128] {
  %s = (s32[], f32[64,32]{1,0}) parameter(0)
  %x = f32[256,128]{1,0} parameter(1)
  %y = f32[128,128]{1,0} parameter(2)
  %b = bf16[1000]{0} parameter(3)
  %u = bf16[10]{0} parameter(4)
  %k = s32[] constant(3)
  %w = (s32[], f32[64,32]{1,0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %up = bf16[1000]{0} fusion(%b, %u, %k), kind=kLoop, calls=%upd
  %cs = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%x)
  %cd = f32[256,128]{1,0:T(8,128)S(1)} copy-done(%cs)
  %ss = ((bf16[1000]{0}), bf16[500]{0:S(1)}, s32[]{:S(2)}) slice-start(%b), slice={[0:500]}
  %sd = bf16[500]{0:S(1)} slice-done(%ss)
  %cc = bf16[500]{0:S(1)} custom-call(%sd), custom_call_target="ConcatBitcast"
  ROOT %dot = f32[256,128]{1,0} dot(%cd, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_hbm_uses_say_where_the_bytes_go():
    uses = hlo_stats.hbm_uses(USES)
    cast = 64 * 32 * (4 + 2)  # reads f32, writes bf16
    dot = (128 * 128 + 256 * 128) * 4  # y and the result; x is read from VMEM
    prefetch = 256 * 128 * 4  # x read from HBM, written to VMEM
    # largest total first: the dot (once), the prefetch, the casts (2 instructions x 5
    # trips), the async slice (500 bf16 read), the in-place update (its 10-element update
    # and the index, read and written); the ConcatBitcast in VMEM moves nothing
    got = [(u.op, u.shape, u.bytes, u.count, u.instructions, u.total) for u in uses]
    assert got == [
        ("dot", "f32[256,128]", dot, 1, 1, dot),
        ("copy-start:HBM->VMEM", "(f32[256,128], f32[256,128], u32[])", prefetch, 1, 1, prefetch),
        ("fusion:convert", "bf16[64,32]", cast, 5, 2, 10 * cast),
        ("slice-start:HBM->VMEM", "(bf16[1000], bf16[500], s32[])", 1000, 1, 1, 1000),
        ("fusion:dynamic-update-slice", "bf16[1000]", 2 * (20 + 4), 1, 1, 48),
    ]
    assert (uses[2].name, uses[2].computation) == ("c0", "body")
    assert uses[2].source == "while/body/convert_element_type"  # jit(f)/ dropped
    assert hlo_stats.hbm_bytes(USES) == sum(u.total for u in uses)
    assert hlo_stats.hbm_bytes(USES) == dot + prefetch + 10 * cast + 1000 + 48
    # the same program with everything in HBM: the slice and the copy read and write
    in_hbm = USES.replace("S(1)", "S(0)")
    assert hlo_stats.hbm_bytes(in_hbm) == hlo_stats.hbm_bytes(USES) + 2 * prefetch + 1000 * 3


def test_aot_prints_the_largest_hbm_uses():
    from tools import aot

    report = aot.Report("sampler decode", 1.0)
    report.hbm_uses = hlo_stats.hbm_uses(USES)
    report.hlo_bytes = float(hlo_stats.hbm_bytes(USES))
    text = aot.format_hbm_top([report, aot.Report("advantages", 1.0)], 3, {"sampler decode": 4})
    lines = text.splitlines()
    total = 10 * 64 * 32 * 6
    assert lines[0].startswith(f"HBM traffic of sampler decode: {report.hlo_bytes / 1e9:.2f} GB")
    assert "the 3 largest of 5 contributors" in lines[0]
    assert len(lines) == 6  # title, header, rule, three rows; nothing for "advantages"
    cells = [c.strip() for c in lines[5].strip("|").split("|")]
    assert cells[1] == f"{100 * total / report.hlo_bytes:.1f}"
    assert cells[2] == f"{total / 4 / 1e9:.4f}"  # per token
    assert cells[3:8] == ["fusion:convert", "bf16[64,32]", f"{64 * 32 * 6 / 1e6:.2f}", "5", "2"]
    assert cells[8:] == ["c0", "while/body/convert_element_type"]


def _by_name(hlo):
    return {c.name: c for c in hlo_stats.collectives(hlo)}


def test_bytes_counts_and_groups_of_each_kind():
    got = _by_name(NESTED)
    assert sorted(got) == ["a2a", "ags", "ar", "cps", "rs"]  # the -done halves not counted
    ag, rs, ar, cp, a2a = got["ags"], got["rs"], got["ar"], got["cps"], got["a2a"]
    # all-gather-start: the result half of its tuple, 32 x 16 bf16; 4 x 3 executions
    assert (ag.kind, ag.shape, ag.bytes, ag.count, ag.group_size) == (
        "all-gather", "bf16[32,16]", 32 * 16 * 2, 12, 8,
    )  # fmt: skip
    # reduce-scatter: operand bytes = result 4 x 16 bf16 x group of 8
    assert (rs.kind, rs.bytes, rs.count, rs.group_size) == ("reduce-scatter", 1024, 12, 8)
    # tuple all-reduce over mesh axis_1 (4 devices): 10 + 6 f32
    assert (ar.shape, ar.dtype, ar.bytes, ar.group_size) == ("(f32[10], f32[6])", "f32", 64, 4)
    # collective-permute-start in a conditional branch of the outer loop: 4 executions,
    # the sent f32[8] (not its context scalars); the all-to-all once, in ENTRY
    assert (cp.kind, cp.shape, cp.bytes, cp.count) == ("collective-permute", "f32[8]", 32, 4)
    assert cp.group_size == 2  # the devices of its source_target_pairs
    assert (a2a.kind, a2a.bytes, a2a.count, a2a.computation) == ("all-to-all", 40, 1, "main")
    assert ag.computation == "inner_body"


def test_collective_bytes_and_trip_counts():
    assert hlo_stats.while_trip_counts(NESTED) == {"w": 3, "loop": 4}
    assert hlo_stats.unknown_trip_loops(NESTED) == []
    assert hlo_stats.collective_bytes(NESTED) == {
        "all-gather": 1024 * 12,
        "all-reduce": 64 * 12,
        "reduce-scatter": 1024 * 12,
        "all-to-all": 40,
        "collective-permute": 32 * 4,
    }


def test_tpu_clones_counted_once_and_trip_count_from_the_condition():
    assert hlo_stats.while_trip_counts(TPU_CLONES) == {"loop": 5}  # i from 2 while i < 7
    got = hlo_stats.collectives(TPU_CLONES)
    assert sorted((c.kind, c.bytes, c.count) for c in got) == [
        ("all-gather", 2048, 5),
        ("reduce-scatter", 256, 5),
    ]


def test_trip_count_follows_a_counter_that_steps_by_more_than_one():
    """XLA:TPU's windowed-einsum loops (collective matmul) count in 2s: `i < 4` from 0 is 2
    trips, not 4 (reading it as 4 doubled those loops' collective-permutes)."""
    old_root = "  ROOT %t = (s32[], bf16[1,256]{1,0}) tuple(%i, %x)\n}\n\n%cond"
    assert old_root in TPU_CLONES
    new_root = (
        "  %i0 = s32[] get-tuple-element(%p), index=0\n"
        "  %step = s32[] constant(2)\n"
        "  %i = s32[] add(%i0, %step)\n" + old_root
    )
    hlo = TPU_CLONES.replace(old_root, new_root)
    assert hlo_stats.while_trip_counts(hlo) == {"loop": 3}  # i = 2, 4, 6 while i < 7
    assert {c.count for c in hlo_stats.collectives(hlo)} == {3}
    counter_elsewhere = hlo.replace("%i = s32[] add(%i0, %step)", "%i = s32[] add(%q, %step)")
    assert hlo_stats.while_trip_counts(counter_elsewhere) == {"loop": 5}  # step unknown: 1


def test_unknown_loop_counts_once():
    hlo = TPU_CLONES.replace("direction=LT", "direction=NE")
    assert hlo_stats.while_trip_counts(hlo) == {}
    assert hlo_stats.unknown_trip_loops(hlo) == ["loop"]
    assert {c.count for c in hlo_stats.collectives(hlo)} == {1}


def test_not_hlo_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_stats.collectives("not an HLO module")


def test_a_compiled_scan_gathers_its_weight_every_iteration():
    """8 fake CPU devices: a scan over 5 stacked fsdp-sharded weights all-gathers one
    [64, 64] f32 weight per iteration; the reader must say 5 x 16 KiB."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    n, d = 5, 64

    def f(ws, x):
        def body(c, w):
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
            return jnp.tanh(c @ w), None

        return jax.lax.scan(body, x, ws)[0]

    ws = jax.ShapeDtypeStruct((n, d, d), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
    x = jax.ShapeDtypeStruct((16, d), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    hlo = jax.jit(f).lower(ws, x).compile().as_text()
    assert list(hlo_stats.while_trip_counts(hlo).values()) == [n]
    gathers = [c for c in hlo_stats.collectives(hlo) if c.kind == "all-gather"]
    assert [(c.shape, c.bytes, c.count, c.group_size) for c in gathers] == [
        (f"f32[{d},{d}]", d * d * 4, n, 8)
    ]
    assert hlo_stats.collective_bytes(hlo)["all-gather"] == n * d * d * 4
    np.testing.assert_equal(hlo_stats.collective_bytes(hlo)["all-to-all"], 0)


# ------------------------------------------------------------------- executed FLOPs

# XLA:TPU's form of a [448, 64] x [64, 64] matmul: the 4 output columns' blocks of 16 laid
# out as a spatial dimension with a window of 4 over a padded input of size 1, so only one
# of the 4 taps of each output position lands on the input (HloCostAnalysis counts those).
CONV = """HloModule c

%fused (param_0: f32[8,56,64,1], param_1: bf16[4,16,64,1]) -> f32[8,56,4,16] {
  %param_0 = f32[8,56,64,1]{2,1,3,0} parameter(0)
  %param_1 = bf16[4,16,64,1]{2,1,0,3} parameter(1)
  ROOT %convolution.1 = f32[8,56,4,16]{1,3,2,0} convolution(%param_0, %param_1), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}

%body (p: (s32[], f32[8,56,64,1])) -> (s32[], f32[8,56,64,1]) {
  %p = (s32[], f32[8,56,64,1]{2,1,3,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,56,64,1]{2,1,3,0} get-tuple-element(%p), index=1
  %w = bf16[4,16,64,1]{2,1,0,3} constant({...})
  %f = f32[8,56,4,16]{1,3,2,0} fusion(%x, %w), kind=kOutput, calls=%fused
  %d = f32[8,56,64,1]{2,1,3,0} dot(%x, %x), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={3}
  ROOT %t = (s32[], f32[8,56,64,1]{2,1,3,0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8,56,64,1])) -> pred[] {
  %p = (s32[], f32[8,56,64,1]{2,1,3,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,56,64,1]) -> f32[8,56,64,1] {
  %a = f32[8,56,64,1]{2,1,3,0} parameter(0)
  %z = s32[] constant(0)
  %s = (s32[], f32[8,56,64,1]{2,1,3,0}) tuple(%z, %a)
  %w = (s32[], f32[8,56,64,1]{2,1,3,0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[8,56,64,1]{2,1,3,0} get-tuple-element(%w), index=1
}
"""


def test_convolution_and_dot_flops_by_hand():
    ops = {o.name: o for o in hlo_stats.op_costs(CONV, vocab=56)}
    # 2 x (8 x 56 rows) x 64 contracted x (4 x 16) columns; one valid tap of the 4
    assert ops["f"].flops == 2 * 8 * 56 * 64 * 64 and ops["f"].count == 5
    assert ops["f"].cls == "vocab matmul"  # a dimension of 56: the "vocabulary" here
    # a batched dot: 2 x output elements (8 x 56 x 64 x 1) x contracted 1
    assert ops["d"].flops == 2 * 8 * 56 * 64 * 1
    # a CPU packs an unbatched matmul's larger input, not a batched dot's (its own loop)
    assert ops["d"].packed_bytes == 0 and ops["f"].packed_bytes > 0
    total = 5 * (2 * 8 * 56 * 64 * 64 + 2 * 8 * 56 * 64)
    assert hlo_stats.executed_flops(CONV) == total
    assert hlo_flops._valid_taps(4, 3, 2, 1, 0, 1, 1) == 6  # no padding: every tap counts
    assert hlo_flops._valid_taps(1, 4, 4, 1, 3, 1, 1) == 4  # one tap per output position


def test_executed_flops_of_compiled_programs_match_the_matmuls():
    """On the CPU (dots) and through a scan (trip counts): 2mnk per matmul per iteration."""
    x = jnp.ones((64, 128), jnp.float32)
    w = jnp.ones((7, 128, 128), jnp.float32)

    def f(x, w):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    text = jax.jit(f).lower(x, w).compile().as_text()
    assert hlo_stats.executed_flops(text) == 7 * 2 * 64 * 128 * 128
    # each dot's larger input (a [128, 128] f32 slice of w, not the [64, 128] carry) is what
    # a CPU matmul packs: 64 KB per iteration
    dots = [o for o in hlo_stats.op_costs(text) if o.flops]
    assert sum(o.count * o.packed_bytes for o in dots) == 7 * 128 * 128 * 4
    assert all(o.packed_bytes == 0 for o in hlo_stats.op_costs(text) if not o.flops)


UNKNOWN_IN_UNKNOWN = """HloModule u

%inner_body (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (p: f32[8,8]) -> pred[] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %w = f32[8,8]{1,0} while(%p), condition=%cond, body=%inner_body
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %w = f32[8,8]{1,0} while(%a), condition=%cond, body=%outer_body
}
"""


def test_inner_loops_of_unknown_trip_count_take_their_own_count():
    """A decode loop (unknown: max_new_tokens) around paged attention's block loops
    (unknown: the context's blocks): the inner count is the caller's to give."""
    (dot,) = hlo_stats.op_costs(UNKNOWN_IN_UNKNOWN, unknown_trip_count=10, inner_trip_count=3)
    assert dot.count == 30 and dot.flops == 2 * 8 * 8 * 8
    (dot,) = hlo_stats.op_costs(UNKNOWN_IN_UNKNOWN, unknown_trip_count=10)
    assert dot.count == 100  # as before: every unknown loop runs unknown_trip_count times


# XLA:TPU's lowering of `jax.lax.ragged_dot(x [4096, 1024], w [64, 1024, 512], sizes)`
# (libtpu, v5p; trimmed: the Mosaic body elided, the cost estimate it carries kept): a
# `tpu_custom_call` named ragged-dot-*, no dot or convolution in the HLO.
RAGGED_DOT_TPU = """HloModule jit_f

ENTRY %main.2 (x.1: bf16[4096,1024], w.1: bf16[64,1024,512], g.1: s32[64]) -> bf16[4096,512] {
  %g.1 = s32[64]{0:T(128)} parameter(2)
  %w.1 = bf16[64,1024,512]{2,1,0:T(8,128)(2,1)} parameter(1)
  %x.1 = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %ragged-dot-metadata = (s32[65]{0:T(128)}, s32[95]{0:T(128)}, s32[95]{0:T(128)}, s32[1]{0:T(128)}) custom-call(%g.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"..."}}
  %get-tuple-element = s32[1]{0:T(128)} get-tuple-element(%ragged-dot-metadata), index=3
  %get-tuple-element.1 = s32[65]{0:T(128)} get-tuple-element(%ragged-dot-metadata), index=0
  ROOT %ragged-dot-none = bf16[4096,512]{1,0:T(8,128)(2,1)} custom-call(%get-tuple-element, %get-tuple-element.1, %x.1, %w.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"...","cost_estimate":{"flops":"4294967296","transcendentals":"0","bytes_accessed":"79692032"}}}
}
"""


# XLA:TPU's (v5e, libtpu) compiled form of a 16-step scan `h = c @ w; ys[i] = h; c = h`,
# trimmed: the step is ONE multi-output fusion whose root tuple holds the dynamic-update-
# slice of the stacked f32[16,256,512] output (in HBM) and the new carry (in VMEM, S(1)).
# Added by hand: a second stacked input `s` read one chunk per step through a nested
# fusion's dynamic-slice, as XLA:TPU fuses a scan's reads of its stacked inputs.
SCAN = """HloModule s

%bitcast_fusion (bitcast_input.5: f32[256,512]) -> f32[256,512] {
  %bitcast_input.5 = f32[256,512]{1,0:T(8,128)S(1)} parameter(0)
  ROOT %bitcast.10 = f32[256,512]{1,0:T(8,128)} bitcast(%bitcast_input.5)
}

%slice_fusion (p0: f32[16,256,512], p1: s32[]) -> f32[256,512] {
  %p0 = f32[16,256,512]{2,1,0:T(8,128)} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  %ds = f32[1,256,512]{2,1,0:T(8,128)} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,512}
  ROOT %b = f32[256,512]{1,0:T(8,128)} bitcast(%ds)
}

%fused_computation.clone.1 (param_0.2: f32[16,256,512], param_1.3: s32[], param_2.5: f32[256,512], param_3.4: bf16[512,512], param_4: f32[16,256,512]) -> (f32[16,256,512], f32[256,512]) {
  %param_0.2 = f32[16,256,512]{2,1,0:T(8,128)} parameter(0)
  %param_2.5 = f32[256,512]{1,0:T(8,128)S(1)} parameter(2)
  %fusion.4 = f32[256,512]{1,0:T(8,128)} fusion(%param_2.5), kind=kLoop, calls=%bitcast_fusion
  %param_3.4 = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} parameter(3)
  %param_1.3 = s32[]{:T(128)S(6)} parameter(1)
  %param_4 = f32[16,256,512]{2,1,0:T(8,128)} parameter(4)
  %sliced = f32[256,512]{1,0:T(8,128)} fusion(%param_4, %param_1.3), kind=kLoop, calls=%slice_fusion
  %convolution.3 = f32[256,512]{1,0:T(8,128)S(1)} convolution(%fusion.4, %param_3.4), dim_labels=bf_io->bf
  %sum = f32[256,512]{1,0:T(8,128)S(1)} add(%convolution.3, %sliced)
  %bitcast.11 = f32[1,256,512]{2,1,0:T(8,128)} bitcast(%sum)
  %constant.19 = s32[]{:T(128)} constant(0)
  %dynamic_update_slice.5 = f32[16,256,512]{2,1,0:T(8,128)} dynamic-update-slice(%param_0.2, %bitcast.11, %param_1.3, %constant.19, %constant.19)
  ROOT %tuple.13 = (f32[16,256,512]{2,1,0:T(8,128)}, f32[256,512]{1,0:T(8,128)S(1)}) tuple(%dynamic_update_slice.5, %convolution.3)
}

%body (t: (s32[], f32[256,512], f32[16,256,512], bf16[512,512], f32[16,256,512])) -> (s32[], f32[256,512], f32[16,256,512], bf16[512,512], f32[16,256,512]) {
  %t = (s32[]{:T(128)}, f32[256,512]{1,0:T(8,128)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}, bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %c = f32[256,512]{1,0:T(8,128)S(1)} get-tuple-element(%t), index=1
  %ys = f32[16,256,512]{2,1,0:T(8,128)} get-tuple-element(%t), index=2
  %w = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%t), index=3
  %s = f32[16,256,512]{2,1,0:T(8,128)} get-tuple-element(%t), index=4
  %k = s32[]{:T(128)S(6)} copy(%i)
  %f = (f32[16,256,512]{2,1,0:T(8,128)}, f32[256,512]{1,0:T(8,128)S(1)}) fusion(%ys, %k, %c, %w, %s), kind=kOutput, calls=%fused_computation.clone.1
  %ys2 = f32[16,256,512]{2,1,0:T(8,128)} get-tuple-element(%f), index=0
  %c2 = f32[256,512]{1,0:T(8,128)S(1)} get-tuple-element(%f), index=1
  ROOT %r = (s32[]{:T(128)}, f32[256,512]{1,0:T(8,128)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}, bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}) tuple(%next, %c2, %ys2, %w, %s)
}

%cond (t: (s32[], f32[256,512], f32[16,256,512], bf16[512,512], f32[16,256,512])) -> pred[] {
  %t = (s32[]{:T(128)}, f32[256,512]{1,0:T(8,128)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}, bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  %n = s32[]{:T(128)} constant(16)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

ENTRY %main (c0: f32[256,512], ys0: f32[16,256,512], w0: bf16[512,512], s0: f32[16,256,512]) -> f32[16,256,512] {
  %c0 = f32[256,512]{1,0:T(8,128)S(1)} parameter(0)
  %ys0 = f32[16,256,512]{2,1,0:T(8,128)} parameter(1)
  %w0 = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} parameter(2)
  %s0 = f32[16,256,512]{2,1,0:T(8,128)} parameter(3)
  %zero = s32[]{:T(128)} constant(0)
  %t0 = (s32[]{:T(128)}, f32[256,512]{1,0:T(8,128)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}, bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}) tuple(%zero, %c0, %ys0, %w0, %s0)
  %w = (s32[]{:T(128)}, f32[256,512]{1,0:T(8,128)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}, bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, f32[16,256,512]{2,1,0:T(8,128)}) while(%t0), condition=%cond, body=%body
  ROOT %ys = f32[16,256,512]{2,1,0:T(8,128)} get-tuple-element(%w), index=2
}
"""


def test_a_tpu_ragged_dot_counts_each_row_once_as_a_matmul():
    """2 x 4096 rows x 1024 x 512 (each row times its own group's matrix), not 0 (a Pallas
    kernel's unknown FLOPs) nor x 64 groups (a dense matmul over every expert)."""
    ops = {o.name: o for o in hlo_stats.op_costs(RAGGED_DOT_TPU)}
    dot = ops["ragged-dot-none"]
    assert (dot.cls, dot.flops, dot.op) == (
        "matmul",
        2 * 4096 * 1024 * 512,
        "kernel:ragged-dot-none",
    )
    assert ops["ragged-dot-metadata"].cls == "kernel"  # no estimate: bytes only
    assert hlo_stats.executed_flops(RAGGED_DOT_TPU) == 2 * 4096 * 1024 * 512


def test_a_multi_output_fusion_updates_the_scan_output_in_place():
    """Each of the 16 steps writes its [256, 512] f32 chunk into the stacked output (the
    buffer itself neither read nor rewritten) and reads one chunk of `s`; the carry and
    `w` stay in VMEM, the index in SMEM (S(6)). Before, each step was charged 24 MiB: the
    whole stacked output read and written and the whole of `s` read. (A fusion whose
    root is the dynamic-update-slice alone: test_hbm_uses_say_where_the_bytes_go.)"""
    chunk = 256 * 512 * 4
    (use,) = [u for u in hlo_stats.hbm_uses(SCAN) if u.op == "fusion:tuple"]
    assert (use.bytes, use.count) == (2 * chunk, 16)
    # the new carry written to HBM instead of VMEM: one more chunk written per step
    in_hbm = SCAN.replace("S(1)}) fusion(", "}) fusion(").replace(
        "S(1)}) tuple(%dynamic", "}) tuple(%dynamic"
    )
    (use,) = [u for u in hlo_stats.hbm_uses(in_hbm) if u.op == "fusion:tuple"]
    assert use.bytes == 3 * chunk
    # written into a buffer of another shape (not in place): that buffer is read whole and
    # the output written whole
    other = SCAN.replace("%param_0.2 = f32[16,256,512]", "%param_0.2 = f32[16,512,256]")
    (use,) = [u for u in hlo_stats.hbm_uses(other) if u.op == "fusion:tuple"]
    assert use.bytes == 2 * 16 * chunk + chunk
    # the nested fusion hands `s` on whole (its result): `s` read whole
    whole = SCAN.replace("bitcast(%ds)", "bitcast(%p0)")
    (use,) = [u for u in hlo_stats.hbm_uses(whole) if u.op == "fusion:tuple"]
    assert use.bytes == chunk + 16 * chunk


# XLA:CPU's form of `fori_loop(0, 7, lambda i, v: v + i, x)` (jax 0.10.2, trimmed): the
# while loop is wrapped in a `call` (`xla_cpu_small_call`), its body reached through it.
CALLED_LOOP = """HloModule c

%fused_computation (p0: s32[], p1: f32[16]) -> f32[16] {
  %p1 = f32[16]{0} parameter(1)
  %p0 = s32[] parameter(0)
  %cv = f32[] convert(%p0)
  %b = f32[16]{0} broadcast(%cv), dimensions={}
  ROOT %add = f32[16]{0} add(%p1, %b)
}

%body (t: (s32[], f32[16])) -> (s32[], f32[16]) {
  %t = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %f = f32[16]{0} fusion(%i, %v), kind=kLoop, calls=%fused_computation
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[16]{0}) tuple(%next, %f)
}

%cond (t: (s32[], f32[16])) -> pred[] {
  %t = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%while.1_computation (tuple.15: (s32[], f32[16])) -> (s32[], f32[16]) {
  %tuple.15 = (s32[], f32[16]{0}) parameter(0)
  ROOT %while.2 = (s32[], f32[16]{0}) while(%tuple.15), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
}

ENTRY %main (x.1: f32[16]) -> f32[16] {
  %x.1 = f32[16]{0} parameter(0)
  %zero = s32[] constant(0)
  %tuple.12 = (s32[], f32[16]{0}) tuple(%zero, %x.1)
  %call = (s32[], f32[16]{0}) call(%tuple.12), to_apply=%while.1_computation, frontend_attributes={xla_cpu_small_call="true"}
  ROOT %out = f32[16]{0} get-tuple-element(%call), index=1
}
"""


def test_a_loop_wrapped_in_a_call_is_counted_through_it():
    """The loop body's fusion runs 7 times (was 0: `call`'s to_apply was not followed)."""
    (fusion,) = [o for o in hlo_stats.op_costs(CALLED_LOOP) if o.op.startswith("fusion")]
    assert fusion.count == 7 and fusion.bytes == 16 * 4 * 2 + 4
