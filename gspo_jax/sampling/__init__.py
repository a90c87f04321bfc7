"""The rollout engine: N prompts in, G responses per prompt out, with the sampler's log-probs.

    sampler.py   `sample`: one prefill per prompt, a `lax.while_loop` decode (the public
                 entry point, `gspo_jax.sampling.sample`)
    continuous.py the continuous engine (the default): slots, a page pool, a queue
    draw.py      the token draw: temperature, top-k / top-p, inverse-CDF categorical
                 (vocabulary-sharded logits drawn where they are)
    layout.py    `RolloutLayout`: the policy's rollout copy (compute dtype, decode layout),
                 made once per RL step; `rollout_mesh`: the rollout's own mesh

Imports only `models` and `sharding` (the decode arithmetic lives with the model,
models/kv_cache.py and models/paged.py).
"""

from gspo_jax.sampling.layout import RolloutLayout, rollout_mesh, rollout_shardings
from gspo_jax.sampling.sampler import (
    DEFAULT_BUCKETS,
    BiasedPiOldWarning,
    SampleOutput,
    SamplerState,
    choose_bucket,
    sample,
    warn_if_biased_pi_old,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "BiasedPiOldWarning",
    "RolloutLayout",
    "SampleOutput",
    "SamplerState",
    "choose_bucket",
    "rollout_mesh",
    "rollout_shardings",
    "sample",
    "warn_if_biased_pi_old",
]
