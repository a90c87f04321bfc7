"""What a run leaves behind (docs/failures.md): a run that trains nothing fails before any
export, a learning rate that rewrites the model warns, summary.json survives re-runs, and a
finished run is never shortened. In-process runs of tests/e2e/test_train.py's tiny config."""

import json
import logging
import os

import pytest
from helpers import tiny_config

from gspo_jax.trainer import loop
from gspo_jax.trainer.io.workdir import WorkdirError


def _quiet(config, num_steps):
    c = config
    c.num_steps = num_steps
    c.eval.every_steps = 0  # only at the start and the end
    c.checkpoint.every_steps = 0
    c.checkpoint.async_save = False
    c.reward.num_workers = 0
    c.log.tensorboard = c.log.plot = False
    return c


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def test_a_run_whose_every_update_is_skipped_fails_before_the_export(data_dir, tmp_path):
    """Before: a warning per step, exit 0, the untrained policy exported, summary.json
    silent. Now: max_all_skipped_steps RL steps in a row with every update skipped stop
    the run (exit 1 from the entry point) with the count and the held-out accuracy on
    record, and nothing exported."""
    c = _quiet(tiny_config(data_dir), num_steps=6)
    c.use_kl_loss, c.kl_loss_coef = True, 1e30  # every gradient overflows to inf
    c.max_all_skipped_steps = 2
    workdir = tmp_path / "run"
    with pytest.raises(loop.NothingTrainedError, match=r"last 2 RL steps \(up to step 2\)"):
        loop.run(c, str(workdir))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["skipped_updates"] == 2 * c.num_mini_batches
    assert "every optimizer update of the last 2 RL steps" in summary["error"]
    assert 0 <= summary["eval_start"] <= 1
    assert not (workdir / "hf").exists()


def test_a_huge_update_warns_and_the_record_survives_re_runs(data_dir, tmp_path, caplog):
    """optim.learning_rate=1e3 (for 1e-3) used to pass without a word. A re-run of the
    finished workdir rewrote summary.json without eval_start / eval_end; a restart with a
    smaller num_steps did the same and exported the later model as the final one."""
    c = _quiet(tiny_config(data_dir), num_steps=2)
    c.optim.learning_rate = 1e3
    # The 3-step warm start scores 0 everywhere (advantages 0): the entropy term gives the
    # updates a gradient.
    c.entropy_coef = 1e-3
    workdir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.loop"):
        first = loop.run(c, str(workdir))
    warned = [r.getMessage() for r in caplog.records if "policy/update_ratio" in r.getMessage()]
    assert len(warned) == 1 and "optim.learning_rate" in warned[0], warned
    assert first["skipped_updates"] == 0 and "eval_start" in first and "eval_end" in first
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["policy/update_ratio"] for r in rows if "policy/update_ratio" in r]
    assert len(ratios) == 2 and max(ratios) > loop.UPDATE_RATIO_WARN, ratios

    again = loop.run(c, str(workdir))  # finished: finishes again at once
    assert again["start_step"] == 2 and "eval_start" not in again
    summary = json.loads((workdir / "summary.json").read_text())
    for key in ("eval_start", "eval_end", "eval_end_step", "skipped_updates", "export"):
        assert summary[key] == first[key], key
    assert summary["start_step"] == 2

    exported = {f: os.path.getmtime(workdir / "hf" / f) for f in os.listdir(workdir / "hf")}
    c.num_steps = 1
    with pytest.raises(WorkdirError, match=r"config.num_steps=1 is below the 2 RL steps"):
        loop.run(c, str(workdir))
    assert {f: os.path.getmtime(workdir / "hf" / f) for f in os.listdir(workdir / "hf")} == (
        exported
    )
    assert json.loads((workdir / "summary.json").read_text()) == summary
    assert not (workdir / "config_changes.jsonl").exists()  # the refusal recorded nothing
