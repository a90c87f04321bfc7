"""The optax chain of the train step: clip-by-global-norm, then AdamW on a schedule
(`OptimSpec`, built from `config.optim` by config/specs.py).

The schedule counts optimizer updates (one per mini-batch), not RL steps: with the paper's 4
mini-batches per rollout and ppo_epochs=1, an RL step advances it by 4.
"""

from __future__ import annotations

import dataclasses

import optax

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW's settings (configs/base.py's `optim.*`) and the run's number of updates."""

    learning_rate: float  # peak
    schedule: str  # SCHEDULES
    warmup_steps: int  # linear warm-up, in optimizer updates
    end_lr_ratio: float  # cosine floor as a fraction of the peak
    weight_decay: float
    b1: float
    b2: float
    eps: float
    max_grad_norm: float | None  # None or 0: no clipping
    total_updates: int  # the schedule's length: RL steps x ppo_epochs x num_mini_batches


def learning_rate_schedule(spec: OptimSpec) -> optax.Schedule:
    """Linear warm-up to the peak, then constant or cosine decay to end_lr_ratio * peak."""
    peak = spec.learning_rate
    warmup = max(int(spec.warmup_steps), 0)
    if spec.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={spec.schedule!r} is not one of {SCHEDULES}")
    if spec.schedule == "constant":
        after = optax.constant_schedule(peak)
    else:
        decay_steps = max(spec.total_updates - warmup, 1)
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=spec.end_lr_ratio)
    if warmup == 0:
        return after
    # Start at peak / warmup (not 0) so the very first update is not wasted.
    ramp = optax.linear_schedule(peak / warmup, peak, warmup)
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(spec: OptimSpec) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> adamw(schedule, b1, b2, eps, weight_decay)."""
    schedule = learning_rate_schedule(spec)
    parts = []
    if spec.max_grad_norm:
        parts.append(optax.clip_by_global_norm(spec.max_grad_norm))
    parts.append(
        optax.adamw(schedule, b1=spec.b1, b2=spec.b2, eps=spec.eps, weight_decay=spec.weight_decay)
    )
    return optax.chain(*parts)
