"""Issue 42 (reliability, round three): numbers read from a checkpoint are range-checked
like config fields, and every error about a file names the file (and the line)
(docs/failures.md)."""

import json
import shutil
import warnings

import pytest

from configs import base, default
from gspo_jax import data, jsonio, models
from gspo_jax.config.validate import (
    ConfigError,
    ConfigWarning,
    check_model_against_tokenizer,
    validate,
)
from gspo_jax.data import gsm8k
from gspo_jax.trainer.io import workdir as workdir_lib
from gspo_jax.trainer.io import writers

QWEN3 = "tests/fixtures/models/qwen3"

# ----------------------------------------------- 1. a checkpoint's numbers are range-checked


def _checkpoint(tmp_path, **changes):
    path = tmp_path / "ckpt"
    shutil.copytree(QWEN3, path)
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    (path / "config.json").write_text(json.dumps(hf))
    return path


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        # "false" is true in Python: the untied head was dropped silently.
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
        ({"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}, "rope_theta=-1.0"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be a finite number > 0"),
        (
            {"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 0.0}},
            "factor=0.0 must be a finite number > 0",
        ),
        ({"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of"),
        ({"head_dim": None, "hidden_size": 30}, "hidden_size=30 does not split"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers='2' must be an integer"),
        ({"intermediate_size": 64.5}, "intermediate_size=64.5 must be an integer"),
        ({"eos_token_id": 999}, r"eos_token_id=999 is outside the vocabulary \[0, 256\)"),
        ({"pad_token_id": -1}, "pad_token_id=-1 must be a token id"),
    ],
)
def test_a_checkpoint_config_number_out_of_range_names_the_file_and_key(tmp_path, changes, says):
    path = _checkpoint(tmp_path, **changes)
    with pytest.raises(ValueError, match=says) as raised:
        models.load_pretrained(path)
    assert str(path / "config.json") in str(raised.value)


def test_a_moe_checkpoint_whose_layers_hold_no_experts_is_named(tmp_path):
    path = tmp_path / "moe"
    shutil.copytree("tests/fixtures/models/qwen3_moe", path)
    hf = json.loads((path / "config.json").read_text())
    for changes, says in (
        ({"decoder_sparse_step": hf["num_hidden_layers"] + 1}, "decoder_sparse_step=.* exceeds"),
        ({"mlp_only_layers": [hf["num_hidden_layers"]]}, "mlp_only_layers lists layer"),
    ):
        (path / "config.json").write_text(json.dumps(hf | changes))
        with pytest.raises(ValueError, match=says) as raised:
            models.load_pretrained(path)
        assert str(path / "config.json") in str(raised.value)


def test_a_generation_config_id_outside_the_vocabulary_or_disagreeing_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    c = base.get_config()
    c.model.hf_path = str(path)
    c.prompt_length = c.response_length = 64
    tokenizer = data.load_tokenizer("tests/fixtures/models/tokenizer")  # stops at ids 0 and 2
    cfg = models.read_model_config(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 500}))
    with pytest.raises(ConfigError, match=r"generation_config.json.*eos_token_id=500"):
        check_model_against_tokenizer(c, cfg, tokenizer)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    with pytest.warns(
        ConfigWarning, match=r"generation_config.json names .*\[7\].*stops at \[0, 2\]"
    ):
        check_model_against_tokenizer(c, cfg, tokenizer)


def test_config_fields_narrower_than_their_type():
    c = default.get_config()
    c.sampling.temperature = 1e-30  # logits / T overflows float32
    with pytest.raises(ConfigError, match=r"config.sampling.temperature=1e-30 is below the floor"):
        validate(c)
    c = default.get_config()
    c.eval.num_samples, c.eval.temperature = 4, 1e-5
    with pytest.raises(ConfigError, match=r"config.eval.temperature=1e-05 is below the floor"):
        validate(c)
    c = default.get_config()
    c.model.lora_rank = 100  # above the scratch model's hidden size (64)
    with pytest.warns(ConfigWarning, match=r"lora_rank=100 exceeds the smaller dimension"):
        validate(c)


