"""metrics.jsonl / TensorBoard / curves.png writers."""

import json
import logging
import math
import os
import struct

from gspo_jax.trainer.io import writers


def test_ema_is_bias_corrected():
    assert writers._ema([1.0, 1.0, 1.0], 0.9) == [1.0, 1.0, 1.0]
    # avg1 = 0.5*0 = 0 -> 0; avg2 = 0.5*0 + 0.5*10 = 5 -> 5 / (1 - 0.25) = 6.67
    assert writers._ema([0.0, 10.0], 0.5) == [0.0, 10.0 / 1.5]


def test_writer_rows_resume_and_non_finite(tmp_path):
    w = writers.MetricsWriter(str(tmp_path))
    w.write(1, {"reward/mean": 0.5, "policy/clipfrac": float("nan")})
    w.write(2, {"reward/mean": 0.6})
    w.write(2, {"eval/accuracy": 0.25})  # same step, e.g. evaluation written after
    w.write(1, {"reward/mean": 0.7})  # a resumed run rewrites step 1: the later row wins
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["policy/clipfrac"] == "nan"  # JSON has no NaN: kept visible as text
    rows = writers.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.7 and rows[1] == {
        "step": 2,
        "reward/mean": 0.6,
        "eval/accuracy": 0.25,
    }
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
    png = writers.plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "c.png"))
    assert os.path.getsize(png) > 5_000 and not math.isnan(rows[0]["reward/mean"])


def _tb_tags(tb_dir) -> dict[str, float]:
    """{tag: value} of the scalars in a TensorBoard directory's event files (TFRecords:
    length, its CRC, an Event proto, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = {}
    for name in os.listdir(tb_dir):
        data = (tb_dir / name).read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            tags.update({v.tag: v.simple_value for v in event.summary.value})
    return tags


def test_tensorboard_tags_replace_what_tensorboard_refuses_without_a_log_line(tmp_path, caplog):
    """eval/pass@k and eval/maj@k: tensorboardX renamed them itself and logged "Summary name
    eval/pass@1 is illegal" for each at every evaluation."""
    caplog.set_level(logging.INFO)
    w = writers.MetricsWriter(str(tmp_path))
    w.write(0, {"eval/pass@1": 0.25, "eval/maj@4": 0.5, "reward/mean": 0.75})
    w.close()
    assert _tb_tags(tmp_path / "tb") == {
        "eval/pass_1": 0.25,
        "eval/maj_4": 0.5,
        "reward/mean": 0.75,
    }
    assert not [r for r in caplog.records if "illegal" in r.getMessage()]
    assert writers.tb_tag("a b/c-d.e@f") == "a_b/c-d.e_f"
    row = json.loads((tmp_path / "metrics.jsonl").read_text())  # the keys themselves stay
    assert row == {"step": 0, "eval/pass@1": 0.25, "eval/maj@4": 0.5, "reward/mean": 0.75}


def test_per_update_panels_expand_in_update_order_and_absent_panels_are_left_out(
    tmp_path, monkeypatch
):
    present = {"updates/ratio_min/10", "updates/ratio_min/2", "updates/ratio_min/0", "x/1"}
    assert writers._expand(["updates/ratio_min/*", "reward/mean"], present) == [
        "updates/ratio_min/0",
        "updates/ratio_min/2",
        "updates/ratio_min/10",
        "reward/mean",
    ]
    w = writers.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in range(40):
        per_update = {f"updates/ratio_max/{u}": 1 + u for u in range(4)}
        w.write(step, {"reward/mean": step / 40, **per_update})
    w.close()
    import matplotlib.axes

    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, t, *a, **k: titles.append(t))
    writers.plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "c.png"))
    # Reward and the ratio panel have data; the expert-change panel (no MoE) is left out.
    assert titles == ["reward", "ratio min / max, per update"]


def test_resume_keeps_one_row_per_step(tmp_path):
    """After a restart from checkpoint k, the rows an interrupted run wrote after k are
    dropped (they are written again): they used to appear twice."""
    w = writers.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in range(6):
        w.write(step, {"reward/mean": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # torn by a kill mid-write
    assert writers.MetricsWriter(str(tmp_path), tensorboard=False).resume(3) == 3
    assert [r["step"] for r in writers.read_metrics(str(tmp_path / "metrics.jsonl"))] == [
        0,
        1,
        2,
        3,
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(x) for x in lines)
    w = writers.MetricsWriter(str(tmp_path))
    assert w.resume(0) == 4  # step 0 (its evaluation) is redone too
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    w.close()
