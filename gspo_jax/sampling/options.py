"""`sampling.sample`'s options as one typed value.

`SampleOptions` is what a caller gives (`sample_with(..., options=SampleOptions(...))`; the
keyword form `sample(..., num_samples=..., ...)` builds one): every option of `sample`, with
its meaning in `sample`'s docstring. `EngineOptions` is what the engines get once `sample`
has checked and resolved them (filters dropped where they change nothing, the layout and the
KV dtype chosen): hashable, so the jitted stages take it whole as a static argument.
"""

from __future__ import annotations

import dataclasses

DEFAULT_BUCKETS = tuple(2**i for i in range(4, 16))  # 16, 32, …, 32768


@dataclasses.dataclass(frozen=True)
class SampleOptions:
    """Every option of `sampling.sample` (see its docstring for each)."""

    num_samples: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_ids: tuple[int, ...] | int | None = None
    pad_id: int = 0
    max_prompt_length: int | None = None
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    share_prefix: bool = True
    max_cache_len: int | None = None
    logprobs_as_pi_old: bool = False
    decode_segments: int | None = None
    engine: str = "continuous"
    num_slots: int | None = None
    page_size: int = 16
    kv_budget_tokens: int | None = None
    drain_levels: int | None = None
    layout: str = "trainer"
    kv_dtype: str = "auto"
    shared_prefix_attention: bool = True

    def replace(self, **changes) -> SampleOptions:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The checked, resolved options both engines read."""

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    share_prefix: bool
    drain_levels: int | None
    layout: str
    kv_dtype: str
    shared_prefix_attention: bool = True
