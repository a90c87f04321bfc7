"""What validation raises and warns: `ConfigError` (a field the trainer cannot run with,
one line naming it) and `ConfigWarning` (legal, but probably not what was meant), and the
field checks that raise them (a choice, an int, a number in a range, a bool)."""

import math
import numbers
import warnings


class ConfigError(ValueError):
    """A config field has a value the trainer cannot run with."""


class ConfigWarning(UserWarning):
    """A config is legal but departs from the paper's settings in a way worth knowing."""


def warn(message: str) -> None:
    warnings.warn(message, ConfigWarning, stacklevel=3)


def get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _choice(name: str, value, valid) -> None:
    valid = tuple(valid)
    if value not in valid:
        raise ConfigError(f"config.{name}={value!r} is not one of {list(valid)}")


def _positive_int(config, name: str) -> int:
    return _int(config, name, minimum=1)


def _int(config, name: str, *, minimum: int, allow_none: bool = False) -> int | None:
    """An int >= minimum (bools are not ints here)."""
    value = get(config, name)
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise ConfigError(f"config.{name}={value!r} must be {kind}")
    return value


def _number(
    config,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> float | None:
    """A finite real number within [low, high] (an end open where asked). NaN and inf
    fail every check, so they are named here rather than turned into NaN losses later."""
    value = get(config, name)
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            where = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            where = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            where = f"{'<' if high_open else '<='} {high:g}"
        else:  # no range: "a finite number" says it all
            where = ""
        none = " (or None)" if allow_none else ""
        message = " ".join(f"must be a finite number {where}{none}".split())
        raise ConfigError(f"config.{name}={value!r} {message}")
    return float(value)


def _bool(config, name: str) -> bool:
    value = get(config, name)
    if not isinstance(value, bool):
        raise ConfigError(f"config.{name}={value!r} must be True or False")
    return value
