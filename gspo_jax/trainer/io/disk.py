"""Writes a full disk cannot half-do, and the one line that says what it cost.

Every file the run writes whole (summary.json, config.json, curves.png, the exports, W&B's
run id, your dataset's JSONL) goes to a temporary name beside it and is renamed into place,
so a reader, and the next run, sees the old file or the new one, never a torn one. A
write that fails for lack of room or rights (a full disk, a quota, a read-only mount: the
errnos of `DISK_ERRNOS`, also when a library reports one in its own words, as safetensors
and matplotlib do) becomes one `DiskWriteError`, whose message names the file, what was not
written and what is kept:

    WORKDIR/summary.json: not written (No space left on device, errno 28): this run's
    summary is lost; the previous summary.json is kept as it was. Make room (or make it
    writable) and run the same command again

main.py prints it as the run's one line (an OSError: no type prefix), the traceback going
to WORKDIR/error.log as for every error. The temporary file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator

# Out of room or rights: the write cannot succeed until someone frees space or remounts.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
# How libraries that wrap the OS error in their own exception spell it.
_WORDED = (
    (re.compile(r"No space left on device|os error 28|Errno 28"), errno.ENOSPC),
    (re.compile(r"Disk quota exceeded|os error 122|Errno 122"), errno.EDQUOT),
    (re.compile(r"Read-only file system|os error 30|Errno 30"), errno.EROFS),
)
AGAIN = "Make room (or make it writable) and run the same command again"


class DiskWriteError(OSError):
    """A file could not be written for lack of room or rights; the message says which,
    what was lost and what is kept."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.errno = code


def disk_errno(error: BaseException) -> int | None:
    """The errno of `DISK_ERRNOS` behind `error` (its chain of causes included), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "errno", None)
        if code in DISK_ERRNOS:
            return code
        for pattern, worded in _WORDED:
            if pattern.search(str(error)):
                return worded
        error = error.__cause__ or error.__context__
    return None


def remove(path: str) -> None:
    """Removes a file or folder, if there; never raises."""
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)


@contextlib.contextmanager
def writing(path: str, lost: str, kept: str, *, partial: str | None = None) -> Iterator[None]:
    """Inside: writes of `path`. A disk error raised there (`disk_errno`) becomes one
    `DiskWriteError` naming `path`, what is `lost` and what is `kept`; `partial` (a
    temporary file or folder) is removed. Any other error passes unchanged."""
    try:
        yield
    except DiskWriteError:
        if partial is not None:
            remove(partial)
        raise
    except Exception as e:
        code = disk_errno(e)
        if partial is not None:
            remove(partial)
        if code is None:
            raise
        raise DiskWriteError(
            code,
            f"{path}: not written ({os.strerror(code)}, errno {code}): {lost}; {kept}. {AGAIN}",
        ) from e


def write_text(path: str, text: str, *, lost: str, kept: str | None = None) -> None:
    """`text` written whole to `path` (a temporary file renamed), or a DiskWriteError."""
    name = os.path.basename(path)
    if kept is None:
        kept = f"the previous {name} is kept as it was" if os.path.exists(path) else "nothing was"
    tmp = f"{path}.tmp.{os.getpid()}"
    with writing(path, lost, kept, partial=tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
