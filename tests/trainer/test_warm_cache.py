"""The warm start's cache (trainer/warm_cache.py): the key changes with what determines the
warm start and with nothing else; a run with the same key reuses the weights bit for bit
and says so; a changed key or a damaged entry trains anew."""

import json
import logging
import os

import jax
import numpy as np
import pytest
from helpers import tiny_config

from gspo_jax.trainer import loop, setup, warm_cache
from gspo_jax.trainer import warm_start as warm_start_lib
from gspo_jax.trainer.io import workdir as workdir_lib


def _key(c, identity=None):
    return warm_cache.digest(warm_cache.key_of(c, workdir_lib.flat_config(c), None, identity))


@pytest.mark.parametrize(
    ("field", "value", "same"),
    [
        ("clip_high", 0.3, True),  # the algorithm: shared across GSPO and GRPO
        ("num_steps", 9, True),
        ("data.data_dir", "/elsewhere", True),
        ("warm_start.cache_dir", "/elsewhere", True),
        ("data.train_path", "/a/copy/of/train.jsonl", True),  # the contents are the key
        ("seed", 7, False),
        ("warm_start.learning_rate", 5e-4, False),
        ("warm_start.steps", 4, False),
        ("model.hidden_size", 64, False),
        ("data.config_name", "add3", False),
        ("data.instruction", "Think.", False),
        ("data.chat_template", "none", False),
        ("prompt_length", 99, False),
    ],
)
def test_the_key_is_what_determines_the_warm_start(tmp_path, field, value, same):
    c = tiny_config(tmp_path)
    before = _key(c)
    node, _, name = field.rpartition(".")
    setattr(c if not node else getattr(c, node), name, value)
    assert (_key(c) == before) is same


def test_the_files_contents_are_in_the_key(tmp_path):
    c = tiny_config(tmp_path)
    assert _key(c, "files_0123") != _key(c, "files_4567")


def _run(tmp_path, name, **changes):
    c = tiny_config(tmp_path / "data")
    c.warm_start.cache_dir = str(tmp_path / "cache")
    for field, value in changes.items():
        node, _, leaf = field.rpartition("__")
        setattr(getattr(c, node) if node else c, leaf, value)
    trainer = setup.setup(c, str(tmp_path / name))
    try:
        with jax.set_mesh(trainer.mesh):
            state = loop.init_or_restore(trainer)
        return jax.device_get(state.train.params), state.origin, trainer.warm_cache
    finally:
        trainer.close()


def test_a_second_run_reuses_the_warm_start_and_a_changed_key_trains_anew(
    tmp_path, monkeypatch, caplog
):
    trained = []
    real = warm_start_lib.warm_start

    def counting(*args, **kwargs):
        trained.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(warm_start_lib, "warm_start", counting)
    first, origin, entry = _run(tmp_path, "gspo")
    assert trained == [1] and "(cached" not in origin
    with open(os.path.join(entry.path, "key.json")) as f:
        assert json.load(f) == entry.key
    assert not [p for p in os.listdir(tmp_path / "cache") if ".tmp-" in p]

    with caplog.at_level(logging.INFO, logger="gspo_jax.trainer.warm_cache"):
        second, origin, _ = _run(tmp_path, "grpo", clip_high=0.28, clip_low=0.2)
    assert trained == [1], "the same key trained again"
    assert f"(cached: {entry.path})" in origin and "3 supervised warm-start steps" in origin
    assert any("warm start: reused" in r.getMessage() for r in caplog.records)
    jax.tree.map(np.testing.assert_array_equal, first, second)

    changed, _, other = _run(tmp_path, "lr", warm_start__learning_rate=3e-3)
    assert trained == [1, 1] and other.path != entry.path
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, first, changed)))


def test_a_damaged_entry_is_trained_anew_with_a_warning(tmp_path, caplog):
    _, _, entry = _run(tmp_path, "first")
    params_dir = os.path.join(entry.path, "params")
    for folder, _, names in os.walk(params_dir):
        for name in names:
            os.truncate(os.path.join(folder, name), 0)
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.warm_cache"):
        _, origin, _ = _run(tmp_path, "second")
    assert "(cached" not in origin
    assert any("cannot be read" in r.getMessage() for r in caplog.records)


def test_off_means_off(tmp_path):
    _, _, entry = _run(tmp_path, "off", warm_start__cache=False)
    assert entry is None and not os.path.exists(tmp_path / "cache")
