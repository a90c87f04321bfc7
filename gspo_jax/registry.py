"""`Registry`: the one type behind every extension point of gspo_jax.

Each extension point is a `Registry` held by the module that uses its entries, with a public
`register_*` decorator beside it:

    objectives.RATIOS            importance_sampling (`register_importance_sampling`)
    objectives.LOSS_MODES        loss_mode           (`register_loss_mode`)
    objectives.LOSS_AGG_MODES    loss_agg_mode       (`register_loss_agg`)
    objectives.KL_ESTIMATORS     kl_estimator        (`register_kl_estimator`)
    advantages.ADV_ESTIMATORS    adv_estimator       (`register_advantage_estimator`)
    rewards.registry.REWARDS     reward.spec terms   (`gspo_jax.rewards.register_reward`)
    rewards.voting.ANSWER_KEYS   maj@k's answers     (`gspo_jax.rewards.register_answer`)
    data.build.DATASETS          data.name           (`gspo_jax.data.register_dataset`)

A registry maps a name to an entry and reads like a read-only dict (`name in r`, `r[name]`,
iteration in registration order, `sorted(r)`). Registering a name twice raises: two
different functions under one name would make a config mean whichever module was imported
last. Config validation lists a registry's live names, so a name is valid as soon as it is
registered, whenever that happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries of one extension point (`kind` names the config field it feeds)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Registers `entry` under `name`; a taken name raises ValueError, unless it holds
        the same entry (equal, or the same module-level function: a module imported twice,
        as `__main__` and by name, registers its functions again), which it then replaces."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind}: a registered name must be a non-empty string")
        old = self._entries.get(name)
        if old is not None and _identity(old) != _identity(entry):
            raise ValueError(
                f"{self.kind} {name!r} is already registered to {_describe(old)}; "
                f"cannot register {_describe(entry)} under the same name"
            )
        self._entries[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        """`@registry.decorator(name)`: registers the decorated object as it is."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        """The entry under `name`; ValueError listing the valid names if there is none."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {sorted(self)}") from None

    def remove(self, name: str) -> None:
        """Drops `name` (tests that register a throwaway entry clean up with this)."""
        self._entries.pop(name, None)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):
        return list(self._entries.items())

    def values(self):
        return list(self._entries.values())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {sorted(self)})"


def _identity(entry) -> object:
    """What makes two registrations the same: a plain function's qualified name (its module
    may have been imported twice), any other entry itself (compared with ==)."""
    if callable(entry) and hasattr(entry, "__qualname__") and hasattr(entry, "__module__"):
        return f"{entry.__module__}.{entry.__qualname__}"
    return entry


def _describe(entry) -> str:
    ident = _identity(entry)
    return ident if isinstance(ident, str) else repr(entry)
