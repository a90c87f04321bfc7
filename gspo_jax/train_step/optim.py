"""The optax chain built from `config.optim`: clip-by-global-norm, then AdamW on a schedule.

The schedule counts optimizer updates (one per mini-batch), not RL steps: with the paper's 4
mini-batches per rollout and ppo_epochs=1, an RL step advances it by 4.
"""

from __future__ import annotations

import optax

SCHEDULES = ("constant", "cosine")


def learning_rate_schedule(optim_config, total_updates: int) -> optax.Schedule:
    """Linear warm-up to the peak, then constant or cosine decay to end_lr_ratio * peak."""
    peak = optim_config.learning_rate
    warmup = max(int(optim_config.warmup_steps), 0)
    if optim_config.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={optim_config.schedule!r} is not one of {SCHEDULES}")
    if optim_config.schedule == "constant":
        after = optax.constant_schedule(peak)
    else:
        decay_steps = max(total_updates - warmup, 1)
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim_config.end_lr_ratio)
    if warmup == 0:
        return after
    # Start at peak / warmup (not 0) so the very first update is not wasted.
    ramp = optax.linear_schedule(peak / warmup, peak, warmup)
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(optim_config, total_updates: int) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> adamw(schedule, b1, b2, eps, weight_decay)."""
    schedule = learning_rate_schedule(optim_config, total_updates)
    parts = []
    if optim_config.max_grad_norm:
        parts.append(optax.clip_by_global_norm(optim_config.max_grad_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=optim_config.b1,
            b2=optim_config.b2,
            eps=optim_config.eps,
            weight_decay=optim_config.weight_decay,
        )
    )
    return optax.chain(*parts)
