"""Tables of prompts: Parquet files and Hugging Face datasets, read with pyarrow (the
`datasets` library is not needed), for `data.name="parquet"` and `data.name="hf"`.

`data.hf_path` (`hf_split_files`) is one of:

- a directory written by `datasets`' `save_to_disk`: a `DatasetDict` (dataset_dict.json and
  one folder per split) or a single `Dataset` (state.json; its split is "train"), whose
  Arrow files are read as they are;
- a directory of Parquet files, as the Hub holds them: `<split>-*.parquet` or
  `<split>.parquet` anywhere under it (`main/test-00000-of-00001.parquet`), or numbered
  files inside a folder named `<split>` (`default/train/0000.parquet`);
- a Hub id (`org/name`, `org/name@revision`) whose snapshot is in the Hugging Face cache
  (`HF_HUB_CACHE`, else `HF_HOME/hub`), and a folder of it to read alone (a subset:
  `openai/gsm8k/main`): nothing is downloaded unless `data.download=true`; a missing one
  is an error naming the id, the cache and the command that fetches it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

# org/name[/subset folder...][@revision]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w.-]+)*(@[\w./-]+)?$")
_PATTERNS = ("*.parquet", "*.arrow", "*.json")


def table_rows(path: str) -> Iterable[tuple[str, dict]]:
    """(where, row as a dict) of a Parquet file or a `datasets` Arrow file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.endswith(".arrow"):
            with pa.memory_map(path) as source:
                table = pa.ipc.open_stream(source).read_all()
        else:
            table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot be read as a table ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def _save_to_disk_files(path: str) -> dict[str, list[str]] | None:
    """{split: Arrow files} of a `save_to_disk` directory, or None if it is not one."""

    def files_of(folder: str) -> list[str]:
        with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        return [os.path.join(folder, d["filename"]) for d in state["_data_files"]]

    try:
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as f:
                splits = json.load(f)["splits"]
            return {s: files_of(os.path.join(path, s)) for s in splits}
        if os.path.isfile(os.path.join(path, "state.json")):
            return {"train": files_of(path)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: a `datasets` save_to_disk directory whose metadata cannot be read "
            f"({type(e).__name__}: {e})"
        ) from None
    return None


def _parquet_files(path: str) -> dict[str, list[str]]:
    """{split: Parquet files} under `path` (the module docstring's layouts)."""
    out: dict[str, list[str]] = {}
    for folder, _, names in sorted(os.walk(path)):
        for name in sorted(names):
            if not name.endswith(".parquet"):
                continue
            split = name[: -len(".parquet")].split("-")[0]
            if split.isdigit():  # 0000.parquet: the folder names the split
                split = os.path.basename(folder)
            out.setdefault(split, []).append(os.path.join(folder, name))
    return out


def hf_split_files(path: str, *, download: bool = False) -> dict[str, list[str]]:
    """{split: files} of `data.hf_path` (module docstring); errors name the path."""
    local = path if os.path.isdir(path) else None
    if local is None:
        if not _REPO_ID.match(path):
            raise FileNotFoundError(f"data.hf_path={path!r}: no such directory")
        local = _snapshot(path, download)
    files = _save_to_disk_files(local)
    if files is None:
        files = _parquet_files(local)
    if not files:
        raise ValueError(
            f"data.hf_path={path!r}: {local} holds no dataset (neither a `datasets` "
            "save_to_disk directory nor Parquet files)"
        )
    return files


def _snapshot(path: str, download: bool) -> str:
    """The cached snapshot of the Hub dataset `path` (downloaded first only if asked)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from gspo_jax.models.hub import cache_dir

    name, _, revision = path.partition("@")
    parts = name.split("/")
    repo_id, subset = "/".join(parts[:2]), parts[2:]
    cache = cache_dir()
    try:
        snapshot = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision or None,
            cache_dir=cache,
            local_files_only=not download,
            allow_patterns=list(_PATTERNS),
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"data.hf_path={path!r} is not a local directory, and the Hugging Face cache "
            f"({cache}) holds no snapshot of the dataset; fetch it with `huggingface-cli "
            f"download --repo-type dataset {repo_id}"
            f"{f' --revision {revision}' if revision else ''}` (or set data.download=true to "
            "let the run download it)"
        ) from None
    folder = os.path.join(snapshot, *subset)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"data.hf_path={path!r}: {repo_id} has no folder {'/'.join(subset)}"
        )
    return folder
