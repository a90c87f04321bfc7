"""A full disk while writing anything the run writes whole or appends (summary.json,
config.json, metrics.jsonl, TensorBoard's events, curves.png, the exports): one line naming
the file, what was lost and what is kept; nothing already written is torn or replaced by a
partial file; no traceback from a writer's thread. Each case on a real 1 MiB tmpfs, filled
(root only, else skipped), or with the error injected where the library reports it."""

import errno
import json
import os

import jax
import numpy as np
import pytest
from helpers import fill_disk, small_tmpfs

from gspo_jax import models
from gspo_jax.trainer.io import checkpoint, disk, summary, writers

TINY = models.ModelConfig(
    arch="qwen3",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    qk_norm=True,
)


@pytest.fixture
def full(tmp_path):
    """A 1 MiB tmpfs with a workdir in it; `full.fill()` fills it to the last byte."""
    with small_tmpfs(tmp_path / "small", "1m") as mount:
        workdir = mount / "run"
        workdir.mkdir()

        class Full:
            path = workdir

            @staticmethod
            def fill():
                fill_disk(mount)

        yield Full


def _one_line(error: BaseException, path) -> str:
    text = str(error)
    assert "\n" not in text and isinstance(error, OSError)
    assert error.errno == errno.ENOSPC and str(path) in text, text
    assert "No space left on device" in text and "kept" in text, text
    return text


def test_summary_json_is_kept_whole(full):
    summary.write_summary(str(full.path), {"eval_start": 0.1})
    full.fill()
    with pytest.raises(disk.DiskWriteError) as caught:
        summary.write_summary(str(full.path), {"eval_end": 0.9, "note": "x" * 10_000})
    text = _one_line(caught.value, full.path / "summary.json")
    assert "previous summary.json, as it was" in text
    assert json.loads((full.path / "summary.json").read_text()) == {"eval_start": 0.1}
    assert sorted(os.listdir(full.path)) == ["summary.json"]  # no temporary file left


def test_a_metrics_row_that_does_not_fit_is_cut_back_off(full):
    writer = writers.MetricsWriter(str(full.path), tensorboard=False)
    writer.write(1, {"reward/mean": 0.5})
    full.fill()
    with pytest.raises(disk.DiskWriteError) as caught:
        writer.write(2, {f"k{i}": float(i) for i in range(2000)})
    text = _one_line(caught.value, full.path / "metrics.jsonl")
    assert "step 2's row is lost" in text and "rows before it are kept" in text
    rows = (full.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]


def test_tensorboards_thread_fails_into_one_line_not_a_traceback(tmp_path, capfd):
    writer = writers.MetricsWriter(str(tmp_path), tensorboard=True)
    writer.write(1, {"reward/mean": 0.5})
    events = writer._tb_events
    assert events is not None and not events.error

    def no_room(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    events.inner.write_event = events.inner.flush = no_room
    writer._tb.add_scalar("x", 1.0, 2)
    writer._tb.flush()
    with pytest.raises(disk.DiskWriteError) as caught:
        writer.write(3, {"reward/mean": 0.5})
    _one_line(caught.value, events.inner._file_name)
    writer.close()  # never raises
    assert "Traceback" not in capfd.readouterr().err


def test_curves_png_is_never_half_written(full, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(5))
    )
    png = full.path / "curves.png"
    png.write_bytes(b"the previous plot")
    full.fill()
    with pytest.raises(disk.DiskWriteError) as caught:
        writers.plot_curves(str(metrics), str(png))
    _one_line(caught.value, png)
    assert png.read_bytes() == b"the previous plot"
    assert sorted(os.listdir(full.path)) == ["curves.png"]


def test_an_export_that_does_not_fit_keeps_the_previous_one(tmp_path, monkeypatch):
    """safetensors reports the full disk in its own words, with no errno."""
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    path = str(tmp_path / "hf")
    checkpoint.export_hf(TINY, None, params, path)
    before = sorted(os.listdir(path))

    def serialize_fails(model_config, params, out):
        os.makedirs(out, exist_ok=True)
        (tmp_path / "hf.partial" / "model.safetensors").write_bytes(b"half")
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(models, "save_pretrained", serialize_fails)
    with pytest.raises(disk.DiskWriteError) as caught:
        checkpoint.export_hf(TINY, None, jax.tree.map(lambda p: p * 2, params), path)
    text = _one_line(caught.value, path)
    assert "the final policy's export" in text and "the previous export" in text
    assert sorted(os.listdir(path)) == before and not os.path.exists(path + ".partial")
    _, kept = models.load_pretrained(path)
    jax.tree.map(np.testing.assert_array_equal, kept, params)


def test_other_errors_pass_unchanged(tmp_path):
    with pytest.raises(PermissionError), disk.writing(str(tmp_path), "x", "y"):
        raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(ValueError, match="not a disk error"), disk.writing(str(tmp_path), "x", "y"):
        raise ValueError("not a disk error")


def test_the_run_prints_it_as_its_one_line():
    """main's report of it (in a process of its own: gspo_jax.main defines absl flags)."""
    import subprocess
    import sys

    code = (
        "import sys; from absl import flags; from gspo_jax import main; "
        "from gspo_jax.trainer.io import disk; flags.FLAGS(['main']); "
        "sys.exit(main._report(disk.DiskWriteError(28, '/w/summary.json: not written (...): "
        "lost; kept')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gspo_jax:")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("gspo_jax: error: /w/summary.json: not written (...): lost; kept")
    assert "Traceback" not in proc.stderr
