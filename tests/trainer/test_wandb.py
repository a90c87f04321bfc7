"""Weights & Biases (trainer/io/wandb_writer.py) in offline mode, and the tiny end-to-end run
with eval.pass_k=4 (pass@k / maj@k) that feeds it: no network, no login.

The offline run file (run-<id>.wandb) is a LevelDB-format log of wandb's protobuf records;
`_wandb_records` reads it with wandb's own protobuf types."""

import glob
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import TINY_MODEL, apply_flags

from configs import default
from gspo_jax.config import validate as config_lib

wandb = pytest.importorskip("wandb")


def _wandb_records(run_dir: str, timeout_s: float = 60.0) -> list:
    """The protobuf records of an offline run directory's run-<id>.wandb file, once its
    exit record is in: wandb's service process writes the file after `run.finish()` has
    returned, so a read right after it may find some records, or none, not yet there."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while True:
        with open(path, "rb") as f:
            records = _parse_records(f.read(), path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _parse_records(data: bytes, path: str) -> list:
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", path
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero fill to the end of the block
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history(records) -> dict[int, dict]:
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            rows.setdefault(row["_step"], {}).update(row)
    return rows


def _run_record(records):
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run, {i.key: json.loads(i.value_json) for i in run.config.update}


def _tiny_config(data_dir, **eval_fields):
    c = default.get_config()
    apply_flags(c, TINY_MODEL)
    c.num_steps, c.rollout_batch_size, c.num_return_sequences_in_group = 1, 4, 4
    c.warm_start.steps = 0  # one compile less: the evaluation's numbers need no skill
    c.num_mini_batches, c.reward.num_workers = 2, 0
    c.eval.num_prompts = c.eval.batch_size = 8
    c.eval.every_steps = 0  # step 0 and the end
    c.checkpoint.async_save = False
    c.checkpoint.export_hf = False
    c.log.tensorboard = c.log.plot = False
    c.data.data_dir = str(data_dir)
    for key, value in eval_fields.items():
        c.eval[key] = value
    return c


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline into tmp_path/wandb_dir: no network, no login, nothing in the repo."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path / "wandb_dir"


def test_tiny_run_logs_pass_at_k_maj_at_k_and_a_wandb_run(tmp_path, offline):
    from gspo_jax.trainer import loop, setup
    from gspo_jax.trainer.io import writers

    # 4 prompts x 4 samples at the rollout's temperature: the sampled evaluation's sampler
    # call is the rollout's (same shapes and options), so it compiles once for both.
    c = _tiny_config(tmp_path / "data", pass_k=4, temperature=1.0)
    c.eval.num_prompts = c.eval.batch_size = 4
    c.log.wandb_project, c.log.wandb_mode = "gspo-test", "offline"
    workdir = tmp_path / "tiny-run"
    trainer = setup.setup(c, str(workdir))
    try:
        with __import__("jax").set_mesh(trainer.mesh):
            loop.train(trainer, loop.init_or_restore(trainer))
            # The evaluation is deterministic and draws from its own stream: evaluating
            # the final checkpoint again gives the final row's values exactly.
            again = trainer.evaluator(loop.init_or_restore(trainer).train.params)
    finally:
        trainer.close()

    rows = {r["step"]: r for r in writers.read_metrics(str(workdir / "metrics.jsonl"))}
    keys = [f"eval/pass@{j}" for j in range(1, 5)]
    for step in (0, 1):
        row = rows[step]
        passes = [row[k] for k in keys]
        assert all(0 <= p <= 1 for p in passes), row
        assert passes == sorted(passes), row  # pass@j never decreases in j
        assert 0 <= row["eval/maj@4"] <= passes[-1]  # a right majority is a right sample
        assert row["eval/sampled_length_mean"] > 0 and row["eval/num_prompts"] == 4
    for key in [*keys, "eval/maj@4", "eval/accuracy", "eval/sampled_length_mean"]:
        assert again[key] == rows[1][key], key

    # The W&B run: named after the workdir, id kept in the workdir, the flat config, and
    # the rows of metrics.jsonl in its history.
    run_id = (workdir / "wandb_run_id").read_text().strip()
    (run_dir,) = glob.glob(str(offline / "wandb" / f"offline-run-*-{run_id}"))
    records = _wandb_records(run_dir)
    run, config = _run_record(records)
    assert (run.run_id, run.display_name, run.project) == (run_id, "tiny-run", "gspo-test")
    assert config["eval.pass_k"] == 4 and config["optim.learning_rate"] == 1e-4
    history = _history(records)
    assert sorted(history) == [0, 1]
    for step, row in rows.items():
        for key, value in row.items():
            if key != "step" and isinstance(value, float):
                np.testing.assert_allclose(history[step][key], value, rtol=1e-6, err_msg=key)
    summaries = [r.summary for r in records if r.WhichOneof("record_type") == "summary"]
    last = {}
    for s in summaries:
        last.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in s.update})
    assert last["eval/pass@4"] == rows[1]["eval/pass@4"]


def test_writer_resumes_the_workdirs_run_and_skips_rows_it_holds(tmp_path, offline):
    from gspo_jax.config.specs import WandbSpec
    from gspo_jax.trainer.io.wandb_writer import WandbWriter

    spec = WandbSpec(project="p", entity=None, mode="offline")
    (tmp_path / "w").mkdir()  # the workdir (setup makes it)
    first = WandbWriter(spec, str(tmp_path / "w"), {"a.b": 1})
    first.write(0, {"x": 1.0, "updates": np.arange(2), "label": "text"})
    first.write(1, {"x": 2.0})
    first.close()
    first.close()  # idempotent: the loop's end and Trainer.close both close
    # Each invocation writes its own offline directory, named to the second of its start.
    time.sleep(1.0)
    second = WandbWriter(spec, str(tmp_path / "w"), {"a.b": 1})
    assert second.id == first.id  # one workdir, one W&B run
    # An online W&B run resumed past step 1 takes no step before 2: those rows are not sent.
    second._min_step = 2
    second.write(1, {"x": -1.0})
    second.write(2, {"x": 3.0})
    second.preempting()
    second.close()
    run_dirs = sorted(glob.glob(str(offline / "wandb" / f"offline-run-*-{first.id}")))
    assert len(run_dirs) == 2, run_dirs
    merged = {}
    for run_dir in run_dirs:
        merged.update(_history(_wandb_records(run_dir)))
    assert {s: row["x"] for s, row in merged.items()} == {0: 1.0, 1: 2.0, 2: 3.0}
    assert "updates" not in merged[0] and "label" not in merged[0]  # scalars only


def test_bad_run_id_file_is_named(tmp_path):
    from gspo_jax.trainer.io import wandb_writer

    (tmp_path / "wandb_run_id").write_text("Not An Id!\n")
    with pytest.raises(ValueError, match="wandb_run_id holds 'Not An Id!'"):
        wandb_writer.run_id(str(tmp_path))


def _validate(c):
    config_lib.validate(c)


def test_config_errors_name_the_field(tmp_path, monkeypatch):
    c = _tiny_config(tmp_path)
    for field, value, match in [
        ("pass_k", -1, "config.eval.pass_k=-1 must be a non-negative integer"),
        ("pass_k", True, "config.eval.pass_k=True must be a non-negative integer"),
        ("temperature", 0.0, r"config.eval.temperature=0.0 must be a finite number > 0"),
        ("temperature", float("nan"), "config.eval.temperature=nan"),
    ]:
        bad = _tiny_config(tmp_path, **{field: value})
        with pytest.raises(config_lib.ConfigError, match=match):
            _validate(bad)
    c.eval.pass_k, c.reward.accuracy = 4, "format"
    with pytest.raises(config_lib.ConfigError, match="eval.pass_k=4 .*'format' has no"):
        _validate(c)
    c = _tiny_config(tmp_path)
    c.log.wandb_mode = "cloud"
    with pytest.raises(config_lib.ConfigError, match="config.log.wandb_mode='cloud'"):
        _validate(c)
    c.log.wandb_mode, c.log.wandb_project = "offline", " "
    with pytest.raises(config_lib.ConfigError, match="config.log.wandb_project=' '"):
        _validate(c)
    # wandb not installed: named at start-up, with the command that installs it.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    c.log.wandb_project = "p"
    with pytest.raises(config_lib.ConfigError, match="wandb is not installed: pip install wandb"):
        _validate(c)
    c.log.wandb_mode = "disabled"  # no writer, so no wandb needed
    _validate(c)


def test_the_trainer_does_not_import_wandb_without_a_project():
    code = (
        "import sys, gspo_jax.trainer.setup, gspo_jax.trainer.loop, gspo_jax.main; "
        "assert 'wandb' not in sys.modules, 'wandb imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
