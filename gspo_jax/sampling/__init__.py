"""The rollout engine: N prompts in, G responses per prompt out, with the sampler's log-probs.

`sample(...)` (keywords) or `sample_with(..., options=SampleOptions(...))` (one typed value)
is the public entry; docs/architecture.md lists the modules: sampler.py (checks, buckets,
dispatch), static.py and continuous.py (the two engines; pages.py and replicas.py plan and
place the continuous one), draw.py (the token draw), layout.py (the rollout's copy of the
policy), options.py (the options).

Imports only `models`, `sharding` and the algorithm's π_old check (the decode arithmetic
lives with the model, models/kv_cache.py and models/paged.py).
"""

from gspo_jax.sampling.layout import RolloutLayout, rollout_mesh, rollout_shardings
from gspo_jax.sampling.options import EngineOptions, SampleOptions
from gspo_jax.sampling.sampler import (
    DEFAULT_BUCKETS,
    BiasedPiOldWarning,
    SampleOutput,
    SamplerState,
    choose_bucket,
    sample,
    sample_with,
    warn_if_biased_pi_old,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "BiasedPiOldWarning",
    "EngineOptions",
    "RolloutLayout",
    "SampleOptions",
    "SampleOutput",
    "SamplerState",
    "choose_bucket",
    "rollout_mesh",
    "rollout_shardings",
    "sample",
    "sample_with",
    "warn_if_biased_pi_old",
]
