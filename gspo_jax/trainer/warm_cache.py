"""The supervised warm start, cached: trained once per key, then reused by every run whose
key is the same (another algorithm, another workdir), with one line saying so.

The key is a digest of what determines the warm-started weights (`key_of`): every
`model.*` field and, for a checkpoint (`model.hf_path`, `model.tokenizer_path`), its files'
names, sizes and modification times; every `data.*` field that shapes the training prompts
and, for your files (jsonl / parquet / hf) or GSM8K's, a digest of their contents (not
their paths); every
`warm_start.*` field; `seed`, `prompt_length`, `response_length`, `logprob_chunk_size`;
with a target accuracy, the reward that grades its checks; and the jax version. A change in
any of them is another key, so a stale warm start is never reused; `key.json` beside the
weights says what the key was made of.

Layout: `warm_start.cache_dir` (default: `warm_start_cache` beside the workdir, so the runs
under `workdirs/` share it) holds one folder per key: `params/` (orbax), `key.json`,
`result.json` (the `WarmStartResult`). A folder is written under a temporary name and
renamed when complete: a run killed mid-write leaves nothing that looks cached, and a
full disk while writing only warns (the run goes on with the weights it has).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil

import jax

from gspo_jax import sharding as sharding_lib
from gspo_jax.trainer.io import checkpoint
from gspo_jax.trainer.warm_start import WarmStartResult

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a cached folder holds changes
CACHE_DIR = "warm_start_cache"  # beside the workdir, by default
_NOT_KEY = {  # where files live or what may download: never the weights
    "model.download",
    "data.data_dir",
    "data.download",
    "data.eval_split",
    "warm_start.cache",
    "warm_start.cache_dir",
    # Your files' and GSM8K's contents are in the key (`data_identity`), not their paths:
    # gspo_jax.train writes a dataset under each workdir, and its runs share one warm start.
    "data.train_path",
    "data.test_path",
    "data.hf_path",
    "data.manual_dir",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One key's folder: `path` (`<cache_dir>/<digest>`) and what the key is made of."""

    path: str
    key: dict


def _files(directory: str | None) -> list | None:
    """[name, size, mtime_ns] of each file of a checkpoint or tokenizer directory."""
    if not directory or not os.path.isdir(directory):
        return None
    out = []
    for folder, _, names in sorted(os.walk(directory)):
        for name in sorted(names):
            stat = os.stat(os.path.join(folder, name))
            rel = os.path.relpath(os.path.join(folder, name), directory)
            out.append([rel, stat.st_size, stat.st_mtime_ns])
    return out


def key_of(c, flat: dict, checkpoint_dir: str | None, data_identity: str | None) -> dict:
    """What determines the warm start (module docstring); `flat`: the config's dotted
    fields, `data_identity`: a digest of the dataset's files (None: generated data)."""
    fields = {
        k: v
        for k, v in flat.items()
        if k.startswith(("model.", "data.", "warm_start.")) and k not in _NOT_KEY
    }
    target = c.warm_start.target_accuracy
    return {
        "format": FORMAT,
        "fields": fields,
        "checkpoint": _files(checkpoint_dir),
        "tokenizer": _files(c.model.tokenizer_path) if c.model.tokenizer_path else None,
        "data_files": data_identity,
        "seed": c.seed,
        "prompt_length": c.prompt_length,
        "response_length": c.response_length,
        "logprob_chunk_size": c.logprob_chunk_size,
        "accuracy": c.reward.accuracy if target not in (None, 0) else None,
        "jax": jax.__version__,
    }


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def entry(c, workdir: str, flat: dict, checkpoint_dir, data_identity) -> Entry | None:
    """The cache entry of this config's warm start; None when off (warm_start.cache) or
    there is no warm start."""
    if not c.warm_start.cache:
        return None
    root = c.warm_start.cache_dir or os.path.join(
        os.path.dirname(os.path.abspath(workdir)), CACHE_DIR
    )
    key = key_of(c, flat, checkpoint_dir, data_identity)
    return Entry(os.path.join(os.path.abspath(root), digest(key)), key)


def load(cached: Entry | None, abstract_params, shardings):
    """(params, WarmStartResult) of a complete cached folder seen by every process, with
    one line saying so; None otherwise."""
    if cached is None:
        return None
    result_path = os.path.join(cached.path, "result.json")
    if sharding_lib.host_max(int(not os.path.isfile(result_path))):
        return None
    error = None
    try:
        with open(result_path, encoding="utf-8") as f:
            result = WarmStartResult(**json.load(f))
        params = checkpoint.restore_params(
            os.path.join(cached.path, "params"), abstract_params, shardings
        )
    except Exception as e:  # noqa: BLE001 - a damaged cache entry is retrained, not fatal
        error = f"{type(e).__name__}: {e}"
    if sharding_lib.host_max(int(error is not None)):  # every process trains, or none
        log.warning(
            "warm start: the cached one in %s cannot be read (%s); training it anew",
            cached.path,
            error or "on another process",
        )
        return None
    result = dataclasses.replace(result, checks=tuple(tuple(c) for c in result.checks))
    log.info(
        "warm start: reused %s (%s; the same model, data, warm_start.* and seed; "
        "--config.warm_start.cache=false trains it anew)",
        cached.path,
        result.describe(),
    )
    return params, result


def store(cached: Entry | None, params, result: WarmStartResult) -> None:
    """Writes the folder under a temporary name, then renames it (the lead process); a
    failure (a full disk, a read-only cache) is one warning, never the run's end."""
    if cached is None:
        return
    lead = jax.process_index() == 0
    token = sharding_lib.gather_json(os.getpid())[0]
    tmp = f"{cached.path}.tmp-{token}"
    try:
        os.makedirs(tmp, exist_ok=True)
        checkpoint.save_params(os.path.join(tmp, "params"), params)
        if lead:
            for name, obj in (("key.json", cached.key), ("result.json", _as_json(result))):
                with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                    json.dump(obj, f, indent=1, sort_keys=True)
            if os.path.isdir(cached.path):  # another run cached the same key meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, cached.path)
                log.info("warm start: cached in %s for the runs with the same key", cached.path)
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs time only
        log.warning(
            "warm start: not cached in %s (%s: %s); this run goes on with it",
            cached.path,
            type(e).__name__,
            e,
        )
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
    sharding_lib.barrier("warm_start_cache")


def _as_json(result: WarmStartResult) -> dict:
    return {"steps": result.steps, "checks": list(result.checks), "reached": result.reached}
