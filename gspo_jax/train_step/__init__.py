"""The train step: one jitted call per RL step, (state, batch) -> (state, metrics).

    step.py        `train_step` / `make_train_step`: π_old, then ppo_epochs x
                   num_mini_batches optimizer updates with micro-batch accumulation
    metrics.py     every metric's declared reduction (`metric_reductions`) and the
                   generic combining over micro-batches and updates
    old_policy.py  π_old: recomputed by the step's own pass, or the sampler's log-probs;
                   the MoE routing Routing Replay forces; the token-level KL reward's π_old
    split.py       the strided mini-/micro-batch split
    optim.py       the optax chain (AdamW, schedule, gradient clipping)

Imports only the math (objectives, logprobs, masked, reductions), the models, the sharding
rules and, for one warning about the sampler's log-probs, `sampling`.
"""

from gspo_jax.train_step.metrics import metric_reductions, routing_changes
from gspo_jax.train_step.step import (
    StepConfig,
    TrainState,
    batch_ndims,
    batch_shardings,
    make_logprobs_fn,
    make_train_step,
    response_logprobs,
    shared_group,
    train_step,
)

__all__ = [
    "StepConfig",
    "TrainState",
    "batch_ndims",
    "batch_shardings",
    "make_logprobs_fn",
    "make_train_step",
    "metric_reductions",
    "response_logprobs",
    "routing_changes",
    "shared_group",
    "train_step",
]
