"""The rollout engine: N prompts in, G responses per prompt out, with the sampler's log-probs.

    sampler.py   `sample`: one prefill per prompt, a `lax.while_loop` decode (the public
                 entry point, `gspo_jax.sampling.sample`)
    draw.py      the token draw: temperature, top-k / top-p, inverse-CDF categorical

Imports only `models` (the decode arithmetic lives with the model, models/kv_cache.py).
"""

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
    "SampleOutput",
    "SamplerState",
    "choose_bucket",
    "sample",
    "warn_if_biased_pi_old",
]
