"""The train step: one jitted call per RL step, (state, batch) -> (state, metrics): π_old,
then ppo_epochs x num_mini_batches optimizer updates with micro-batch accumulation
(step.py), the metrics' declared reductions (metrics.py), the optax chain (optim.py).

Imports only the algorithm, the models and the sharding (docs/architecture.md is the map).
"""

from gspo_jax.train_step.jitted import batch_shardings, make_logprobs_fn, make_train_step
from gspo_jax.train_step.metrics import metric_reductions, routing_changes
from gspo_jax.train_step.step import (
    StepConfig,
    TrainState,
    batch_ndims,
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
