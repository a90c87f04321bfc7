"""tools/roofline.py: the arithmetic of the aot report's time estimate (no libtpu needed).

Every number below is worked by hand from the chip table's figures and the assumed
efficiencies (tools/roofline.EFFICIENCY).
"""

import dataclasses

import pytest

from tools import roofline
from tools.hlo_stats import Collective, OpCost

V5E = roofline.CHIPS["v5e"]  # 197e12 FLOP/s, 819e9 B/s HBM, 50e9 B/s per link each way
EFF = roofline.EFFICIENCY


def _c(kind, nbytes, count, group):
    return Collective(kind, "bf16[1]", "bf16", nbytes, count, "body", group)


def _op(cls, flops, nbytes, count=1, op="fusion", operands=()):
    return OpCost("x", op, cls, flops, nbytes, count, "body", "f32[1]", operands)


def test_chip_table_and_topology_names():
    assert roofline.chip_for("v5p:4x4x4").peak_flops == 459e12
    assert roofline.chip_for("v5e:2x4").hbm_bw == 819e9
    assert roofline.chip_for("H100").name == "H100 SXM"
    # the published per-chip figures: v5e 1,600 Gbps one way = 400 GB/s both ways, 4 links
    assert V5E.ici_bw == 400e9 and roofline.CHIPS["v5p"].ici_bw == 1200e9
    for chip in roofline.CHIPS.values():
        assert chip.peak_flops > 0 and chip.hbm_bw > 0 and chip.link_bw > 0 and chip.source
        assert all(0 < e <= 1 for e in chip.efficiency.values())
    with pytest.raises(ValueError, match="unknown chip 'v9'"):
        roofline.chip_for("v9:2x2")
    assert roofline.torus_dims("v5p:4x4x4") == (4, 4, 4) and roofline.torus_dims("h100") == ()


def test_ring_factors_and_spanned_axes():
    assert roofline.ring_factor("all-gather", 8) == 7 / 8
    assert roofline.ring_factor("reduce-scatter", 4) == 3 / 4
    assert roofline.ring_factor("all-reduce", 8) == 2 * 7 / 8  # twice over the wire
    assert roofline.ring_factor("collective-permute", 2) == 1.0
    assert roofline.ring_factor("all-gather", 1) == 0.0  # a group of one moves nothing
    with pytest.raises(ValueError, match="unknown collective kind"):
        roofline.ring_factor("all-sum", 2)
    assert roofline.spanned_axes(4, (4, 4, 4)) == (4,)
    assert roofline.spanned_axes(16, (4, 4, 4)) == (4, 4)
    assert roofline.spanned_axes(64, (4, 4, 4)) == (4, 4, 4)
    assert roofline.spanned_axes(8, (2, 4)) == (4, 2)
    assert roofline.spanned_axes(8, ()) == (8,)  # a switch


def test_a_collective_gets_only_its_axes_links():
    # 1 GB all-gather over 4 v5e chips of one axis: 0.75 GB on the wire per chip over 2
    # links of 50 GB/s at 0.8; ring steps 3 x 1 us
    wire, s, lat = roofline.collective_time(V5E, _c("all-gather", 1e9, 1, 4), (4, 4))
    assert wire == pytest.approx(0.75e9)
    assert s == pytest.approx(0.75e9 / (2 * 50e9 * EFF["ICI"]))
    assert lat == pytest.approx(3e-6)
    # an all-reduce over the 8 chips of v5e:2x4 (both axes, 4 links): 2 x 7/8 on the wire
    wire, s, lat = roofline.collective_time(V5E, _c("all-reduce", 1e9, 2, 8), (2, 4))
    assert wire == pytest.approx(2 * 1e9 * 2 * 7 / 8)
    assert s == pytest.approx(wire / (4 * 50e9 * EFF["ICI"]))
    assert lat == pytest.approx(2 * 2 * (3 + 1) * 1e-6)  # 2 executions x 2 x (3 + 1) steps
    assert roofline.collective_time(V5E, _c("all-gather", 1e9, 5, 1), (2, 4)) == (0, 0, 0)


