"""data.name="jsonl": your own prompt files through the real TFDS path, errors by file:line."""

import json

import pytest

import gspo_jax.data.jsonl  # noqa: F401 (data.jsonl.read_examples)
from configs import default
from gspo_jax import data
from gspo_jax.config.validate import ConfigError, validate


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_custom_keys_become_question_and_answer_records(tmp_path):
    train = _write(
        tmp_path / "train.jsonl",
        [{"q": f"What is {i} + 1?", "sol": i + 1} for i in range(5)] + [""],
    )
    test = _write(tmp_path / "test.jsonl", [{"q": "What is 9 + 1?", "sol": "10", "extra": [1]}])
    config = data.jsonl_config(train, test, "q", "sol")
    sources = data.build_dataset("jsonl", config, data_dir=tmp_path / "tfds")
    assert len(sources["train"]) == 5 and len(sources["test"]) == 1
    records = [data.decode_record(sources["train"][i]) for i in range(5)]
    assert sorted(int(r["answer"]) for r in records) == [1, 2, 3, 4, 5]
    assert {r["question"] for r in records} == {f"What is {i} + 1?" for i in range(5)}
    assert data.decode_record(sources["test"][0])["answer"] == "10"


def test_an_edited_file_is_prepared_again(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}])
    test = _write(tmp_path / "test.jsonl", [{"prompt": "b", "answer": "2"}])
    first = data.jsonl_config(train, test).name
    _write(
        tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "c", "answer": "3"}]
    )
    assert data.jsonl_config(train, test).name != first
    assert data.jsonl_config(train, test, "question").name != data.jsonl_config(train, test).name


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (
            '{"prompt": "x"}',
            r"train.jsonl:2: no key 'answer' \(data.answer_key\); the line has \['prompt'\]",
        ),
        ("[1, 2]", r"train.jsonl:2: a line must be a JSON object, got list"),
        ("null", r"train.jsonl:2: a line must be a JSON object, got NoneType"),
        ("{bad json", r"train.jsonl:2: invalid JSON"),
        ('{"prompt": "", "answer": "1"}', r"train.jsonl:2: 'prompt' must be non-empty text"),
        ('{"prompt": "x", "answer": null}', r"train.jsonl:2: 'answer' must be a JSON scalar"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, error):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=error):
        data.jsonl.read_examples(str(path), "train", "prompt", "answer")


def test_undecodable_bytes_and_empty_files_are_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:1: not UTF-8"):
        data.jsonl.read_examples(str(path), "train", "prompt", "answer")
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"train.jsonl: no example"):
        data.jsonl.read_examples(str(path), "train", "prompt", "answer")


def test_validation_names_the_missing_field_or_file(tmp_path):
    c = default.get_config()
    c.data.name, c.data.config_name = "jsonl", ""
    with pytest.raises(ConfigError, match=r'config.data.name="jsonl" needs config.data.train_path'):
        validate(c)
    c.data.train_path, c.data.test_path = str(tmp_path / "nope.jsonl"), str(tmp_path / "t.jsonl")
    with pytest.raises(ConfigError, match=r"config.data.train_path=.*nope.jsonl.*: no such file"):
        validate(c)
