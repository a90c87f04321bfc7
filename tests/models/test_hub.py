"""Checkpoints by name: a Hub id resolved through a Hugging Face cache laid out locally
(models--org--name/refs/main + snapshots/<commit>/), never the network."""

import shutil
from pathlib import Path

import pytest

from configs import default
from gspo_jax import models
from gspo_jax.config.validate import ConfigError, validate
from gspo_jax.models import hub

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "default_warm_start"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_cache(root: Path, repo_id: str = "gspo-test/tiny", source: Path = FIXTURE) -> Path:
    """A Hugging Face hub cache holding one snapshot of `repo_id` (the files of `source`)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo / "snapshots" / COMMIT)
    return root


def test_a_hub_id_in_the_cache_resolves_to_its_snapshot_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(make_cache(tmp_path / "cache")))
    path = hub.resolve("gspo-test/tiny")
    assert Path(path) == tmp_path / "cache/models--gspo-test--tiny/snapshots" / COMMIT
    cfg, _ = models.load_pretrained(path)
    assert cfg.vocab_size == models.load_pretrained(str(FIXTURE))[0].vocab_size
    assert hub.resolve(str(FIXTURE)) == str(FIXTURE)  # a directory is itself


def test_a_config_names_the_checkpoint_by_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(make_cache(tmp_path / "cache")))
    c = default.get_config()
    c.model.hf_path, c.warm_start.steps = "gspo-test/tiny", 0
    validate(c)


def test_an_id_missing_from_the_cache_names_the_id_the_cache_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    c = default.get_config()
    c.model.hf_path = "Qwen/Qwen3-0.6B"
    with pytest.raises(
        ConfigError,
        match=r"config.model.hf_path: 'Qwen/Qwen3-0.6B' is not a local "
        r"directory, and the Hugging Face cache \(.*empty\) holds no snapshot of "
        r"it; fetch it with `huggingface-cli download Qwen/Qwen3-0.6B`",
    ):
        validate(c)


def test_what_counts_as_an_id():
    assert hub.is_hub_id("Qwen/Qwen3-0.6B") and hub.is_hub_id("org/name@v1.0")
    assert not hub.is_hub_id("tests/fixtures/models/qwen3")  # an existing path
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("a/b/c")
