"""GSM8K as a TFDS builder that reads local JSONL files (no network), array_record output.

The stock TFDS ``gsm8k`` builder downloads from GitHub; runs here must never download, so this
builder (registered as ``gsm8k_local``) reads the official files from a manual directory:

    <manual_dir>/train.jsonl   one JSON object per line: {"question": ..., "answer": ...}
    <manual_dir>/test.jsonl    where "answer" is the worked solution ending in "#### <number>"

Records: ``id`` ("train-00042", the 0-based line index among non-blank lines), ``question``,
``answer`` (the full solution) and ``final_answer`` (the text after the last ``####``, stripped,
commas removed: "#### 1,200" -> "1200"). ``final_answer`` is the reference the reward compares
with; it must be a number (``rewards.answers.parse_number``), or no completion could ever
match it: "#### forty two" is an error naming the file and line, as is a file with no example.
"""

from __future__ import annotations

import os
from typing import ClassVar

import tensorflow_datasets as tfds

from gspo_jax import jsonio
from gspo_jax.data.local_builder import LocalBuilder
from gspo_jax.rewards.answers import MAX_ANSWER_CHARS, parse_number

GSM8K_SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}

_LAYOUT = (
    "Expected layout: <manual_dir>/train.jsonl and <manual_dir>/test.jsonl, the official GSM8K "
    "files (https://github.com/openai/grade-school-math, grade_school_math/data/), one JSON "
    'object per line with "question" and "answer" (the solution ending in "#### <number>").'
)


def check_gsm8k_manual_dir(manual_dir: str | os.PathLike | None) -> None:
    """Raises FileNotFoundError naming every missing GSM8K file (and the expected layout)."""
    if manual_dir is None:
        raise FileNotFoundError(f"GSM8K needs manual_dir (got None). {_LAYOUT}")
    missing = [
        os.path.join(os.fspath(manual_dir), name)
        for name in GSM8K_SPLIT_FILES.values()
        if not os.path.isfile(os.path.join(os.fspath(manual_dir), name))
    ]
    if missing:
        raise FileNotFoundError(f"GSM8K manual file(s) missing: {', '.join(missing)}. {_LAYOUT}")
    empty = [
        os.path.join(os.fspath(manual_dir), name)
        for name in GSM8K_SPLIT_FILES.values()
        if os.path.getsize(os.path.join(os.fspath(manual_dir), name)) == 0
    ]
    if empty:
        raise FileNotFoundError(f"GSM8K manual file(s) empty: {', '.join(empty)}. {_LAYOUT}")


def final_answer_of(solution: str, *, where: str) -> str:
    """The text after the last '####' of a GSM8K solution, stripped, commas removed."""
    if "####" not in solution:
        raise ValueError(f"{where}: GSM8K answer has no '####' final-answer marker: {solution!r}")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError(f"{where}: GSM8K answer has nothing after '####': {solution!r}")
    if len(final) > MAX_ANSWER_CHARS:
        raise ValueError(
            f"{where}: GSM8K final answer is {len(final)} characters long, more than the "
            f"verifier reads ({MAX_ANSWER_CHARS}, rewards/answers.py MAX_ANSWER_CHARS), so no "
            f"completion could ever match it: {final[:60]!r}..."
        )
    if parse_number(final) is None:
        raise ValueError(
            f"{where}: GSM8K final answer {final!r} is not a number, so no completion could "
            "ever match it"
        )
    return final


def read_gsm8k_jsonl(path: str | os.PathLike, split: str) -> list[dict[str, str]]:
    """Parses one official GSM8K file into records; errors name the file and line."""
    records = []
    # Each line an object (not null, a list or a number), UTF-8, JSON: jsonio names the line.
    for line_no, obj in jsonio.read_jsonl(path, what="a GSM8K"):
        where = f"{os.fspath(path)}:{line_no}"
        for key in ("question", "answer"):
            if key not in obj or not isinstance(obj[key], str):
                raise ValueError(f"{where}: missing string field {key!r}. {_LAYOUT}")
        example_id = f"{split}-{len(records):05d}"
        records.append(
            {
                "id": example_id,
                "question": obj["question"],
                "answer": obj["answer"],
                "final_answer": final_answer_of(obj["answer"], where=where),
            }
        )
    if not records:
        raise ValueError(f"{os.fspath(path)}: no GSM8K example (only blank lines)")
    return records


class Gsm8kLocal(LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """GSM8K from local files; registered in TFDS as ``gsm8k_local``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = _LAYOUT

    def _info(self) -> tfds.core.DatasetInfo:
        return self._text_info(
            __doc__,
            ("id", "question", "answer", "final_answer"),
            homepage="https://github.com/openai/grade-school-math",
        )

    def _split_generators(self, dl_manager):
        # TFDS's own check only says "missing or empty"; ours names the missing file.
        try:
            manual_dir = dl_manager.manual_dir
        except AssertionError as e:
            raise FileNotFoundError(f"GSM8K manual_dir unusable: {e}") from e
        check_gsm8k_manual_dir(manual_dir)
        return {
            split: self._generate_examples(split, os.path.join(os.fspath(manual_dir), name))
            for split, name in GSM8K_SPLIT_FILES.items()
        }

    def _generate_examples(self, split: str, path: str):
        for record in read_gsm8k_jsonl(path, split):
            yield record["id"], record