def test_estimate_op_by_op_by_hand():
    peak, bw = V5E.peak_flops, V5E.hbm_bw
    ops = [
        # compute-bound matmul: 10 x 1e12 FLOPs, few bytes
        _op("matmul", 1e12, 1e6, count=10),
        # HBM-bound vocab matmul: 1e9 FLOPs, 8.19e9 bytes
        _op("vocab matmul", 1e9, 8.19e9),
        _op("elementwise", 0.0, 819e6, count=2),
    ]
    e = roofline.estimate(V5E, ops, [_c("all-gather", 1e9, 1, 4)], (4, 4))
    matmul = 10 * 1e12 / (peak * EFF["matmul"])
    vocab = 8.19e9 / (bw * EFF["HBM"])
    elementwise = 2 * 819e6 / (bw * EFF["HBM"])
    assert e.classes["matmul"]["s"] == pytest.approx(matmul)
    assert e.classes["vocab matmul"]["s"] == pytest.approx(vocab)
    assert e.classes["elementwise"]["s"] == pytest.approx(elementwise)
    assert e.ops_s == pytest.approx(matmul + vocab + elementwise)  # summed, not one max
    assert e.executed_flops == pytest.approx(10 * 1e12 + 1e9)
    assert e.hbm_bytes == pytest.approx(10 * 1e6 + 8.19e9 + 2 * 819e6)
    ici = 0.75e9 / (2 * 50e9 * EFF["ICI"])
    assert e.ici_s == pytest.approx(ici) and e.latency_s == pytest.approx(3e-6)
    assert e.low_s == pytest.approx(max(e.ops_s, ici) + 3e-6)
    assert e.high_s == pytest.approx(e.ops_s + ici + 3e-6)
    assert e.wire_bytes == {"all-gather": pytest.approx(0.75e9)} and e.collectives == 1
    assert e.bound == "matmul"
    # no estimate is below executed FLOPs / peak
    assert e.low_s >= e.executed_flops / peak
    assert "per-op cost" not in e.classes  # a TPU's per-op cost: not modelled (0)
    # a chip with a fixed cost per op execution (a CPU's, measured): 10 + 1 + 2 executions
    with_op = roofline.estimate(dataclasses.replace(V5E, op_s=1e-3), ops)
    assert with_op.classes["per-op cost"]["s"] == pytest.approx(13e-3)
    assert with_op.ops_s == pytest.approx(matmul + vocab + elementwise + 13e-3)


def test_a_cpu_matmul_adds_the_packing_of_its_larger_input():
    # an 8-row matmul: 2 x 8 x 1024 x 4096 FLOPs, its 16 MB matrix packed at 10 GB/s; HBM time
    # 16.8 MB at 40 GB/s. On a chip without packing (a TPU): the plain max.
    flops, packed, nbytes = 2 * 8 * 1024 * 4096, 16 * 2**20, 16.8e6
    cpu = dataclasses.replace(V5E, peak_flops=250e9, hbm_bw=40e9, matmul_pack_bw=10e9)
    cpu = dataclasses.replace(cpu, efficiency=dict.fromkeys(EFF, 1.0))
    op = dataclasses.replace(_op("matmul", flops, nbytes), packed_bytes=packed)
    want = flops / 250e9 + packed / 10e9  # 0.27 ms + 1.68 ms > 0.42 ms of HBM time
    assert roofline.op_time(cpu, "matmul", flops, nbytes, packed) == pytest.approx(want)
    assert roofline.estimate(cpu, [op]).classes["matmul"]["s"] == pytest.approx(want)
    tpu = roofline.estimate(V5E, [op]).classes["matmul"]["s"]
    assert tpu == pytest.approx(
        max(flops / (V5E.peak_flops * EFF["matmul"]), nbytes / (V5E.hbm_bw * EFF["HBM"]))
    )
    # packing never applies to an op without FLOPs
    assert roofline.op_time(cpu, "elementwise", 0.0, nbytes, packed) == pytest.approx(nbytes / 40e9)


def test_splash_kernel_flops_from_its_shapes_and_blocks():
    # q [B=2, H=4, L=1024, C=128] bf16, k/v [2, 2, 1024, 128]: block 512, n = 2 blocks per
    # side, 3 of the 4 blocks run (causal), each in full
    q = "bf16[2,4,1024,128]{3,2,1,0}"
    kv = "bf16[2,2,1024,128]{3,2,1,0}"
    full = 2 * 4 * 128 * 1024 * 1024 * 3 / 4
    for name, matmuls in (("fwd", 2), ("dq", 3), ("dkv", 4)):
        op = _op(
            "kernel", 0.0, 1000, op=f"kernel:splash_mha_{name}_segmented", operands=(q, kv, kv)
        )
        flops, nbytes = roofline.kernel_cost(op)
        assert flops == pytest.approx(2 * matmuls * full), name
        # K and V re-read for each query block: n x frac - 1 = 0.5 more passes over them
        assert nbytes == pytest.approx(1000 + 0.5 * 2 * 2 * 2 * 1024 * 128 * 2)
    e = roofline.estimate(
        V5E, [_op("kernel", 0.0, 0, op="kernel:splash_mha_fwd", operands=(q, kv, kv))]
    )
    assert e.classes["attention kernel"]["flops"] == pytest.approx(4 * full)
    other = _op("kernel", 0.0, 1000, op="kernel:something_else")
    assert roofline.kernel_cost(other) == (0.0, 1000.0)


