"""Reading JSON and JSONL files for the whole package, with errors that name the file (and,
for JSONL, the line): a file that is not UTF-8, not JSON, or not the kind of value expected
(an object where fields are read; `null`, a number or a list is not one).

  read_json(path, what=...)            one JSON value; an object unless `expect` says
  read_jsonl(path, what=..., ...)      [(line number, value)] of the non-blank lines

A JSONL file the run appends to (config_changes.jsonl, metrics.jsonl) can be torn by a
crash mid-write: with `torn_tail="skip"` an unparsable last line without its newline is
skipped with a warning naming the file; everywhere else it is an error like any other line.
Errors are `JsonFileError` (a ValueError), so every caller that reported a bad value still
reports this one on one line.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class JsonFileError(ValueError):
    """A JSON or JSONL file that cannot be read as what it should hold; names the file."""


def _decode(data: bytes, path: str, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise JsonFileError(
            f"{path}:{line}: {what} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
            f"{e.start}): a damaged or binary file"
        ) from None


_KINDS = ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string"))


def _kind(value: Any) -> str:
    """How JSON calls `value` (or, for a type, its values)."""
    kind = value if isinstance(value, type) else type(value)
    if value is None:
        return "null"
    for cls, name in _KINDS:
        if issubclass(kind, cls):
            return name
    return "a number" if issubclass(kind, (int, float)) else kind.__name__


def read_json(
    path: str | os.PathLike, *, what: str = "the file", expect: type | None = dict
) -> Any:
    """The JSON value in `path`; JsonFileError naming the file for bytes that are not UTF-8,
    text that is not JSON (truncated, torn), or a value that is not an `expect` (None: any).
    OSError (missing, unreadable) is left to the caller, which knows what the file is for."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    text = _decode(data, path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        # A file cut short (a crash or a full disk mid-write) ends inside a value.
        hint = " (truncated?)" if not text.rstrip().endswith(("}", "]")) else ""
        raise JsonFileError(
            f"{path}:{e.lineno}: {what} is not valid JSON{hint}: {e.msg} at column {e.colno}"
        ) from None
    if expect is not None and not isinstance(value, expect):
        raise JsonFileError(f"{path}: {what} holds {_kind(value)}, not {_kind(expect)}")
    return value


def read_jsonl(
    path: str | os.PathLike,
    *,
    what: str = "the file",
    expect: type | None = dict,
    torn_tail: str = "error",
) -> list[tuple[int, Any]]:
    """[(1-based line number, value)] of each non-blank line of `path`.

    Each line must be UTF-8 JSON of type `expect` (None: any); JsonFileError names the file
    and line otherwise. `torn_tail="skip"`: a last line without its newline that does not
    parse (a crash mid-append) is skipped with a warning instead.
    """
    if torn_tail not in ("error", "skip"):
        raise ValueError(f"torn_tail must be 'error' or 'skip', got {torn_tail!r}")
    path = os.fspath(path)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    rows = []
    last = len(lines) - 1  # after a final "\n" the last element is b""
    for index, raw in enumerate(lines):
        line_no = index + 1
        where = f"{path}:{line_no}"
        torn = index == last and raw.strip() != b""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if torn and torn_tail == "skip":
                _skip_torn(path, line_no)
                break
            raise JsonFileError(
                f"{where}: {what} line is not UTF-8 text (byte {raw[e.start]:#04x} at column "
                f"{e.start + 1})"
            ) from None
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if torn and torn_tail == "skip":
                _skip_torn(path, line_no)
                break
            raise JsonFileError(
                f"{where}: {what} line is not valid JSON: {e.msg} at column {e.colno}"
            ) from None
        if expect is not None and not isinstance(value, expect):
            raise JsonFileError(f"{where}: {what} line holds {_kind(value)}, not {_kind(expect)}")
        rows.append((line_no, value))
    return rows


def _skip_torn(path: str, line_no: int) -> None:
    log.warning(
        "%s:%d: skipping a torn last line (a crash mid-write left it incomplete)", path, line_no
    )
