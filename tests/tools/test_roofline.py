"""tools/roofline.py: the arithmetic of the aot report's time estimate (no libtpu needed).

Every number below is worked by hand from the chip table's figures.
"""

import dataclasses

import pytest

from tools import roofline
from tools.hlo_stats import Collective

V5E = roofline.CHIPS["v5e"]  # 197e12 FLOP/s, 819e9 B/s HBM, 400e9 B/s ICI, 10 us


def _c(kind, nbytes, count, group):
    return Collective(kind, "bf16[1]", "bf16", nbytes, count, "body", group)


def test_chip_table_and_topology_names():
    assert roofline.chip_for("v5p:4x4x4").peak_flops == 459e12
    assert roofline.chip_for("v5e:2x4").hbm_bw == 819e9
    assert roofline.chip_for("H100").name == "H100 SXM"
    for chip in roofline.CHIPS.values():
        assert chip.peak_flops > 0 and chip.hbm_bw > 0 and chip.ici_bw > 0 and chip.source
    with pytest.raises(ValueError, match="unknown chip 'v9'"):
        roofline.chip_for("v9:2x2")


def test_ring_factors():
    assert roofline.ring_factor("all-gather", 8) == 7 / 8
    assert roofline.ring_factor("reduce-scatter", 4) == 3 / 4
    assert roofline.ring_factor("all-reduce", 8) == 2 * 7 / 8
    assert roofline.ring_factor("collective-permute", 2) == 1.0
    assert roofline.ring_factor("all-gather", 1) == 0.0  # a group of one moves nothing
    with pytest.raises(ValueError, match="unknown collective kind"):
        roofline.ring_factor("all-sum", 2)


def test_hbm_bytes_corrects_for_loops_counted_once():
    # XLA counted a 10-iteration loop body once: 1e9 of 1e10 model FLOPs
    assert roofline.hbm_bytes(2e9, 1e9, 1e10) == 2e10
    assert roofline.hbm_bytes(2e9, 1e10, 5e9) == 2e9  # no loop: XLA's own count
    assert roofline.hbm_bytes(2e9, 0.0, 5e9) == 2e9


def test_estimate_by_hand():
    # 8 x 1 GB all-gathers over 8 chips: 8 * 1e9 * 7/8 / 400e9 = 0.0175 s;
    # 2 x 0.5 GB all-reduces over 4: 2 * 0.5e9 * 1.5 / 400e9 = 0.00375 s; 10 executions
    e = roofline.estimate(
        V5E, 197e12 * 0.03, 819e9 * 0.01,
        [_c("all-gather", 1e9, 8, 8), _c("all-reduce", 0.5e9, 2, 4), _c("all-reduce", 8, 5, 1)],
    )  # fmt: skip
    assert e.compute_s == pytest.approx(0.03)
    assert e.hbm_s == pytest.approx(0.01)
    assert e.ici_s == pytest.approx(0.0175 + 0.00375)
    assert e.collectives == 10  # the group-of-one all-reduce is no traffic, no latency
    assert e.latency_s == pytest.approx(10 * 10e-6)
    assert e.overlapped_s == pytest.approx(0.03 + 1e-4)
    assert e.serial_s == pytest.approx(0.03 + 0.02125 + 1e-4)
    assert e.bound == "compute"
    assert e.ici_bytes == {"all-gather": 8e9, "all-reduce": 1e9}  # the group of one: none
    assert roofline.mfu(197e12 * 0.03, 0.06, V5E) == pytest.approx(0.5)


@dataclasses.dataclass
class _Report:
    name: str
    flops: float
    hbm: float
    collectives: list
    xla_flops: float = 0.0
    error: str | None = None


def test_step_summary_phases_sum_to_the_total():
    reports = [
        _Report("sampler prefill", 197e12 * 0.5, 0, []),
        _Report("sampler decode", 0, 819e9 * 4.0, []),  # HBM-bound: 4 s
        _Report("logprobs", 197e12 * 1.0, 0, [_c("all-gather", 400e9 / 7 * 8, 1, 8)]),  # 1 s
        _Report("advantages", 0, 0, []),
        _Report("train step", 197e12 * 3.0, 0, [_c("all-gather", 400e9 / 7 * 8, 1, 8)]),
        _Report("too big", 1.0, 0, [], error="out of HBM"),  # left out
    ]
    text = roofline.format_estimates(reports, V5E, decoded_tokens=8000)
    assert "too big" not in text and "ESTIMATED" in text
    # overlapped: 0.5 + 4 + 1 + 0 + 3 (+ latency 2e-5); serial: 0.5 + 4 + 2 + 0 + 4
    assert "| RL step | 8.5 to 10.5 | |" in text
    assert "| decode | 4 | 47% |" in text
    assert (
        "| logprobs | 197.00 | 0.00 | 0.0 | 457.14 / 0 / 0 / 0 / 0 | 1 | 1 | 0 | 1 | 1e-05 | 1 to 2 |"
        in text
    )
    # MFU: 3 s of compute in 4 s serial, 3 s overlapped
    assert "train step MFU (est.): 75% to 100%" in text
    assert "decode (est.): 2,000 to 2,000 tokens/s/chip" in text


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
