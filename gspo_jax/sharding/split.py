"""How one rollout batch is cut into mini-batches (one optimizer update each) and those into
micro-batches (gradient accumulation), strided so that no rows move between devices.

Mini-batch m of M holds rows {m, m+M, m+2M, ...}, and micro-batches stride through a
mini-batch the same way: every device then holds an equal share of every part, whatever
the batch sharding. The loss of a part never depends on the cut (denominators are the
whole mini-batch's: train_step/step.py).
"""

from __future__ import annotations

import jax.numpy as jnp


def strided_split(x, parts: int):
    """[B, ...] -> [parts, B/parts, ...] with part p = rows p, p+parts, p+2·parts, ..."""
    b = x.shape[0]
    return jnp.swapaxes(x.reshape((b // parts, parts) + x.shape[1:]), 0, 1)


def strided_merge(x):
    """The inverse of `strided_split`: [parts, B/parts, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def num_micro(micro_batch_size: int | None, mini_size: int) -> int:
    """Micro-batches per mini-batch of `mini_size` rows (None: the whole mini-batch)."""
    return mini_size // (micro_batch_size or mini_size)
