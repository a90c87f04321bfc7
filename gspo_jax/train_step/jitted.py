"""The train step, jitted: `make_train_step` (explicit shardings, the state donated; with
`config.packing` a `PackedStep` that picks its packed-row bucket per batch) and
`make_logprobs_fn` (π_ref's and the token-level KL's log-prob pass). The step itself,
and what each call computes, is step.py."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gspo_jax import sharding as sharding_lib
from gspo_jax.train_step import packing
from gspo_jax.train_step.step import (
    StepConfig,
    _micro_batching,
    batch_ndims,
    response_logprobs,
    shared_group,
    train_step,
)


def batch_shardings(step_config: StepConfig, mesh) -> dict:
    """Shardings of the train batch: every entry split over the mesh's batch axes."""
    return {
        name: sharding_lib.batch_sharding(mesh, ndim)
        for name, ndim in batch_ndims(step_config).items()
    }


def make_train_step(
    step_config: StepConfig,
    tx: optax.GradientTransformation,
    *,
    state_shardings=None,
    mesh=None,
    donate: bool = True,
):
    """jax.jit(train_step) with the state donated and, given `state_shardings` and `mesh`,
    explicit in/out shardings: the state as given, the batch over the mesh's batch axes
    (`batch_shardings`), the metrics replicated."""
    kwargs = {}
    if state_shardings is not None:
        if mesh is None:
            raise ValueError("make_train_step: state_shardings need the mesh of the batch")
        kwargs["in_shardings"] = (state_shardings, batch_shardings(step_config, mesh))
        kwargs["out_shardings"] = (state_shardings, sharding_lib.replicated(mesh))

    def jitted(sc):
        fn = functools.partial(train_step, sc, tx)
        return jax.jit(fn, donate_argnums=(0,) if donate else (), **kwargs)

    if not step_config.packing or step_config.pack_rows:  # padded, or a fixed packed size
        return jitted(step_config)
    return PackedStep(step_config, jitted, sharding_lib.data_parallel_size(mesh) if mesh else 1)


def packed_rows(sc: StepConfig, mask_BL, response_len: int, splits: int, group: int, shards: int):
    """The packed rows per part of a batch split into `splits` strided parts
    (`packing.rows_needed`, bucketed by `packing.bucket_rows`), or 0 when that many rows of
    pack_length hold no fewer tokens than the padded part (its shared-prompt layout's when
    group > 1): a batch of full-length responses packs no better."""
    b, length = mask_BL.shape
    needed, contiguous = packing.rows_needed(sc, mask_BL, response_len, splits, group)
    if not bool(contiguous):
        raise ValueError(
            "packing: every attention_mask row must be a left-padded prompt then a "
            "right-padded response (real tokens contiguous on each side)"
        )
    part_rows = b // splits
    rows = packing.bucket_rows(int(needed), part_rows, shards)
    padded = part_rows * response_len + (part_rows // group) * (length - response_len)
    return rows if rows * packing.pack_length(sc, length) < padded else 0


class PackedStep:
    """The packed train step (`config.packing`). Per call: the packed rows the batch's
    micro-batches need (`packing.rows_needed`, one small jitted pass and a scalar fetch),
    bucketed (`packing.bucket_rows`); when R packed rows of pack_length hold fewer tokens
    than the padded micro-batch (its shared-prompt layout's when `shared_group` > 1) the
    packed step of that bucket runs, else the padded one (a batch of full-length responses
    packs no better; rows 0). `compiled`: the steps compiled so far, by rows (one per
    `packing.bucket_sizes` reached, and the padded one)."""

    def __init__(self, step_config: StepConfig, jitted, shards: int):
        self.step_config, self._jitted, self._shards = step_config, jitted, shards
        self.compiled: dict[int, Any] = {}

    def rows(self, batch) -> int:
        """Packed rows per micro-batch this batch compiles for; 0: the padded step."""
        sc = self.step_config
        b = batch["tokens"].shape[0]
        micro, group = _micro_batching(sc, b // sc.num_mini_batches)
        splits = sc.num_mini_batches * micro
        mask_BL, response_len = batch["attention_mask"], batch["response_mask"].shape[1]
        return packed_rows(sc, mask_BL, response_len, splits, group, self._shards)

    def __call__(self, state, batch):
        rows = self.rows(batch)
        if rows not in self.compiled:
            sc = dataclasses.replace(self.step_config, packing=rows > 0, pack_rows=rows or None)
            self.compiled[rows] = self._jitted(sc)
        return self.compiled[rows](state, batch)


def make_logprobs_fn(step_config: StepConfig, *, mesh=None):
    """Jitted log π(response tokens) of any params, the whole batch at once (π_ref; π_old
    for the token-level KL reward; the train step's own π_old pass is separate):
    fn(params, tokens_BL, attention_mask_BL, response_len) -> (logprobs [B, T],
    entropy [B, T], routing [B, M, L, X], batch-major; [B, 0, L, 0] for dense models).
    The rows are laid out as a rollout's (the G responses of a prompt contiguous), so with
    `shared_prompt` each prompt goes through the model once per group. With
    `config.packing` the whole batch is packed as one part (`packed_rows`, rows a multiple
    of `mesh`'s data-parallel size): one compile per bucket reached, and the padded pass
    when packing would not compute fewer tokens. Packed, log-probs and entropies are 0 at
    padding (the padded pass leaves finite, meaningless values there)."""

    def fn(sc, params, tokens_BL, attention_mask_BL, response_len):
        group = shared_group(sc, 1)
        logp, ent, routing = response_logprobs(
            sc, params, tokens_BL, attention_mask_BL, response_len, group=group
        )
        return logp, ent, jnp.moveaxis(routing, 1, 0)

    if not step_config.packing:  # one jitted function (`.lower` works: tools.aot)
        return jax.jit(functools.partial(fn, step_config), static_argnums=(3,))
    jitted = jax.jit(fn, static_argnums=(0, 4))
    shards = sharding_lib.data_parallel_size(mesh) if mesh else 1

    def packed_fn(params, tokens_BL, attention_mask_BL, response_len):
        group = shared_group(step_config, 1)
        rows = packed_rows(step_config, attention_mask_BL, response_len, 1, group, shards)
        sc = dataclasses.replace(step_config, packing=rows > 0, pack_rows=rows or None)
        return jitted(sc, params, tokens_BL, attention_mask_BL, response_len)

    return packed_fn
