"""Checkpoints by name: `model.hf_path` is a local directory or a Hugging Face Hub id
(`Qwen/Qwen3-0.6B`, `org/name@revision`) found in the Hugging Face cache.

Nothing is downloaded unless asked (`model.download=true`): an id that the cache does not
hold is an error naming the id, the cache directory and the command that fetches it. The
cache is huggingface_hub's (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub),
read at call time, so a notebook may point it elsewhere after import.
"""

from __future__ import annotations

import os
import re

# What a run reads from a checkpoint: configs, weights, tokenizer files.
PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def cache_dir() -> str:
    """The Hugging Face hub cache directory, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    return os.path.join(home, "hub")


def is_hub_id(path: str) -> bool:
    """`org/name` or `org/name@revision` that is not a local path."""
    return bool(_REPO_ID.match(path)) and not os.path.exists(path)


def resolve(path: str, *, download: bool = False) -> str:
    """The local directory of a checkpoint: `path` itself, or the cached snapshot of the Hub
    id `path` (downloaded first only if `download`)."""
    if os.path.isdir(path) or not is_hub_id(path):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = path.partition("@")
    cache = cache_dir()
    try:
        return snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache,
            local_files_only=not download,
            allow_patterns=list(PATTERNS),
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{path!r} is not a local directory, and the Hugging Face cache ({cache}) holds no "
            f"snapshot of it; fetch it with `huggingface-cli download {repo_id}"
            f"{f' --revision {revision}' if revision else ''}` (or set model.download=true to "
            "let the run download it)"
        ) from None
