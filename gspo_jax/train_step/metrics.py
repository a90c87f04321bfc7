"""The train step's metrics: what each one is, how it combines, and the combining itself.

Every metric of a micro-batch (the policy loss's, `objectives.policy_metric_reductions`, and
the step's own, `metric_reductions`) is declared with how it combines over micro-batches and
over optimizer updates, and whether it is also reported per update (gspo_jax/algorithm/reductions.py).
The step folds micro-batches into a mini-batch's metrics (`init_micro`, `combine_micro`,
`finish_micro`) and updates into the step's (`step_metrics`) from those declarations alone.

Shapes: B rows, T response tokens, M MoE layers, L tokens, X experts per token, U updates.
"""

from __future__ import annotations

import jax.numpy as jnp

from gspo_jax.algorithm import objectives
from gspo_jax.algorithm.masked import row_mean
from gspo_jax.algorithm.reductions import MAX, PER_UPDATE, SUM, TOKEN_MEAN, Reduction, reduction_of


def metric_reductions(step_config) -> dict[str, Reduction]:
    """How every metric of the train step combines over micro-batches and updates
    (gspo_jax.algorithm.reductions): the policy loss's own (`objectives.policy_metric_reductions`) and
    the step's."""
    declared = objectives.policy_metric_reductions(
        step_config.importance_sampling, step_config.rollout_correction_level
    )
    declared.update(
        {
            "loss": SUM.logged(),
            "pg_loss": SUM,
            "kl_loss": SUM,
            "kl_ref": TOKEN_MEAN,
            "entropy_loss": SUM,
            "entropy": TOKEN_MEAN,
            # trainer − sampler log-prob gap; the first update's mini-batch 0 -> sampler/*
            "gap_abs_sum": SUM,
            "gap_max": MAX,
            "gap_seq_max": MAX,
            "experts_changed": SUM,  # MoE: routing changes against π_old's
            # MoE with router_aux_loss_coef > 0: micro-batch shares of the load-balancing loss
            "router_aux_loss": SUM.logged(),
            "experts_total": SUM,
            # derived per update from the sums above (`finish_micro`)
            "gap_mean": PER_UPDATE,
            "expert_change": PER_UPDATE.logged(),
            # once per optimizer update
            "grad_norm": PER_UPDATE.logged(),
            "update_norm": PER_UPDATE,
            "update_ratio": Reduction(None, updates="max"),  # the worst update of the step
            "skipped": Reduction(None, updates="sum"),
        }
    )
    return declared


def gap_sums(logp_BT, sampler_BT, mask_BT) -> dict:
    """|trainer − sampler| log-prob sums and maxima of a micro-batch (`metric_reductions`):
    per token, and per sequence of the mean over its tokens (log s_i's shift)."""
    valid_BT = mask_BT > 0
    diff_BT = jnp.where(valid_BT, logp_BT - sampler_BT, 0.0)
    return {
        "gap_abs_sum": jnp.sum(jnp.abs(diff_BT)),
        "gap_max": jnp.max(jnp.abs(diff_BT)),
        "gap_seq_max": jnp.max(jnp.abs(row_mean(diff_BT, mask_BT))),
    }


def routing_changes(old_MBLX, new_MBLX, attention_mask_BL):
    """(changed, total): of the `total` activated experts (valid token x MoE layer x top-k
    slot), how many the new routing picks that the old one did not pick for the same token
    and layer (expert sets compared, order ignored; as `tests/routing_checks.py`)."""
    kept_MBL = jnp.any(new_MBLX[..., :, None] == old_MBLX[..., None, :], axis=-1).sum(-1)
    k = new_MBLX.shape[-1]
    valid_BL = (attention_mask_BL > 0).astype(jnp.float32)
    total = k * new_MBLX.shape[0] * jnp.sum(valid_BL)
    changed = total - jnp.sum(kept_MBL.astype(jnp.float32) * valid_BL[None])
    return changed, total


def init_micro(reductions: dict[str, Reduction], names) -> dict:
    """Accumulators of the micro-batch loop: +inf for minima, −inf for maxima, else 0."""
    start = {"min": jnp.inf, "max": -jnp.inf}
    return {
        k: jnp.array(start.get(reduction_of(k, reductions).micro, 0.0), jnp.float32) for k in names
    }


def combine_micro(acc: dict, new: dict, new_tokens, new_seqs, reductions) -> dict:
    """Fold one micro-batch's metrics into running sums / weighted sums / minima / maxima."""
    out = {}
    for key, value in new.items():
        value = jnp.asarray(value, jnp.float32)
        kind = reduction_of(key, reductions).micro
        if kind == "sum":
            out[key] = acc[key] + value
        elif kind == "min":
            out[key] = jnp.minimum(acc[key], jnp.where(new_tokens > 0, value, jnp.inf))
        elif kind == "max":
            out[key] = jnp.maximum(acc[key], jnp.where(new_tokens > 0, value, -jnp.inf))
        elif kind == "seq_mean":
            out[key] = acc[key] + value * new_seqs
        elif kind == "token_mean":
            out[key] = acc[key] + value * new_tokens
        else:
            raise ValueError(f"metric {key!r} is not a micro-batch metric (micro={kind!r})")
    return out


def finish_micro(acc: dict, reductions) -> dict:
    """The mini-batch's metrics from the accumulators: weighted sums divided by their
    weights; the gap and expert-change rates from their sums."""
    tokens = jnp.maximum(acc["num_valid_tokens"], 1.0)
    seqs = jnp.maximum(acc["num_valid_seqs"], 1.0)
    divisor = {"token_mean": tokens, "seq_mean": seqs}
    out = {}
    for key, value in acc.items():
        kind = reduction_of(key, reductions).micro
        out[key] = value / divisor[kind] if kind in divisor else value
    out["gap_mean"] = out.pop("gap_abs_sum") / tokens
    if "experts_total" in out:
        out["expert_change"] = out.pop("experts_changed") / jnp.maximum(
            out.pop("experts_total"), 1.0
        )
    return out


def over_updates(per_update: dict, reductions) -> dict:
    """Each per-update metric [U] reduced over the updates as declared."""
    reduce = {"mean": jnp.mean, "sum": jnp.sum, "min": jnp.min, "max": jnp.max}
    return {k: reduce[reduction_of(k, reductions).updates](v) for k, v in per_update.items()}


def step_metrics(step_config, per_update: dict) -> dict:
    """The step's metrics from the per-update ones ([U] each)."""
    reductions = metric_reductions(step_config)
    per_update = dict(per_update)
    metrics = {
        "sampler/logprob_gap_mean": per_update.pop("gap_mean")[0],
        "sampler/logprob_gap_max": per_update.pop("gap_max")[0],
        "sampler/seq_logprob_gap_max": per_update.pop("gap_seq_max")[0],
        "ratio_noise_floor": jnp.maximum(
            per_update["ratio_max"][0] - 1.0, 1.0 - per_update["ratio_min"][0]
        ),
    }
    reduced = over_updates(per_update, reductions)
    reduced["skipped_updates"] = reduced.pop("skipped")
    metrics.update(reduced)
    for key, values in per_update.items():
        if reduction_of(key, reductions).per_update:
            metrics[f"updates/{key}"] = values
    return metrics
