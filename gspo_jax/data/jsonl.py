"""Your own prompts: a JSONL file per split, as a TFDS builder (array_record, nothing
downloaded), selected with `data.name="jsonl"`.

    --config.data.name=jsonl --config.data.train_path=train.jsonl \
        --config.data.test_path=test.jsonl [--config.data.prompt_key=prompt] \
        [--config.data.answer_key=answer]

One JSON object per line; `prompt_key` is the question the policy is asked (the chat
template and `data.instruction` wrap it as for the built-in tasks), `answer_key` the
reference the reward compares with (any JSON scalar, kept as its text). Blank lines are
skipped; every other problem (not an object, a missing or non-text key, bad JSON or bytes)
is an error naming the file and the line.

Records: `id` ("train-00042"), `question`, `answer`. The prepared copy lives under
`data_dir/jsonl/<config>/`, the config's name a digest of the two files' contents and the
keys: an edited file is prepared anew, never read stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import ClassVar

import tensorflow_datasets as tfds

from gspo_jax.data.local_builder import LocalBuilder


@dataclasses.dataclass(eq=False)
class JsonlConfig(tfds.core.BuilderConfig):
    """The files and keys of one JSONL dataset."""

    train_path: str = ""
    test_path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def jsonl_config(train_path, test_path, prompt_key="prompt", answer_key="answer") -> JsonlConfig:
    """The builder config of these files and keys, named by a digest of their contents."""
    paths = [os.path.abspath(os.fspath(p)) for p in (train_path, test_path)]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: no such file")
    key = json.dumps([_digest(p) for p in paths] + [prompt_key, answer_key])
    name = "files_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return JsonlConfig(
        name=name,
        description=f"{paths[0]} / {paths[1]}, keys {prompt_key!r} / {answer_key!r}",
        train_path=paths[0],
        test_path=paths[1],
        prompt_key=prompt_key,
        answer_key=answer_key,
    )


def read_examples(path: str, split: str, prompt_key: str, answer_key: str) -> list[dict]:
    """The records of one JSONL file; every error names the file and the line."""
    records = []
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
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(  # noqa: TRY004 (a bad file, not a bad argument)
                    f"{where}: a line must be a JSON object, got {type(obj).__name__}"
                )
            for key, field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
                if key not in obj:
                    raise ValueError(
                        f"{where}: no key {key!r} ({field}); the line has {sorted(obj)}"
                    )
            prompt, answer = obj[prompt_key], obj[answer_key]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: {prompt_key!r} must be non-empty text, got {prompt!r}")
            if isinstance(answer, (dict, list)) or answer is None:
                raise ValueError(f"{where}: {answer_key!r} must be a JSON scalar, got {answer!r}")
            example_id = f"{split}-{len(records):05d}"
            answer = answer if isinstance(answer, str) else json.dumps(answer)
            records.append({"id": example_id, "question": prompt, "answer": answer})
    if not records:
        raise ValueError(f"{path}: no example (an empty file, or only blank lines)")
    return records


class JsonlLocal(LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """Prompts and answers from local JSONL files; registered in TFDS as ``jsonl_local``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list] = []  # one per set of files: `jsonl_config`

    def _info(self) -> tfds.core.DatasetInfo:
        return self._text_info(__doc__, ("id", "question", "answer"))

    def _split_generators(self, dl_manager):
        c = self.builder_config
        if not isinstance(c, JsonlConfig):
            raise TypeError("the jsonl dataset needs a JsonlConfig (data.train_path, ...)")
        return {
            "train": self._records("train", c.train_path),
            "test": self._records("test", c.test_path),
        }

    def _records(self, split: str, path: str):
        c = self.builder_config
        for record in read_examples(path, split, c.prompt_key, c.answer_key):
            yield record["id"], record
