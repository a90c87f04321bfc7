"""Your own prompts: files per split, as a TFDS builder (array_record, nothing downloaded),
selected with `data.name="jsonl"`, `"parquet"` or `"hf"`.

    --config.data.name=jsonl --config.data.train_path=train.jsonl \
        --config.data.test_path=test.jsonl [--config.data.prompt_key=prompt] \
        [--config.data.answer_key=answer]

`"jsonl"`: one JSON object per line; `"parquet"`: a Parquet file per split (read with
pyarrow); `"hf"`: a Hugging Face dataset (`data.hf_path`: a `save_to_disk` directory, a
directory of Parquet files, or a Hub id in the Hugging Face cache; data/tables.py). In every
row `prompt_key` is the question the policy is asked (the chat template and
`data.instruction` wrap it as for the built-in tasks), `answer_key` the reference the reward
compares with (any scalar, kept as its text). Blank JSONL lines are skipped; every other
problem (not an object, a missing or non-text key, bad JSON or bytes) is an error naming the
file and the line (the row, for tables).

Records: `id` ("train-00042"), `question`, `answer`, and `example`: the whole row as JSON
text (values JSON cannot hold, such as dates or bytes, as their text), which a reward asking
for it gets as a dict (rewards/registry.py). The prepared copy lives under
`data_dir/jsonl_local/<config>/`, the config's name a digest of the files' contents and the
keys: an edited file is prepared anew, never read stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from typing import ClassVar

import tensorflow_datasets as tfds

from gspo_jax.data import tables
from gspo_jax.data.local_builder import LocalBuilder


@dataclasses.dataclass(eq=False)
class JsonlConfig(tfds.core.BuilderConfig):
    """The files of each split and the keys of one dataset of your own."""

    split_files: tuple[tuple[str, tuple[str, ...]], ...] = ()
    prompt_key: str = "prompt"
    answer_key: str = "answer"


def _digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def files_config(split_files: dict[str, list[str]], prompt_key: str, answer_key: str):
    """The builder config of these files per split and keys, named by a digest of their
    contents (and the keys)."""
    resolved = []
    for split, paths in split_files.items():
        paths = tuple(os.path.abspath(os.fspath(p)) for p in paths)
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: no such file")
        resolved.append((split, paths))
    digests = [[s, [_digest(p) for p in ps]] for s, ps in resolved]
    key = json.dumps([digests, prompt_key, answer_key])
    name = "files_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    described = "; ".join(f"{s}: {', '.join(ps)}" for s, ps in resolved)
    return JsonlConfig(
        name=name,
        description=f"{described}; keys {prompt_key!r} / {answer_key!r}",
        split_files=tuple(resolved),
        prompt_key=prompt_key,
        answer_key=answer_key,
    )


def jsonl_config(train_path, test_path, prompt_key="prompt", answer_key="answer") -> JsonlConfig:
    """The builder config of a train and a test file (JSONL, or Parquet by its extension)."""
    return files_config({"train": [train_path], "test": [test_path]}, prompt_key, answer_key)


def hf_config(path: str, prompt_key="prompt", answer_key="answer", *, download=False):
    """The builder config of a Hugging Face dataset (`tables.hf_split_files`)."""
    return files_config(tables.hf_split_files(path, download=download), prompt_key, answer_key)


def _jsonl_rows(path: str) -> Iterable[tuple[str, object]]:
    """(where, parsed line) of each non-blank line; bytes and JSON errors name the line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from None


def rows_of(path: str) -> Iterable[tuple[str, object]]:
    """(where, row) of a JSONL, Parquet or Arrow (`datasets` cache) file."""
    if path.endswith((".parquet", ".arrow")):
        return tables.table_rows(path)
    return _jsonl_rows(path)


def make_record(obj, where: str, example_id: str, prompt_key: str, answer_key: str) -> dict:
    """The record of one row (`where` names its file and line or row in errors)."""
    if not isinstance(obj, dict):
        raise ValueError(  # noqa: TRY004 (a bad file, not a bad argument)
            f"{where}: a line must be a JSON object, got {type(obj).__name__}"
        )
    for key, field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in obj:
            raise ValueError(f"{where}: no key {key!r} ({field}); the line has {sorted(obj)}")
    prompt, answer = obj[prompt_key], obj[answer_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: {prompt_key!r} must be non-empty text, got {prompt!r}")
    if isinstance(answer, (dict, list, tuple)) or answer is None:
        raise ValueError(f"{where}: {answer_key!r} must be a JSON scalar, got {answer!r}")
    answer = answer if isinstance(answer, str) else json.dumps(answer, default=str)
    example = json.dumps(obj, ensure_ascii=False, default=str)
    return {"id": example_id, "question": prompt, "answer": answer, "example": example}


def read_examples(path: str, split: str, prompt_key: str, answer_key: str, start=0) -> list:
    """The records of one file (ids from `start`); every error names the file and line."""
    records = []
    for where, obj in rows_of(path):
        example_id = f"{split}-{start + len(records):05d}"
        records.append(make_record(obj, where, example_id, prompt_key, answer_key))
    if not records:
        raise ValueError(f"{path}: no example (an empty file, or only blank lines)")
    return records


class JsonlLocal(LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """Prompts and answers from your files; registered in TFDS as ``jsonl_local``."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Initial release.",
        "1.1.0": "Each record keeps its row (`example`); Parquet and Hugging Face datasets.",
    }
    BUILDER_CONFIGS: ClassVar[list] = []  # one per set of files: `files_config`

    def _info(self) -> tfds.core.DatasetInfo:
        return self._text_info(__doc__, ("id", "question", "answer", "example"))

    def _split_generators(self, dl_manager):
        c = self.builder_config
        if not isinstance(c, JsonlConfig):
            raise TypeError("the jsonl dataset needs a JsonlConfig (data.train_path, ...)")
        return {split: self._records(split, paths) for split, paths in c.split_files}

    def _records(self, split: str, paths):
        c = self.builder_config
        count = 0
        for path in paths:
            for record in read_examples(path, split, c.prompt_key, c.answer_key, start=count):
                count += 1
                yield record["id"], record
