"""π_old: where the old policy's log-probs (and MoE routing) come from, decided here only.

GSPO's ratio s_i = exp(mean_t(log π_θ − log π_old)) needs π_old, the policy the rollout was
sampled from. `old_logprobs_source` (a `StepConfig` field) chooses it:

  "recompute"  the train step's own π_old pass (`old_policy_pass`): the loss's forward at
               the params the step starts from, on the very micro-batches (shapes, layout)
               the updates use. The first update then recomputes exactly these numbers, so
               its ratios are exactly 1 (a differently shaped pass — the whole batch at once —
               differs by bf16 rounding, which GSPO's ±3e-4 clip range sees).
  "sampler"    the sampler's own log-probs (paper §5.4: the inference engine's likelihoods
               as π_old, no recomputation). The first update's ratios then measure the
               sampler / trainer mismatch (`ratio_noise_floor`, `sampler/*`). They are the
               unfiltered tempered policy's (sampling.sample), so with top-k / top-p or
               greedy decoding the ratio is biased: `check_source` refuses greedy and warns
               for filters, once, at start-up.

A rollout correction (`rollout_correction` "tis" / "mask", docs/rollout_correction.md) keeps
the mismatch out of the ratio: the pass runs whatever the source, the ratio's π_old is the
trainer's own (so the clip measures policy change only), and the sampler's log-probs μ enter
only a separate stop-gradient weight of ρ = π_old / μ (`correction_kwargs`). With it both
sources give the same train step and cost the pass; the source still picks π_old for the
token-level KL reward (`for_token_kl_reward`).

On a Mixture-of-Experts model the pass runs whatever the source, for π_old's routing: Routing
Replay (paper §5.3) forces it in every update, and every update reports how many experts the
current router would choose differently (`expert_change`).

Outside the train step π_old is needed once more: the token-level KL reward
(`add_token_level_kl`) is computed before the train step from KL(π_old ‖ π_ref), with
`for_token_kl_reward` deciding which π_old that is.

Shapes: Mn mini-batches, mini rows per mini-batch, T response tokens, M MoE layers, L tokens,
X experts per token.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from gspo_jax.sharding.split import strided_merge, strided_split

SOURCES = ("recompute", "sampler")


class BiasedPiOldWarning(UserWarning):
    """The sampler's log-probs are not the likelihood of the tokens' actual draw."""


def warn_if_biased_pi_old(top_k=None, top_p=None, temperature: float = 1.0) -> bool:
    """Warns (BiasedPiOldWarning) when sampler log-probs used as π_old would be biased.

    `sample` reports log softmax(logits / τ) — the unfiltered tempered policy the trainer
    recomputes. With top-k / top-p the tokens were drawn from the filtered, renormalised
    distribution q instead, so π_θ/π_old is not the importance weight of the actual draw
    (tokens outside the filter are never sampled, those inside are over-sampled by
    1/q-mass). Greedy decoding (τ = 0) draws nothing at all. Returns True if it warned.
    """
    reasons = []
    if top_k is not None:
        reasons.append(f"top_k={top_k}")
    if top_p is not None and top_p < 1.0:
        reasons.append(f"top_p={top_p}")
    if temperature == 0:
        reasons.append("temperature=0 (greedy)")
    if not reasons:
        return False
    warnings.warn(
        f"sampler log-probs used as pi_old with {', '.join(reasons)}: they are log "
        "softmax(logits / temperature) of the unfiltered policy, but the tokens were drawn "
        "from the filtered (or greedy) distribution, so the importance ratio "
        "pi_theta / pi_old is biased. Recompute pi_old, or sample without top_k/top_p.",
        BiasedPiOldWarning,
        stacklevel=2,
    )
    return True


def corrects(step_config) -> bool:
    """Whether a rollout correction is on (it needs the trainer's own π_old: the pass)."""
    return step_config.rollout_correction != "none"


def runs_pass(step_config) -> bool:
    """Whether the train step runs its π_old pass: to recompute π_old (also for a rollout
    correction's ρ = π_old / μ), or for π_old's MoE routing (replayed, and compared with
    every update's)."""
    return (
        step_config.old_logprobs_source == "recompute"
        or corrects(step_config)
        or step_config.is_moe
    )


def correction_kwargs(step_config, micro_batch: dict) -> dict:
    """`objectives.policy_loss`' rollout-correction arguments for one micro-batch: none
    without a correction, else μ = the sampler's log-probs and the configured mode."""
    if not corrects(step_config):
        return {}
    return {
        "sampler_logprobs": micro_batch["sampler_logprobs"],
        "rollout_correction": step_config.rollout_correction,
        "rollout_correction_level": step_config.rollout_correction_level,
        "rollout_correction_threshold": step_config.rollout_correction_threshold,
    }


def check_source(source: str, *, temperature: float, top_k, top_p) -> None:
    """Start-up check of the π_old source against the rollout's sampling: greedy decoding has
    no sampling distribution (ValueError); top-k / top-p make the sampler's log-probs those
    of a distribution the tokens were not drawn from (one BiasedPiOldWarning)."""
    if source not in SOURCES:
        raise ValueError(f"old_logprobs_source={source!r} is not one of {list(SOURCES)}")
    if source != "sampler":
        return
    if temperature == 0:
        raise ValueError(
            "old_logprobs_source='sampler' needs sampling.temperature > 0: greedy decoding "
            "has no sampling distribution to serve as pi_old"
        )
    warn_if_biased_pi_old(top_k, top_p, temperature)


def attach(step_config, params, mini_batches: dict, pass_fn) -> dict:
    """`mini_batches` ([Mn, mini, ...] each) with `old_logprobs` [Mn, mini, T] and, MoE,
    `old_routing` [Mn, mini, M, L, X] added, as `old_logprobs_source` says (with a rollout
    correction: always the pass's).
    `pass_fn(params, mini_batches)` is the train step's π_old pass (`old_policy_pass`)."""
    if not runs_pass(step_config):
        return {**mini_batches, "old_logprobs": mini_batches["sampler_logprobs"]}
    old = pass_fn(params, mini_batches)
    if step_config.old_logprobs_source == "sampler" and not corrects(step_config):
        old["old_logprobs"] = mini_batches["sampler_logprobs"]
    return {**mini_batches, **old}


def for_token_kl_reward(source: str, sampler_logprobs_BT, recompute):
    """π_old [B, T] of the token-level KL reward, needed before the train step: the
    sampler's log-probs, or `recompute()` (the whole batch at once: equal to the train step's
    own π_old up to bf16 rounding)."""
    return sampler_logprobs_BT if source == "sampler" else recompute()


def old_policy_pass(step_config, params, mini_batches, micro_logprobs, num_micro: int) -> dict:
    """log π_old [Mn, mini, T] (and, MoE, π_old's routing [Mn, mini, M, L, X]) of every row,
    laid out as `mini_batches`: `micro_logprobs(params, micro_batch) -> (logp [B, T],
    routing [M, B, L, X])` — the loss's own forward — on the same `num_micro` strided
    micro-batches of each mini-batch as the updates, so the first update recomputes exactly
    these numbers."""
    inputs = {k: mini_batches[k] for k in ("tokens", "attention_mask", "response_mask")}

    def one_micro(mb):
        logp_BT, routing_MBLX = micro_logprobs(params, mb)
        out = {"old_logprobs": logp_BT}
        if step_config.is_moe:
            out["old_routing"] = jnp.moveaxis(routing_MBLX, 0, 1)
        return out

    def one_mini(mini):
        micro_batches = jax.tree.map(lambda x: strided_split(x, num_micro), mini)
        if num_micro == 1:
            out = jax.tree.map(
                lambda x: x[None], one_micro(jax.tree.map(lambda x: x[0], micro_batches))
            )
        else:
            out = jax.lax.map(one_micro, micro_batches)
        return jax.tree.map(strided_merge, out)

    return jax.lax.map(one_mini, inputs)
