"""`config.imports`: the user's own modules, imported at start-up, before the config is
checked, so that what they register (a reward, a dataset, a loss aggregation) is a valid
name in the same config.

    --config.imports=my_rewards.py,my_pkg.datasets

Each comma-separated entry is a module name (imported as usual) or a path to a .py file.
A file's folder is put first on sys.path and the file imported by its name (its stem), so
that every process finds it the same way: the reward worker processes start with the
parent's sys.path and import a reward's module by name. Errors name the entry and the cause.
"""

from __future__ import annotations

import importlib
import os
import sys


class ImportsError(ValueError):
    """An entry of config.imports that cannot be imported (its message names the entry)."""


def entries(spec) -> list[str]:
    """The entries of `spec` (a comma-separated string, or a list of strings)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or ())
    return [str(x).strip() for x in items if str(x).strip()]


def import_all(spec) -> list[str]:
    """Imports every entry of `spec`; returns their module names."""
    return [_import_one(entry) for entry in entries(spec)]


def _import_one(entry: str) -> str:
    if entry.endswith(".py") or os.sep in entry:
        path = os.path.abspath(os.path.expanduser(entry))
        if not os.path.isfile(path):
            raise ImportsError(f"{entry!r}: no such file ({path})")
        folder, name = os.path.split(path)
        name = name.removesuffix(".py")
        loaded = sys.modules.get(name)
        where = getattr(loaded, "__file__", None)
        if loaded is not None and (where is None or os.path.abspath(where) != path):
            raise ImportsError(
                f"{entry!r}: the module name {name!r} is already taken by {where or 'a built-in module'}; "
                "rename the file"
            )
        if folder not in sys.path:
            sys.path.insert(0, folder)
    else:
        name = entry
    try:
        importlib.import_module(name)
    except Exception as e:  # the user's code: any error is theirs, named with its entry
        raise ImportsError(f"{entry!r} failed to import: {type(e).__name__}: {e}") from e
    return name
