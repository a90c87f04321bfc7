"""The train step: one jitted call per RL step, (state, batch) -> (state, metrics).

    step.py      `train_step` / `make_train_step`: the π_old pass, then ppo_epochs x
                 num_mini_batches optimizer updates with micro-batch accumulation
    optim.py     the optax chain (AdamW, schedule, gradient clipping)

Imports only the math (objectives, logprobs, masked), the models and the sharding rules.
"""

from gspo_jax.train_step.step import (
    PER_UPDATE_KEYS,
    StepConfig,
    TrainState,
    batch_ndims,
    batch_shardings,
    make_logprobs_fn,
    make_train_step,
    response_logprobs,
    routing_changes,
    shared_group,
    train_step,
)

__all__ = [
    "PER_UPDATE_KEYS",
    "StepConfig",
    "TrainState",
    "batch_ndims",
    "batch_shardings",
    "make_logprobs_fn",
    "make_train_step",
    "response_logprobs",
    "routing_changes",
    "shared_group",
    "train_step",
]
