"""Issue 42 (reliability, round three): data and workdirs that defeat their purpose — a
held-out split that repeats the training data, entries in a workdir's checkpoints directory
that the run did not write, a resume over changed data (docs/failures.md)."""

import logging
import types

import pytest

from configs import base, default
from gspo_jax.config.validate import ConfigWarning, validate
from gspo_jax.trainer import loop
from gspo_jax.trainer.io import checkpoint

LINES = [f'{{"question": "q{i}", "answer": "#### {i}"}}' for i in range(20)]


def _gsm8k(tmp_path, train, test):
    (tmp_path / "train.jsonl").write_text("\n".join(train) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(test) + "\n")
    c = base.get_config()
    c.data.name, c.data.config_name, c.data.manual_dir = "gsm8k", "", str(tmp_path)
    return c


def test_a_held_out_file_that_repeats_the_training_file_warns_with_the_fraction(tmp_path):
    c = _gsm8k(tmp_path, LINES, LINES[:10])  # a copy of part of train
    with pytest.warns(ConfigWarning, match=r"100% of the held-out examples in .*test.jsonl"):
        validate(c)
    c = _gsm8k(tmp_path, LINES, LINES[:5] + [x.replace("q", "p") for x in LINES[5:10]])
    with pytest.warns(ConfigWarning, match=r"50% of the held-out examples"):
        validate(c)


def test_overlapping_bounded_slices_of_one_split_warn_with_the_fraction():
    c = default.get_config()
    c.data.train_split, c.data.eval_split = "train[0:600]", "train[500:700]"
    with pytest.warns(ConfigWarning, match=r"share 50% of the held-out examples"):
        validate(c)


def test_entries_the_run_did_not_write_are_ignored_with_a_warning(tmp_path, caplog):
    # A file named 9 and an empty folder 999 counted as steps reached: a resume with the
    # run's own num_steps was refused ("below the 999 RL steps this workdir's run reached").
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "9").write_text("notes")
    (tmp_path / "999").mkdir()
    (tmp_path / "backup").mkdir()
    (tmp_path / "2.corrupt").mkdir()  # ours: a damaged checkpoint moved aside
    with caplog.at_level(logging.WARNING):
        assert checkpoint.existing_steps(str(tmp_path)) == [3]
    (record,) = [r.getMessage() for r in caplog.records if "did not write" in r.getMessage()]
    assert "9, 999, backup" in record and "2.corrupt" not in record


IDENTITY = {"kind": "prompts", "fingerprint": "new", "batch_size": 8, "seed": 0}


def test_a_resume_over_changed_data_names_the_data_fields():
    class Iterator:
        _identity = IDENTITY

        def set_state(self, state):
            raise ValueError("Iterator state is from a different data pipeline (fingerprint)")

    trainer = types.SimpleNamespace(train_iter=Iterator())
    saved = {"pipeline": dict(IDENTITY, fingerprint="old")}
    restored = types.SimpleNamespace(data=saved, origin="checkpoint 4 in /w/checkpoints")
    with pytest.raises(ValueError, match=r"checkpoint 4 .*other data.*data.manual_dir") as e:
        loop._resume_data(trainer, restored)
    assert "new --workdir" in str(e.value)
