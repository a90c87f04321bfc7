"""Dataset registry and preparation: name -> TFDS builder -> random-access sources per split.

``build_dataset`` is the one entry the trainer calls: it prepares the array_record files once
(synthetic data is generated locally, GSM8K is read from a manual directory; nothing is
downloaded) and returns ``tfds`` data sources, which ``gspo_jax.data.pipeline`` turns into
batches. A second call with the same ``data_dir`` reuses the files.

Multi-host note: with a ``data_dir`` shared by all hosts, let process 0 call with
``prepare=True`` first, barrier, then the others call with ``prepare=False``; with per-host
local directories every host may prepare (generation is deterministic).

A dataset prepared from local files (GSM8K) records the SHA-256 of each file it read
(``MANUAL_RECORD`` beside the prepared files). Reusing the ``data_dir`` with a ``manual_dir``
whose files differ is an error naming both: the files would otherwise be ignored without a
word, and the run would train on the first run's data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow_datasets as tfds

from gspo_jax import jsonio
from gspo_jax.data.arithmetic import ArithmeticConfig, SyntheticArithmetic
from gspo_jax.data.gsm8k import GSM8K_SPLIT_FILES, Gsm8kLocal, check_gsm8k_manual_dir
from gspo_jax.data.jsonl import JsonlLocal
from gspo_jax.data.scratchpad import SyntheticScratchpad
from gspo_jax.registry import Registry

log = logging.getLogger(__name__)

# Beside a dataset prepared from manual files: {"manual_dir": ..., "sha256": {file: digest}}.
MANUAL_RECORD = "gspo_manual_files.json"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How the pipeline reads one dataset.

    Attributes:
      builder: the TFDS builder class.
      reference_key: record field the reward compares with (pipeline ``reference_key``).
      answer_key: record field used as the supervised target (pipeline ``answer_key``).
      target_template: supervised target text, formatted with ``answer=record[answer_key]``.
      check_manual_dir: for datasets prepared from local files, raises naming any missing
        file of ``manual_dir``; None when the data are generated.
      manual_files: the files of ``manual_dir`` the builder reads (their digests are
        recorded with the prepared data).
    """

    builder: type[tfds.core.GeneratorBasedBuilder]
    reference_key: str
    answer_key: str
    target_template: str
    check_manual_dir: Callable[[str | os.PathLike | None], None] | None
    manual_files: tuple[str, ...] = ()


# name -> DatasetSpec (gspo_jax.registry); `config.data.name` accepts the live names.
DATASETS: Registry[DatasetSpec] = Registry("dataset")


def register_dataset(name: str, spec: DatasetSpec) -> DatasetSpec:
    """Makes `spec` available as `config.data.name=name` (a TFDS builder in array_record
    format, and which record fields are the reference and the supervised target)."""
    return DATASETS.add(name, spec)


register_dataset(
    "arithmetic",
    DatasetSpec(
        builder=SyntheticArithmetic,
        reference_key="answer",
        answer_key="answer",
        target_template="#### {answer}",
        check_manual_dir=None,
    ),
)
register_dataset(
    "scratchpad",
    DatasetSpec(
        builder=SyntheticScratchpad,
        reference_key="final_answer",
        answer_key="answer",  # the worked solution, ending in "#### <sum>"
        target_template="{answer}",
        check_manual_dir=None,
    ),
)
register_dataset(
    "gsm8k",
    DatasetSpec(
        builder=Gsm8kLocal,
        reference_key="final_answer",
        answer_key="answer",  # The worked solution already ends in "#### <number>".
        target_template="{answer}",
        check_manual_dir=check_gsm8k_manual_dir,
        manual_files=tuple(GSM8K_SPLIT_FILES.values()),
    ),
)


# Your own files: data.train_path / test_path ("jsonl", "parquet") or data.hf_path ("hf"),
# data.prompt_key / answer_key; one builder (data/jsonl.py) reads them all.
for _name in ("jsonl", "parquet", "hf"):
    register_dataset(
        _name,
        DatasetSpec(
            builder=JsonlLocal,
            reference_key="answer",
            answer_key="answer",
            target_template="{answer}",
            check_manual_dir=None,
        ),
    )
FILE_DATASETS = ("jsonl", "parquet", "hf")


def get_spec(name: str) -> DatasetSpec:
    """The registered dataset `name`; ValueError listing the valid names if there is none."""
    return DATASETS.get(name)


def get_builder(
    name: str,
    config_name: str | ArithmeticConfig | None = None,
    *,
    data_dir: str | os.PathLike,
) -> tfds.core.DatasetBuilder:
    """The array_record TFDS builder of a registered dataset (nothing is prepared yet)."""
    builder_cls = get_spec(name).builder
    if isinstance(config_name, str) and not builder_cls.BUILDER_CONFIGS:
        raise ValueError(f"Dataset {name!r} has no configs; got config_name={config_name!r}.")
    if isinstance(config_name, str):
        known = [c.name for c in builder_cls.BUILDER_CONFIGS]
        if config_name not in known:
            raise ValueError(f"Unknown config {config_name!r} for {name!r}; known: {known}.")
    return builder_cls(data_dir=os.fspath(data_dir), config=config_name, file_format="array_record")