@dataclasses.dataclass
class _Report:
    name: str
    flops: float
    ops: list
    collectives: list = dataclasses.field(default_factory=list)
    error: str | None = None


def _seconds_of(cls, s, chip=V5E):
    """An op taking `s` seconds on `chip`: compute-bound FLOPs at the class's efficiency."""
    if cls == "elementwise":
        return _op(cls, 0.0, s * chip.hbm_bw * chip.efficiency["HBM"])
    return _op(cls, s * chip.peak_flops * chip.efficiency[cls], 0)


def test_step_summary_counts_each_pass_once():
    reports = [
        _Report("sampler prefill", 1.0, [_seconds_of("matmul", 0.5)]),
        _Report("sampler decode", 1.0, [_seconds_of("elementwise", 4.0)]),
        _Report("logprobs", 1.0, [_seconds_of("matmul", 1.0)]),
        _Report("advantages", 0.0, []),
        _Report("train step", 197e12 * 1.5, [_seconds_of("matmul", 3.0)]),
        _Report("too big", 1.0, [], error="out of HBM"),  # left out
    ]
    rows = roofline.estimates(reports, V5E)
    # the train step runs π_old itself: the log-prob function is not called (0 times)
    s = roofline.step_summary(rows, V5E, decoded_tokens=8000, logprob_calls=0)
    assert s["est_seconds"] == [pytest.approx(7.5), pytest.approx(7.5)]
    s1 = roofline.step_summary(rows, V5E, decoded_tokens=8000, logprob_calls=1)
    assert s1["est_seconds"][0] == pytest.approx(8.5)  # π_ref with a KL term: once
    # MFU: 1.5 s of model FLOPs at peak in 3 s; HFU: executed FLOPs 3 s x 0.8 of peak
    assert s["train_step_mfu"] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert s["train_step_hfu"] == [pytest.approx(EFF["matmul"])] * 2
    assert s["decode_tokens_per_s_per_chip"] == [pytest.approx(2000)] * 2
    text = roofline.format_estimates(reports, V5E, decoded_tokens=8000, logprob_calls=0)
    assert "too big" not in text and "ESTIMATED" in text
    assert "| log-prob pass | 0 | 1 | 0% |" in text
    assert "| RL step | | 7.5 | |" in text
    assert "train step (est.): MFU 50%, HFU 80% of TPU v5e peak" in text
    assert "decode (est.): 2,000 tokens/s/chip" in text
    out = roofline.json_summary(reports, V5E, decoded_tokens=8000, logprob_calls=0)
    assert out["chip"] == "TPU v5e" and "too big" not in out["functions"]
    train = out["functions"]["train step"]
    keys = {"model_flops", "executed_flops", "hbm_bytes", "ici_wire_bytes", "est_seconds"}
    assert keys <= set(train) and train["est_seconds"] == [pytest.approx(3.0)] * 2
    assert set(out["rl_step"]) == {
        "est_seconds",
        "train_step_mfu",
        "train_step_hfu",
        "decode_tokens_per_s_per_chip",
    }


def test_fsdp_traffic_against_the_textbook_count():
    """aot.fsdp_traffic: collective bytes per micro-batch / (3 gathers in the compute dtype
    + 1 reduce-scatter in the parameter dtype) x parameters."""
    from configs import default
    from gspo_jax import models
    from tools import aot

    c = default.get_config()  # 16 x 8 responses, 4 mini-batches of 32: 4 micro-batches
    c.model.dtype = "bfloat16"  # f32 master weights: 3 x 2 + 4 = 10 bytes per parameter
    cfg = aot.model_config_for(c, "Qwen3-0.6B")
    n = models.param_count(cfg)
    # The group-of-one all-gather (XLA:TPU leaves some in MoE programs) moves nothing.
    collectives = [_c("all-gather", 10 * n, 6, 8), _c("all-gather", 10 * n, 6, 1)]
    train = aot.Report("train step", 1.0, collectives=collectives)
    line = aot.fsdp_traffic(c, cfg, [aot.Report("logprobs", 1.0), train])
    assert f"{6 * 10 * n / 4 / 1e9:.2f} GB per micro-batch per chip (4 micro-batches)" in line
    assert line.endswith(": 1.50x") and f"textbook FSDP {10 * n / 1e9:.2f} GB" in line
    assert aot.fsdp_traffic(c, cfg, [aot.Report("logprobs", 1.0)]) is None


