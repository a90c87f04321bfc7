"""Dataset registry and preparation: name -> TFDS builder -> random-access sources per split.

``build_dataset`` is the one entry the trainer calls: it prepares the array_record files once
(synthetic data is generated locally, GSM8K is read from a manual directory; nothing is
downloaded) and returns ``tfds`` data sources, which ``gspo_jax.data.pipeline`` turns into
batches. A second call with the same ``data_dir`` reuses the files.

Multi-host note: with a ``data_dir`` shared by all hosts, let process 0 call with
``prepare=True`` first, barrier, then the others call with ``prepare=False``; with per-host
local directories every host may prepare (generation is deterministic).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow_datasets as tfds

from gspo_jax.data.arithmetic import ArithmeticConfig, SyntheticArithmetic
from gspo_jax.data.gsm8k import Gsm8kLocal, check_gsm8k_manual_dir


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
    """

    builder: type[tfds.core.GeneratorBasedBuilder]
    reference_key: str
    answer_key: str
    target_template: str
    check_manual_dir: Callable[[str | os.PathLike | None], None] | None


DATASETS = {
    "arithmetic": DatasetSpec(
        builder=SyntheticArithmetic,
        reference_key="answer",
        answer_key="answer",
        target_template="#### {answer}",
        check_manual_dir=None,
    ),
    "gsm8k": DatasetSpec(
        builder=Gsm8kLocal,
        reference_key="final_answer",
        answer_key="answer",  # The worked solution already ends in "#### <number>".
        target_template="{answer}",
        check_manual_dir=check_gsm8k_manual_dir,
    ),
}


def get_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; known: {sorted(DATASETS)}.")
    return DATASETS[name]


def get_builder(
    name: str,
    config_name: str | ArithmeticConfig | None = None,
    *,
    data_dir: str | os.PathLike,
) -> tfds.core.DatasetBuilder:
    """The array_record TFDS builder of a registered dataset (nothing is prepared yet)."""
    builder_cls = get_spec(name).builder
    if config_name is not None and not builder_cls.BUILDER_CONFIGS:
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
      splits: splits to return.
      prepare: if False, a dataset that is not yet prepared is an error instead of being built.

    Returns:
      Sources supporting ``len`` and ``source[i]`` -> dict of bytes/numpy features
      (``pipeline.decode_record`` turns bytes into str).
    """
    spec = get_spec(name)
    builder = get_builder(name, config_name, data_dir=data_dir)
    # Checking existence first avoids TFDS's warning about a variant folder without metadata.
    if not (os.path.isdir(builder.data_path) and builder.is_prepared()):
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
        builder.download_and_prepare(download_config=download_config)
    sources = builder.as_data_source()
    missing = [s for s in splits if s not in sources]
    if missing:
        raise ValueError(f"Dataset {name!r} has no split(s) {missing}; it has {sorted(sources)}.")
    return {split: sources[split] for split in splits}
