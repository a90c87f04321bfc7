"""`gspo_jax.train`: the Python entry a notebook calls with plain functions and a list of
dicts. It runs the same loop as `python -m gspo_jax.main` (`loop.run`), after three
conveniences that a config file would otherwise spell out:

- `reward_fns`: plain functions `fn(prompt, completion, reference) -> float` (or with a
  keyword `example`: the dict's other fields), registered under their names and summed
  with weight 1 (`reward.spec`); the first is the accuracy (`reward.accuracy`, a 0/1
  reward). A function the reward worker processes cannot find by name (one not registered
  by `@register_reward` when its module is imported: defined in a notebook, a script or
  a function) is scored in-process (`reward.num_workers=0`, no timeout), with a line
  saying so.
- `dataset`: a list of `{"prompt": ..., "answer": ...}` dicts, or `{"train": [...],
  "test": [...]}`; written as JSONL under WORKDIR/dataset/ and read through
  `data.name="jsonl"` (the same pipeline, evaluation and dynamic sampling as the built-in
  tasks). A plain list holds out its last tenth (at least one row) as the test split.
- `config`: a ConfigDict (default: configs/default.py's), changed only as above.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from gspo_jax.trainer.io import disk

log = logging.getLogger(__name__)


def train(
    config=None,
    workdir: str = "workdirs/python",
    *,
    reward_fns: Sequence[Callable] | None = None,
    dataset: Sequence[dict] | dict[str, Sequence[dict]] | None = None,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Train in `workdir` (resuming if it holds a checkpoint); returns the run's summary
    (summary.json: eval_start, eval_end, the export path, ...)."""
    from configs import default
    from gspo_jax.trainer import loop

    config = default.get_config() if config is None else config
    if dataset is not None:
        _use_dataset(config, workdir, dataset)
    if reward_fns:
        _use_rewards(config, reward_fns)
    return loop.run(config, workdir, allow_config_change=allow_config_change)


def _use_dataset(config, workdir: str, dataset) -> None:
    splits = dict(dataset) if isinstance(dataset, dict) else _hold_out(list(dataset))
    if set(splits) != {"train", "test"}:
        raise ValueError(
            f"dataset: a list, or a dict with 'train' and 'test'; got {sorted(splits)}"
        )
    folder = os.path.join(workdir, "dataset")
    os.makedirs(folder, exist_ok=True)
    for split, rows in splits.items():
        path = os.path.join(folder, f"{split}.jsonl")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"dataset[{split!r}][{i}] is {type(row).__name__}, not a dict")
        text = "".join(json.dumps(row) + "\n" for row in rows)
        disk.write_text(path, text, lost=f"the {split} split of your dataset (nothing trained)")
    config.data.name, config.data.config_name = "jsonl", ""
    config.data.train_path = os.path.join(folder, "train.jsonl")
    config.data.test_path = os.path.join(folder, "test.jsonl")


def _hold_out(rows: list) -> dict[str, list]:
    n_test = max(1, len(rows) // 10)
    if len(rows) < 2:
        raise ValueError(f"dataset: {len(rows)} rows; a train and a test split need at least 2")
    log.info("dataset: %d rows for training, the last %d held out", len(rows) - n_test, n_test)
    return {"train": rows[:-n_test], "test": rows[-n_test:]}


# Rewards `train` registered itself (not their module's import): scored in-process.
_REGISTERED_HERE: set[str] = set()


def _use_rewards(config, reward_fns: Sequence[Callable]) -> None:
    from gspo_jax.config.validate import importable_by_workers
    from gspo_jax.rewards import registry

    names, local = [], []
    for fn in reward_fns:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or not name or name == "<lambda>":
            raise ValueError(f"reward_fns: {fn!r} must be a named function (def, not lambda)")
        if name not in registry.REWARDS or registry.REWARDS[name] is not fn:
            registry.register_reward(name)(fn)
            _REGISTERED_HERE.add(name)
        if name in _REGISTERED_HERE or not importable_by_workers(fn.__module__):
            # Registered here, not by importing its module: a worker would not find it.
            local.append(name)
        names.append(name)
    config.reward.spec = ",".join(names)
    config.reward.accuracy = names[0]
    if local and config.reward.num_workers:
        log.info(
            "reward_fns %s are defined where worker processes cannot import them: scored "
            "in-process (reward.num_workers=0, no timeout)",
            local,
        )
        config.reward.num_workers = 0