# ------------------------------------------------------ 2. every file error names the file


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"null", "holds null, not an object"),
        (b"[1, 2]", "holds a list, not an object"),
        (b'{"question": "q", "answer": "\xff\xfe #### 1"}', "not UTF-8"),
        (b'{"question": "q", "answer": "#### ' + b"1" * 300 + b'"}', "300 characters long"),
    ],
)
def test_a_bad_gsm8k_line_names_the_file_and_line(tmp_path, line, says):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n\n' + line + b"\n")
    with pytest.raises(ValueError, match=says) as raised:
        gsm8k.read_gsm8k_jsonl(path, "train")
    assert f"{path}:3" in str(raised.value)


def test_a_config_json_that_is_not_an_object_names_the_file(tmp_path):
    path = _checkpoint(tmp_path)
    (path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config.json holds a list, not an object"):
        models.load_pretrained(path)


def test_a_truncated_tokenizer_json_names_the_file(tmp_path):
    path = tmp_path / "tok"
    shutil.copytree("tests/fixtures/models/tokenizer", path)
    text = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"tokenizer.json.*not valid JSON \(truncated\?\)") as e:
        data.load_tokenizer(path)
    assert str(path / "tokenizer.json") in str(e.value)


def _workdir(tmp_path):
    c = default.get_config()
    workdir = tmp_path / "run"
    workdir.mkdir()
    workdir_lib.record_config(c, str(workdir), resuming=False, allow_change=False)
    return c, workdir


def test_a_torn_workdir_config_record_is_named(tmp_path):
    c, workdir = _workdir(tmp_path)
    text = (workdir / "config.json").read_text()
    (workdir / "config.json").write_text(text[:100])
    with pytest.raises(workdir_lib.WorkdirError, match="config.json.*not valid JSON") as e:
        workdir_lib.record_config(c, str(workdir), resuming=True, allow_change=False)
    assert "restore it, or delete" in str(e.value)


def test_a_torn_last_config_change_is_skipped_with_a_warning(tmp_path, caplog):
    c, workdir = _workdir(tmp_path)
    c.log.plot = not c.log.plot  # a free change: recorded in config_changes.jsonl
    workdir_lib.record_config(c, str(workdir), resuming=True, allow_change=False)
    changes = workdir / workdir_lib.CHANGES_FILE
    changes.write_text(changes.read_text() + '{"time": "2026-', encoding="utf-8")
    assert workdir_lib.config_differences(c, str(workdir)) == ({}, {})
    assert "skipping a torn last line" in caplog.text and str(changes) in caplog.text
    # The next accepted change replaces the torn row instead of gluing onto it.
    c.log.plot = not c.log.plot
    workdir_lib.record_config(c, str(workdir), resuming=True, allow_change=False)
    rows = jsonio.read_jsonl(changes)
    assert len(rows) == 2 and rows[-1][1]["config"]["log"]["plot"] == c.log.plot


def test_a_torn_metrics_row_is_skipped_and_a_bad_one_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    assert writers.read_metrics(str(path)) == [{"step": 0, "a": 1}]
    path.write_text('{"step": 0, "a": 1}\nnull\n')
    with pytest.raises(ValueError, match=f"{path}:2: .*holds null"):
        writers.read_metrics(str(path))


def test_damaged_prepared_tfds_files_are_named_with_how_to_rebuild(tmp_path):
    from gspo_jax.data import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build.build_dataset("arithmetic", "add2", data_dir=tmp_path)
        (record,) = tmp_path.glob("synthetic_arithmetic/add2/*/*-test.array_record-*")
        record.write_bytes(record.read_bytes()[:1000])
        with pytest.raises(ValueError, match=r"cannot be read .* Delete .* prepare it anew"):
            build.build_dataset("arithmetic", "add2", data_dir=tmp_path)
