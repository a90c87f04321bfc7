"""The workdir's checks and record: config.json is the run's config; a restart with another
config stops with every difference named (or records it); the directory must be writable."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest
from helpers import tiny_config

from configs import default
from gspo_jax.trainer.io import workdir
from gspo_jax.trainer.io.workdir import CHANGES_FILE, CONFIG_FILE, WorkdirError


def _record(config, path, **kwargs):
    kwargs = {"resuming": True, "allow_change": False} | kwargs
    return workdir.record_config(config, str(path), **kwargs)


def test_a_fresh_run_writes_its_config_once(tmp_path):
    c = default.get_config()
    assert _record(c, tmp_path, resuming=False) == {}
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert saved["importance_sampling"] == "seq" and saved["optim"]["learning_rate"] == 1e-4
    assert _record(c, tmp_path) == {}  # the same config resumes without a word


def test_a_config_that_changes_the_run_stops_the_restart_naming_each_difference(tmp_path):
    """Before: the old run resumed, trained nothing, and config.json was overwritten with the
    new config (the record said GRPO for a GSPO checkpoint)."""
    c = default.get_config()
    _record(c, tmp_path, resuming=False)
    before = (tmp_path / CONFIG_FILE).read_text()
    grpo = default.get_config()
    grpo.importance_sampling = "token"
    grpo.model.hidden_size = 128
    with pytest.raises(WorkdirError) as err:
        _record(grpo, tmp_path)
    message = str(err.value)
    assert "importance_sampling: 'seq' -> 'token'" in message
    assert "model.hidden_size: 64 -> 128" in message and "--allow_config_change" in message
    assert (tmp_path / CONFIG_FILE).read_text() == before  # the record is untouched
    assert not (tmp_path / CHANGES_FILE).exists()


def test_free_fields_may_change_and_are_recorded(tmp_path, caplog):
    c = default.get_config()
    _record(c, tmp_path, resuming=False)
    longer = default.get_config()
    longer.num_steps = 500
    longer.eval.every_steps = 5
    longer.checkpoint.every_steps = 7
    longer.log.progress_bar = False
    longer.mesh.data, longer.mesh.fsdp = 1, -1
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.io.workdir"):
        diffs = _record(longer, tmp_path)
    assert diffs["num_steps"] == (250, 500) and diffs["mesh.fsdp"] == (1, -1)
    assert any("num_steps: 250 -> 500 on resume (free)" in r.getMessage() for r in caplog.records)
    row = json.loads((tmp_path / CHANGES_FILE).read_text())
    assert row["run_changing"] == [] and row["changes"]["eval.every_steps"] == [25, 5]
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["num_steps"] == 250  # the original


def test_num_steps_changes_a_cosine_schedule(tmp_path):
    c = default.get_config()
    c.optim.schedule = "cosine"
    _record(c, tmp_path, resuming=False)
    c.num_steps = 500
    with pytest.raises(WorkdirError, match=r"num_steps: 250 -> 500"):
        _record(c, tmp_path)


def test_allow_change_records_it_and_the_next_restart_compares_with_it(tmp_path):
    c = default.get_config()
    _record(c, tmp_path, resuming=False)
    grpo = default.get_config()
    grpo.importance_sampling, grpo.clip_low, grpo.clip_high = "token", 0.2, 0.27
    diffs = _record(grpo, tmp_path, allow_change=True)
    assert set(diffs) == {"importance_sampling", "clip_low", "clip_high"}
    row = json.loads((tmp_path / CHANGES_FILE).read_text())
    assert row["run_changing"] == ["clip_high", "clip_low", "importance_sampling"]
    assert _record(grpo, tmp_path) == {}  # the accepted config is the run's now
    with pytest.raises(WorkdirError, match=r"importance_sampling: 'token' -> 'seq'"):
        _record(c, tmp_path)


def test_a_field_added_to_gspo_jax_since_the_run_started_does_not_strand_it(tmp_path, caplog):
    """A run started before model.attention_impl existed: its config.json lacks the field.
    Config files cannot add fields, so the difference is an upgrade of the code: logged and
    recorded, not refused (it used to stop every run in progress). The kernel choice itself
    is free, as remat and moe_impl are: the same math."""
    c = default.get_config()
    _record(c, tmp_path, resuming=False)
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    del saved["model"]["attention_impl"], saved["reward"]["max_failed_rollouts"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.io.workdir"):
        diffs = _record(c, tmp_path)
    assert diffs == {
        "model.attention_impl": ("<absent>", "auto"),
        "reward.max_failed_rollouts": ("<absent>", 3),
    }
    assert any(
        "model.attention_impl: '<absent>' -> 'auto'" in r.getMessage() for r in caplog.records
    )
    assert _record(c, tmp_path) == {}  # recorded: the next restart compares with it
    c.model.attention_impl = "xla"
    assert _record(c, tmp_path) == {"model.attention_impl": ("auto", "xla")}
    c.importance_sampling = "token"  # still refused, whatever else changed
    with pytest.raises(WorkdirError, match=r"1 field\(s\) that change the run differ"):
        _record(c, tmp_path)


def test_reward_norm_spellings_are_one_value(tmp_path):
    c = default.get_config()
    _record(c, tmp_path, resuming=False)
    c.reward_norm = "none"
    assert _record(c, tmp_path) == {}


def test_packing_none_is_the_bool_it_resolves_to(tmp_path):
    """A run made when packing defaulted to False (response_length 16) is the same run under
    the default None, which is off below PACKING_MIN_RESPONSE_LENGTH; at 64 tokens None is on."""
    c = default.get_config()
    c.response_length = 16
    c.packing = False
    _record(c, tmp_path, resuming=False)
    c.packing = None
    assert _record(c, tmp_path) == {}
    c.packing = True  # turning it on changes the run
    with pytest.raises(WorkdirError, match="packing"):
        _record(c, tmp_path)
    c.packing, c.response_length = None, 64
    other = tmp_path / "long"
    other.mkdir()
    _record(c, other, resuming=False)
    c.packing = False
    with pytest.raises(WorkdirError, match="packing"):
        _record(c, other)
    c.packing = True
    assert _record(c, other) == {}


def test_a_workdir_or_checkpoint_directory_that_is_a_file_is_named(tmp_path):
    """Before: "[Errno 17] File exists" for a workdir that is a file, and a five-minute hang
    (a checkpoint directory that cannot be written)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(WorkdirError, match=rf"--workdir {afile} is a file, not a directory"):
        workdir.prepare(str(afile), str(afile / "checkpoints"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")
    with pytest.raises(WorkdirError, match=r"checkpoint directory .*/checkpoints is a file"):
        workdir.prepare(str(run), str(run / "checkpoints"))
    fresh = tmp_path / "fresh"
    workdir.prepare(str(fresh), str(fresh / "checkpoints"))
    assert (fresh / "checkpoints").is_dir() and not list((fresh / "checkpoints").iterdir())


# ---------------------------------------------------------------------------- run lock


def test_a_second_run_on_a_held_workdir_fails_naming_the_holder(tmp_path):
    """Two runs on one workdir used to both exit 0, every metrics row written twice, the
    same checkpoints and hf/ overwritten by both. The lock is an flock: a second holder is
    refused even inside one process, and the message names the first (pid, host, start)."""
    first = workdir.lock(str(tmp_path))
    try:
        holder = json.loads((tmp_path / workdir.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(WorkdirError) as refused:
            workdir.lock(str(tmp_path))
        want = (
            f"--workdir {tmp_path} is in use by another run: pid {os.getpid()} on host "
            f"{socket.gethostname()}, started {holder['started']}"
        )
        assert str(refused.value).startswith(want), str(refused.value)
    finally:
        first.release()
    assert (tmp_path / workdir.LOCK_FILE).read_text() == ""  # released: no holder recorded
    workdir.lock(str(tmp_path)).release()  # free again


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    """A run killed with kill -9 cannot release its lock: the kernel drops the flock, the
    record stays; the next run takes the lock and says whose it was."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    record = {"pid": pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00"}
    (tmp_path / workdir.LOCK_FILE).write_text(json.dumps(record) + "\n")
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.io.workdir"):
        taken = workdir.lock(str(tmp_path))
    try:
        warned = " ".join(r.getMessage() for r in caplog.records)
        assert "taking over the lock of a run that ended without releasing it" in warned
        assert f"pid {pid} on host {socket.gethostname()}" in warned
        assert "no longer running" in warned
        assert json.loads((tmp_path / workdir.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        taken.release()


def test_the_lock_is_released_when_setup_fails_after_taking_it(tmp_path, monkeypatch, caplog):
    """Every exit path releases the lock: here an error in `setup` after the lock (the
    tokenizer); a failed start must not leave the workdir looking held."""

    from gspo_jax.trainer import setup

    def broken(*args):
        raise RuntimeError("the tokenizer cannot be built")

    monkeypatch.setattr(setup, "_tokenizer", broken)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the tokenizer cannot be built"):
        setup.setup(tiny_config(tmp_path / "data"), str(run))
    assert (run / workdir.LOCK_FILE).read_text() == ""
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.io.workdir"):
        workdir.lock(str(run)).release()
    assert "taking over" not in caplog.text
