"""Reward registry: verifiers by name, and weighted sums of them built from a config string.

Data flow: `config.reward` (e.g. "math" or "math:1.0,format:0.1") -> `build_reward`
-> a `Reward` -> `scoring.score_batch` (host, between sampling and advantages).

A reward function has the signature

    fn(prompt: str, completion: str, reference: str) -> float

`prompt` is the prompt text the completion was sampled from, `completion` the sampled
response text (detokenised, the end-of-sequence token's text already stripped) and
`reference` the dataset's ground-truth answer string (a GSM8K solution ending in
`#### n`, or a bare answer). It should return a finite float; `score_batch` turns a
raise, a non-numeric or non-finite value, or a hang into reward 0.0 and counts it.

A reward that needs the example's other fields (a JSONL line's "difficulty", "tests",
"metadata"; a table row's columns) asks for them with a keyword parameter `example`:

    fn(prompt, completion, reference, *, example) -> float

and gets the whole row as a dict (its prompt and answer included, under their own keys;
`{}` for the built-in tasks, whose records carry no row). Whether a function asks is read
from its signature once (`takes_example`: a parameter named `example`, or `**kwargs`), so
the three-argument verifiers are called as they always were.

Functions are registered with `@register_reward("name")` in an importable module.
A `Reward` pickles by its spec string and the modules that registered its terms, so
worker processes rebuild it through the registry instead of pickling code.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping

from gspo_jax.registry import Registry

RewardFn = Callable[[str, str, str], float]

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
# name -> reward function (gspo_jax.registry); config validation reads the live names.
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn(prompt, completion, reference) -> float` under `name`.

    Names are identifiers (letters, digits, `_`, `.`, `-`; no `:` or `,`, which the
    spec syntax uses). Registering a different function under a taken name is an
    error; re-registering the same module-level function (a module imported twice,
    e.g. as `__main__` and by name) replaces it.
    """
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ValueError(f"reward name must match {_NAME_RE.pattern} (no ':' or ','), got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) needs a callable, got {fn!r}")
        return REWARDS.add(name, fn)

    return decorator


def takes_example(fn: Callable) -> bool:
    """Whether `fn` asks for the example's fields: a parameter `example` (not positional
    only) or `**kwargs`."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "example" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def call_reward(fn: Callable, prompt, completion, reference, example, wants: bool):
    """`fn(prompt, completion, reference)`, with `example=` (a dict) when it `wants` it."""
    if not wants:
        return fn(prompt, completion, reference)
    return fn(prompt, completion, reference, example=dict(example or {}))


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(REWARDS)


def get_reward_fn(name: str) -> RewardFn:
    """The function registered under `name`; ValueError listing the known names if none."""
    try:
        return REWARDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown reward {name!r}; registered rewards: {', '.join(list_rewards())}"
        ) from None


def name_of(fn: Callable) -> str | None:
    """The name `fn` is registered under, or None."""
    for name, registered in REWARDS.items():
        if registered is fn:
            return name
    return None


@dataclasses.dataclass(frozen=True)
class Reward:
    """A weighted sum of registered rewards: r = sum_k w_k * fn_k(prompt, completion, reference).

    Build with `build_reward(spec)`. `spec` is the canonical form ("math:1.0,format:0.1"),
    `names`/`weights` the terms in spec order, `modules` the modules that registered
    them (imported by worker processes before the names are looked up).
    """

    spec: str
    names: tuple[str, ...]
    weights: tuple[float, ...]
    fns: tuple[RewardFn, ...] = dataclasses.field(repr=False, compare=False)
    modules: tuple[str, ...] = dataclasses.field(repr=False, compare=False)
    # per term: whether its function asks for the example's fields (`takes_example`)
    wants_example: tuple[bool, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def takes_example(self) -> bool:
        """Whether any term asks for the example's fields (else none are sent to workers)."""
        return any(self.wants_example)

    def __call__(
        self, prompt: str, completion: str, reference: str, example: Mapping | None = None
    ) -> float:
        values = self.term_values(prompt, completion, reference, example)
        return float(sum(w * v for w, v in zip(self.weights, values)))

    def term_values(
        self, prompt: str, completion: str, reference: str, example: Mapping | None = None
    ) -> tuple[object, ...]:
        """Each term's raw (unweighted, unchecked) return value, in spec order."""
        return tuple(
            call_reward(fn, prompt, completion, reference, example, wants)
            for fn, wants in zip(self.fns, self.wants_example)
        )

    def __reduce__(self):
        # Pickled by name: the receiving process imports the registering modules and
        # looks the names up, so no code object crosses the process boundary.
        return (_rebuild_reward, (self.spec, self.modules))


def _rebuild_reward(spec: str, modules: tuple[str, ...]) -> Reward:
    import_reward_modules(modules)
    return build_reward(spec)


def import_reward_modules(modules: tuple[str, ...]) -> None:
    """Imports the modules whose import registers rewards (skipping `__main__`,
    which multiprocessing has already run in a spawned child as `__mp_main__`)."""
    for module in modules:
        if module not in ("__main__", "__mp_main__"):
            importlib.import_module(module)


def build_reward(spec: str) -> Reward:
    """Parses "name" or "name:weight,name:weight,..." into a `Reward`.

    A bare name has weight 1.0. Weights are finite floats (0 keeps a term for logging
    only; negative ones are penalties). Whitespace around names and weights is
    ignored. Errors name the offending term of the spec.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"reward spec must be a non-empty string like 'math' or "
            f"'math:1.0,format:0.1', got {spec!r}"
        )
    names: list[str] = []
    weights: list[float] = []
    for part in spec.split(","):
        term = part.strip()
        if not term:
            raise ValueError(f"empty term in reward spec {spec!r} (stray comma?)")
        name, sep, weight_text = term.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"term {term!r} of reward spec {spec!r} has no reward name")
        weight = 1.0
        if sep:
            try:
                weight = float(weight_text)
            except ValueError:
                raise ValueError(
                    f"bad weight {weight_text.strip()!r} in term {term!r} of reward spec "
                    f"{spec!r}: expected a number as in 'math:1.0'"
                ) from None
            if not math.isfinite(weight):
                raise ValueError(f"weight of term {term!r} of reward spec {spec!r} must be finite")
        if name not in REWARDS:
            raise ValueError(
                f"unknown reward {name!r} in term {term!r} of reward spec {spec!r}; "
                f"registered rewards: {', '.join(list_rewards())}"
            )
        if name in names:
            raise ValueError(f"reward {name!r} appears twice in reward spec {spec!r}")
        names.append(name)
        weights.append(weight)
    fns = tuple(REWARDS[n] for n in names)
    modules = tuple(dict.fromkeys(getattr(fn, "__module__", "__main__") for fn in fns))
    canonical = ",".join(f"{n}:{w!r}" for n, w in zip(names, weights))
    wants = tuple(takes_example(fn) for fn in fns)
    return Reward(canonical, tuple(names), tuple(weights), fns, modules, wants)


def as_reward(reward_fn: str | Reward | RewardFn) -> Reward | None:
    """A `Reward` for a spec string, a `Reward`, or a registered function; None for an
    unregistered callable (usable in-process only)."""
    if isinstance(reward_fn, Reward):
        return reward_fn
    if isinstance(reward_fn, str):
        return build_reward(reward_fn)
    if not callable(reward_fn):
        raise TypeError(
            f"reward_fn must be a spec string, a Reward or a callable, got {reward_fn!r}"
        )
    name = name_of(reward_fn)
    return None if name is None else build_reward(name)