def build_dataset(
    name: str,
    config_name: str | ArithmeticConfig | None = None,
    *,
    data_dir: str | os.PathLike,
    manual_dir: str | os.PathLike | None = None,
    splits: Sequence[str] = ("train", "test"),
    prepare: bool = True,
) -> dict[str, Any]:
    """Prepares a dataset (once) and returns ``{split: random-access source}``.

    Args:
      name: ``"arithmetic"`` (configs ``add2``, ``add3`` (default), ``mixed``, or an
        ``ArithmeticConfig``) or ``"gsm8k"`` (reads ``manual_dir/{train,test}.jsonl``).
      config_name: builder config; None for the dataset's default.
      data_dir: where the array_record files live (``<data_dir>/<tfds name>/<config>/<version>``).
      manual_dir: GSM8K's local files; only read when the dataset is not yet prepared.
      splits: splits to return; TFDS slices of them too (``"train[:500]"``,
        ``"train[500:]"``: a dev split and the rest of train).
      prepare: if False, a dataset that is not yet prepared is an error instead of being built.

    Returns:
      Sources supporting ``len`` and ``source[i]`` -> dict of bytes/numpy features
      (``pipeline.decode_record`` turns bytes into str).
    """
    spec = get_spec(name)
    try:
        builder = get_builder(name, config_name, data_dir=data_dir)
        # Checking existence first avoids TFDS's warning about a variant folder without
        # metadata.
        prepared = os.path.isdir(builder.data_path) and builder.is_prepared()
    except Exception as e:
        # TFDS reads the prepared folder's dataset_info.json / features.json in the builder.
        if isinstance(e, ValueError) and str(e).startswith(("Unknown config", "Dataset ")):
            raise
        folder = os.path.join(os.fspath(data_dir), spec.builder.name, str(config_name or ""))
        raise _damaged(name, folder, e) from e
    if not prepared:
        if not prepare:
            raise FileNotFoundError(
                f"Dataset {name!r} ({builder.builder_config.name if builder.builder_config else ''}) "
                f"is not prepared under {builder.data_path} and prepare=False."
            )
        if spec.check_manual_dir is not None:
            spec.check_manual_dir(manual_dir)
        download_config = tfds.download.DownloadConfig(
            manual_dir=os.fspath(manual_dir) if manual_dir is not None else None
        )
        source = f"from {os.fspath(manual_dir)}" if spec.manual_files else "generated"
        log.info(
            "preparing dataset %s in %s (%s, local data: nothing is downloaded)",
            name if builder.builder_config is None else f"{name}/{builder.builder_config.name}",
            builder.data_path,
            source,
        )
        builder.download_and_prepare(download_config=download_config)
        if spec.manual_files:
            _write_manual_record(builder.data_path, manual_dir, spec.manual_files)
    elif prepare and spec.manual_files and manual_dir is not None:
        _check_manual_record(name, builder.data_path, manual_dir, spec.manual_files)
    try:
        sources = builder.as_data_source()
        missing = [s for s in splits if s.split("[", 1)[0] not in sources]
        if missing:
            raise ValueError(
                f"Dataset {name!r} has no split(s) {missing}; it has {sorted(sources)}."
            )
        out = {s: sources[s] if s in sources else _slice(builder, name, s) for s in splits}
        for source in out.values():  # a truncated record file fails here, not mid-run
            if len(source):
                _ = (source[0], source[len(source) - 1])  # read to check
    except Exception as e:
        if isinstance(e, ValueError) and str(e).startswith("Dataset "):
            raise
        raise _damaged(name, builder.data_path, e) from e
    return out


def _damaged(name: str, path, error: BaseException) -> ValueError:
    """The error for prepared files TFDS cannot read (a crash or a full disk mid-prepare,
    files edited or truncated): names the folder and how to rebuild."""
    return ValueError(
        f"the prepared {name!r} dataset in {os.fspath(path)} cannot be read "
        f"({type(error).__name__}: {error}): its files are damaged. Delete "
        f"{os.fspath(path)} and run again to prepare it anew (nothing is downloaded)"
    )


def _slice(builder, name: str, split: str):
    """A TFDS split slice such as ``train[:500]`` or ``train[500:]`` (a dev split carved
    out of train: the two slices are disjoint)."""
    try:
        return builder.as_data_source(split=split)
    except (ValueError, AssertionError, KeyError) as e:
        raise ValueError(f"Dataset {name!r}: split {split!r} is not a valid slice: {e}") from e


def manual_digests(manual_dir, files: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in files:
        digest = hashlib.sha256()
        with open(os.path.join(os.fspath(manual_dir), name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[name] = digest.hexdigest()
    return out


def _write_manual_record(data_path, manual_dir, files: Sequence[str]) -> None:
    record = {
        "manual_dir": os.path.abspath(os.fspath(manual_dir)),
        "sha256": manual_digests(manual_dir, files),
    }
    with open(os.path.join(os.fspath(data_path), MANUAL_RECORD), "w") as f:
        json.dump(record, f, indent=2)


def _check_manual_record(name: str, data_path, manual_dir, files: Sequence[str]) -> None:
    """Raise if the prepared data were built from other files than `manual_dir`'s."""
    path = os.path.join(os.fspath(data_path), MANUAL_RECORD)
    if not os.path.exists(path):
        log.warning(
            "%s was prepared without a record of its source files: cannot check that it "
            "was built from %s",
            data_path,
            manual_dir,
        )
        return
    record = jsonio.read_json(path, what="the record of the files the data were built from")
    now = manual_digests(manual_dir, files)
    differ = [f for f in files if record["sha256"].get(f) != now[f]]
    if differ:
        raise ValueError(
            f"the {name!r} data already prepared in {data_path} were built from "
            f"{record['manual_dir']}, whose {', '.join(differ)} differ(s) from "
            f"data.manual_dir={os.fspath(manual_dir)!r}: use another data.data_dir, or "
            f"delete {data_path} to prepare the new files"
        )