def test_splash_kernel_of_one_row_comes_without_its_batch_dimension():
    # a micro-batch of one row: q [heads, L, C], k/v [kv heads, L, C]
    q, kv = "bf16[16,9216,128]{2,1,0}", "bf16[8,9216,128]{2,1,0}"
    op = _op("kernel", 0.0, 0, op="kernel:splash_mha_dkv_segmented", operands=(q, kv, kv))
    n = 9216 // 512
    assert roofline.kernel_cost(op)[0] == pytest.approx(8 * 16 * 128 * 9216**2 * (n + 1) / (2 * n))


def test_splash_fused_backward_counts_dq_in_its_dkv_kernel():
    # use_fused_bwd_kernel: the dkv kernel also writes dq partials, one per key block
    q, kv = "bf16[16,9216,128]{2,1,0}", "bf16[8,9216,128]{2,1,0}"
    n = 9216 // 512
    unfused = _op("kernel", 0.0, 0, op="kernel:splash_mha_dkv_x", operands=(q, kv, kv))
    fused = dataclasses.replace(unfused, shape=f"(bf16[{n},16,9216,128], {kv}, {kv})")
    assert roofline.kernel_cost(fused)[0] == pytest.approx(
        roofline.kernel_cost(unfused)[0] * 10 / 8
    )


def test_int8_pages_price_half_the_bf16_bytes_plus_their_scales():
    """The decode kernel's bytes per context position and layer (Qwen3-0.6B's 8 kv heads of
    128): bf16 pages 2·8·128·2 = 4,096; int8 pages (our kernel) 2·8·128 = 2,048 plus 16
    f32 scales, 64 bytes at page_size 128, a page's 16-lane scale row padded to 128 lanes
    at page_size 16 (512 bytes)."""
    import jax
    import jax.numpy as jnp

    from gspo_jax import models

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    bf16 = roofline.paged_kv_bytes_per_position(sds((64, 16, 16, 128), jnp.bfloat16))
    assert bf16 == 4096
    for ps, scales in [(128, 64), (256, 64), (16, 512)]:
        pool = models.Int8Pages(sds((64, 16, ps, 128), jnp.int8), sds((64, 16, ps), jnp.float32))
        assert roofline.paged_kv_bytes_per_position(pool) == bf16 / 2 + scales


def test_shared_prefix_decode_reads_a_resident_prompt_once():
    """tools/aot.py's decode bytes with `sampling.shared_prefix_attention` (int8 pages):
    the slots hold consecutive sequences in waves (G = 8): 64 slots of 64 sequences hold
    all 8 prompts; 16 slots, 2 per wave; 12 slots, waves of sequences 0-11, 12-23, ...,
    60-63 span 2, 2, 2, 2, 2, 1 prompts (11/6). The paper's geometry (64 slots, prompts of
    1,024, responses of 8,192: T/2 on average) reads 8 x 1,024 + 64 x 4,096 positions per
    step where every row reading its own context reads 64 x 5,120: 0.825x; a prompt of
    1,000 tokens shares its 7 whole pages of 128, the other 104 positions are each row's."""
    import types

    import jax
    import jax.numpy as jnp

    from gspo_jax import models
    from gspo_jax.sampling.pages import PagePlan
    from tools import aot_rollout

    assert aot_rollout.resident_prompts(64, 64, 8) == 8
    assert aot_rollout.resident_prompts(64, 16, 8) == 2
    assert aot_rollout.resident_prompts(64, 12, 8) == pytest.approx(11 / 6)
    cfg = types.SimpleNamespace(num_layers=28, num_linear_layers=0, linear_num_value_heads=0)
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 0
    sds = jax.ShapeDtypeStruct
    pool = models.Int8Pages(sds((9, 2, 128, 128), jnp.int8), sds((9, 2, 128), jnp.float32))
    local = PagePlan(num_slots=64, page_size=128, num_pages=64 * 65, prompt_pages=8, seq_pages=65)

    def read(P, shared):
        return aot_rollout._engine_hbm_bytes(cfg, {}, pool, local, P, 8192, 1, shared)

    assert read(1024, 8.0) / read(1024, 0.0) == (8 * 1024 + 64 * 4096) / (64 * 5120)
    assert read(1000, 8.0) / read(1000, 0.0) == (8 * 896 + 64 * (104 + 4096)) / (64 * 5096)
