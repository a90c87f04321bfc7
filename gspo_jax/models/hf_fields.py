"""Typed reads of a Hugging Face config.json's fields (`HfReader`), shared by
`ModelConfig.from_hf_config` (config.py) and the hybrid (Qwen3.5) fields (hybrid_config.py)."""

from __future__ import annotations

import math
from typing import Any


class HfReader:
    """Typed reads of config.json's fields, each range-checked like a config field, with a
    message naming the key (hf_io.model_config_from_file adds the file). JSON has real
    booleans and integers: `"tie_word_embeddings": "false"` is truthy in Python and used to
    drop the untied head silently, and `int("32")` or `int(32.7)` hid a hand-edited file."""

    def __init__(self, hf: dict[str, Any]):
        self.hf = hf

    def need(self, key: str):
        if self.hf.get(key) is None:
            raise ValueError(
                f"config.json for {self.hf.get('model_type')!r} lacks required field {key!r}"
            )
        return self.hf[key]

    _REQUIRED = object()

    def integer(self, key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}={value!r} must be an integer")  # noqa: TRY004 - a bad value, as the range errors
        return value

    def count(self, key: str, default=_REQUIRED) -> int:
        """A positive integer; `default` (None allowed) when the key is absent or null."""
        value = self.hf.get(key)
        if value is None:
            if default is HfReader._REQUIRED:
                self.need(key)
            return default
        if self.integer(key, value) <= 0:
            raise ValueError(f"{key}={value!r} must be a positive integer")
        return value

    def positive(self, key: str, value) -> float:
        """A finite number > 0 (rope_theta, rms_norm_eps, a RoPE factor)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}={value!r} must be a number")  # noqa: TRY004 - a bad value, as the range errors
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{key}={value!r} must be a finite number > 0")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(  # noqa: TRY004 - a bad value, as the range errors
                f"{key}={value!r} must be true or false (a JSON boolean, not a string or number)"
            )
        return value

    def token_id(self, key: str, value) -> int | None:
        if value is None:
            return None
        if self.integer(key, value) < 0:
            raise ValueError(f"{key}={value!r} must be a token id >= 0")
        return value
