"""The single jitted GSPO/GRPO train step: (state, batch) -> (state, metrics).

One call consumes one rollout batch of B = N·G responses:

  π_old (old_policy.py): the sampler's log-probs, or this step's own π_old pass — the
      loss's forward at the incoming params on the very micro-batches the updates use
  for epoch in range(ppo_epochs):                  # lax.scan over E·M updates
    for mini-batch m in range(num_mini_batches):   # one optimizer update each
      for micro-batch k:                           # lax.scan, gradient accumulation
        loss_k = policy_loss(...) + kl_loss_coef·KL − entropy_coef·H   (global denominators)
                 [+ router_aux_loss_coef·load-balancing loss: MoE, `_router_aux_loss`]
      grads = Σ_k ∇loss_k ;  skip the update if grads or the update are not finite
      params, opt_state = AdamW(clip(grads))

Denominators (valid tokens / valid sequences) are those of the whole mini-batch, so the loss
and gradient of a mini-batch do not depend on how it is split into micro-batches or over how
many devices it is sharded (docs/architecture.md, "One RL step"). From the second
mini-batch on, params differ from π_old, so ratios leave 1 and the clip range acts (paper
§5.1 splits each rollout into 4).

Mini-batch m holds rows {m, m+M, m+2M, ...} (and micro-batches likewise stride through a
mini-batch: split.py): every device then holds an equal share of every mini-batch, so no
rows move between devices. Advantages are precomputed, so groups need not stay together.

The first update's ratios: with π_old recomputed they are exactly 1 (old_policy.py says
why); with the sampler's log-probs they measure the train/inference mismatch, reported as
`ratio_noise_floor` and `sampler/*` (from the first update's forward on mini-batch 0). On a
Mixture-of-Experts model each update reports `expert_change`, the fraction of activated
experts (token x MoE layer x top-k slot) that the current router chooses differently from
π_old's (with Routing Replay, paper §5.3: would choose).

Metrics: each is declared with how it combines over micro-batches and updates
(`metric_reductions`, gspo_jax/algorithm/reductions.py); the step consumes the declarations
generically.

Shapes: B responses, P prompt tokens (left padded), T response tokens, L = P + T,
U = ppo_epochs · num_mini_batches updates, D model width.

Batch (a dict of arrays, leading axis B):
  tokens          int32 [B, L]   prompt (left padded) then response (right padded)
  attention_mask  int32 [B, L]   1 for real prompt tokens and valid response tokens
  response_mask   f32   [B, T]   1 for generated tokens up to and including the end token
  sampler_logprobs f32  [B, T]   the sampler's log-prob of each response token; π_old with
                                 old_logprobs_source="sampler" (without a rollout
                                 correction), else μ of the rollout correction
  advantages      f32   [B] or [B, T]
  ref_logprobs    f32   [B, T]   only with use_kl_loss

Rows n·G … n·G+G−1 are the G responses to prompt n (as `rollout.collect` lays them out):
with `shared_prompt` the model reads each prompt once, from the first row of its group
(`shared_group`), and the numbers equal the repeated-prompt computation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from gspo_jax import models
from gspo_jax.algorithm import logprobs as logprobs_lib
from gspo_jax.algorithm import objectives, old_policy
from gspo_jax.algorithm.masked import masked_mean
from gspo_jax.models import lora, moe_aux, partition
from gspo_jax.models.attention import resolve_impl
from gspo_jax.sharding.split import num_micro, strided_split
from gspo_jax.train_step import packing
from gspo_jax.train_step.metrics import (
    combine_micro,
    finish_micro,
    gap_sums,
    init_micro,
    metric_reductions,
    routing_changes,
    step_metrics,
)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # optimizer updates applied so far (int32 scalar)
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static the train step needs (hashable: part of the compilation key).

    No defaults here: `config.step_config(config, model_config)` builds it from an
    experiment config, whose defaults live in configs/base.py alone.
    """

    model: models.ModelConfig
    importance_sampling: str  # objectives.IMPORTANCE_SAMPLING_MODES
    clip_low: float
    clip_high: float
    dual_clip_loss: bool
    dual_clip_ratio: float
    loss_agg_mode: str  # objectives.LOSS_AGG_MODES
    loss_mode: str  # objectives.LOSS_MODES: the GSPO family's per-token loss
    sapo_tau_pos: float
    sapo_tau_neg: float
    dppo_delta_low: float
    dppo_delta_high: float
    dppo_max_weight: float
    opsm_delta: float | None  # off-policy sequence masking's δ (reads sampler_logprobs)
    horizon: int | None  # seq-mean-token-sum-norm constant: the configured response_length
    ppo_epochs: int
    num_mini_batches: int
    micro_batch_size: int | None  # None: the whole mini-batch at once
    use_kl_loss: bool
    kl_loss_coef: float
    kl_estimator: str  # objectives.KL_ESTIMATORS
    entropy_coef: float
    temperature: float  # log-probs are of softmax(logits / temperature), as sampled
    logprob_chunk_size: int
    old_logprobs_source: str  # "recompute": π_old from this step's own pass; "sampler"
    # The sampler / trainer mismatch as a separate weight (objectives.rollout_correction_weights;
    # old_policy.py): "none" | "tis" | "mask", at "token" | "seq" level, threshold C > 1.
    rollout_correction: str
    rollout_correction_level: str
    rollout_correction_threshold: float
    routing_replay: bool  # force π_old's expert choices in every update (MoE, paper §5.3)
    # Qwen3-MoE's router load-balancing loss (models/moe_aux.py) times this, added to the
    # policy loss (0: off, and its statistics are not computed)
    router_aux_loss_coef: float
    token_advantages: bool  # advantages are [B, T] (add_token_level_kl), not [B]
    group_size: int  # G: rows n·G … n·G+G−1 of a batch share prompt n
    shared_prompt: bool  # each prompt through the model once per group (`shared_group`)
    packing: bool  # real tokens only: responses packed into rows of pack_length (packing.py)
    pack_length: int  # tokens per packed row; 0: the rollout's row length P + T
    # Packed rows per micro-batch: chosen per call by `make_train_step`'s `PackedStep`
    # (`packing.bucket_rows`) when None; given, one compile with that many.
    pack_rows: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.model.num_moe_layers > 0

    @property
    def num_updates(self) -> int:
        """Optimizer updates per RL step: ppo_epochs × num_mini_batches."""
        return self.ppo_epochs * self.num_mini_batches


def shared_group(step_config: StepConfig, splits: int) -> int:
    """Responses per prompt that the model sees together in a batch split into `splits`
    strided parts (mini-batches x micro-batches), or 1: no sharing.

    Part p of a strided split holds rows p, p+splits, p+2·splits, ...: when `splits`
    divides G, every run of G/splits consecutive rows of a part are responses to one
    prompt, which then goes through the model once for them (`models.hidden_states_shared`)
    instead of once per response. Off (1) with `shared_prompt` off, with MoE models (the
    routing arrays are per repeated row), with hybrid Qwen3.5 models (a response continues
    its prompt's DeltaNet state, which the shared layout does not carry), when the split
    does not keep groups together, and
    when the model's attention is a fused kernel (splash, cuDNN: the shared layout runs the
    einsum attention, whose scores would be materialised). Call it at trace time: the
    kernel depends on the platform compiled for.
    """
    g = step_config.group_size
    cfg = step_config.model
    if not step_config.shared_prompt or cfg.num_moe_layers or cfg.is_hybrid or g % splits:
        return 1
    if resolve_impl(cfg.attention_impl, dtype=cfg.dtype) != "xla":
        return 1
    return g // splits


def batch_ndims(step_config: StepConfig) -> dict[str, int]:
    """The train batch's entries and their ranks (see the module docstring)."""
    ndims = {
        "tokens": 2,
        "attention_mask": 2,
        "response_mask": 2,
        "sampler_logprobs": 2,
        "advantages": 2 if step_config.token_advantages else 1,
    }
    if step_config.use_kl_loss:
        ndims["ref_logprobs"] = 2
    return ndims


def response_logprobs(
    step_config: StepConfig,
    params,
    tokens_BL,
    attention_mask_BL,
    response_len: int,
    *,
    routing=None,
    group: int = 1,
    router_stats: bool = False,
):
    """(log π(response token) [B, T], entropy [B, T], routing [M, B, L, X]: the router's own
    top-k, also when `routing` forces the experts that run) without
    materialising [B, L, V] logits; routing is empty ([0, B, L, 0]) for dense models.
    With `router_stats` (MoE, group 1) a fourth value: the router load statistics of every
    real token of the rows (prompt and response), summed over the MoE layers
    (`models.hidden_states`).

    The hidden state at position j predicts token j+1, so the T response tokens (the last T
    of the row) are predicted by hidden states L−T−1 … L−2.

    group > 1 (`shared_group`): rows n·group … n·group+group−1 repeat one prompt, which
    the model then runs once for them (`models.hidden_states_shared`); the same numbers.
    """
    if step_config.packing:
        return packing.packed_response_logprobs(
            step_config,
            params,
            tokens_BL,
            attention_mask_BL,
            response_len,
            routing=routing,
            group=group,
        )
    length = tokens_BL.shape[1]
    prompt_len = length - response_len
    targets_BT = tokens_BL[:, prompt_len:]
    stats = ()
    if group > 1:
        if routing is not None or router_stats:
            raise ValueError(
                "response_logprobs: a shared prompt (group > 1) takes no routing or router_stats"
            )
        mask_BT = attention_mask_BL[:, prompt_len:]
        prompt_hidden_NPD, hidden_BTD = models.hidden_states_shared(
            step_config.model,
            params,
            tokens_BL[::group, :prompt_len],
            attention_mask_BL[::group, :prompt_len],
            targets_BT,
            mask_BT,
        )
        # Response token 0 is predicted by the prompt's last position (its gradient then
        # sums over the group), token t by response position t − 1.
        first_BD = jnp.repeat(prompt_hidden_NPD[:, -1:], group, axis=0)
        hidden_BTD = jnp.concatenate([first_BD, hidden_BTD[:, :-1]], axis=1)
        cfg = step_config.model
        routing_out = jnp.zeros((0, *tokens_BL.shape, cfg.num_experts_per_tok), jnp.int32)
    else:
        hidden_BLD, routing_out, *stats = models.hidden_states(
            step_config.model,
            params,
            tokens_BL,
            attention_mask_BL,
            routing=routing,
            router_stats=router_stats,
        )
        hidden_BTD = hidden_BLD[:, prompt_len - 1 : length - 1]
    logp_BT, entropy_BT = logprobs_lib.token_logprobs(
        hidden_BTD,
        models.unembedding(step_config.model, params),
        targets_BT,
        temperature=step_config.temperature,
        # logprob_chunk_size counts tokens per chip: each chip's chunk would otherwise
        # shrink with the number of chips its rows are split over (docs/tpu.md, section 9)
        chunk_size=step_config.logprob_chunk_size * partition.row_shards(hidden_BTD.shape[0]),
        return_entropy=True,
    )
    return logp_BT, entropy_BT, routing_out, *stats


def _micro_loss(
    step_config: StepConfig,
    params,
    mb,
    num_valid_tokens,
    num_valid_seqs,
    *,
    group: int = 1,
    num_real_tokens=None,
):
    """Loss of one micro-batch, divided by the whole mini-batch's denominators (group:
    `shared_group` of this micro-batch; num_real_tokens: the mini-batch's attention-mask
    sum, which weighs the router load-balancing loss, `_router_aux_loss`)."""
    response_len = mb["response_mask"].shape[1]
    routing = None
    if step_config.routing_replay:
        routing = jnp.moveaxis(mb["old_routing"], 0, 1)  # [B, M, L, X] -> [M, B, L, X]
    aux = step_config.router_aux_loss_coef > 0
    logp_BT, entropy_BT, routing_MBLX, *stats = response_logprobs(
        step_config,
        params,
        mb["tokens"],
        mb["attention_mask"],
        response_len,
        routing=routing,
        group=group,
        router_stats=aux,
    )
    mask_BT = mb["response_mask"]
    denominators = {
        "horizon": step_config.horizon,
        "num_valid_tokens": num_valid_tokens,
        "num_valid_seqs": num_valid_seqs,
    }
    pg_loss, metrics = objectives.policy_loss(
        logp_BT,
        mb["old_logprobs"],
        mb["advantages"],
        mask_BT,
        importance_sampling=step_config.importance_sampling,
        clip_low=step_config.clip_low,
        clip_high=step_config.clip_high,
        dual_clip_loss=step_config.dual_clip_loss,
        dual_clip_ratio=step_config.dual_clip_ratio,
        loss_agg_mode=step_config.loss_agg_mode,
        **denominators,
        **old_policy.correction_kwargs(step_config, mb),
        **loss_mode_kwargs(step_config, mb),
    )
    loss = pg_loss
    metrics = dict(metrics)
    metrics["pg_loss"] = pg_loss
    if step_config.use_kl_loss:
        kl_loss, metrics["kl_ref"] = _kl_loss(step_config, logp_BT, mb, denominators)
        loss = loss + step_config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    # Entropy is always reported; it only carries gradient when it is part of the loss.
    entropy_for_loss = entropy_BT if step_config.entropy_coef else jax.lax.stop_gradient(entropy_BT)
    entropy_loss = objectives.entropy_loss(
        entropy_for_loss, mask_BT, step_config.loss_agg_mode, **denominators
    )
    if step_config.entropy_coef:
        loss = loss - step_config.entropy_coef * entropy_loss
    metrics["entropy_loss"] = entropy_loss
    metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy_BT), mask_BT)
    if aux:
        router_aux = _router_aux_loss(stats[0], mb["attention_mask"], num_real_tokens)
        loss = loss + step_config.router_aux_loss_coef * router_aux
        metrics["router_aux_loss"] = router_aux
    metrics["loss"] = loss
    metrics.update(gap_sums(jax.lax.stop_gradient(logp_BT), mb["sampler_logprobs"], mask_BT))
    if step_config.is_moe:
        old_MBLX = jnp.moveaxis(mb["old_routing"], 0, 1)
        changed, total = routing_changes(old_MBLX, routing_MBLX, mb["attention_mask"])
        metrics["experts_changed"], metrics["experts_total"] = changed, total
    return loss, metrics


def _kl_loss(step_config: StepConfig, logp_BT, mb, denominators):
    """(the KL-to-π_ref loss term, the mean log-ratio to π_ref), over the response mask:
    a packed π_ref pass (make_logprobs_fn) leaves 0 at padding, where k3 of the padded
    step's log π could overflow."""
    mask_BT = mb["response_mask"]
    kl_BT = objectives.kl_penalty(
        logp_BT, mb["ref_logprobs"], step_config.kl_estimator, mask=mask_BT
    )
    kl_loss = objectives.aggregate_loss(kl_BT, mask_BT, step_config.loss_agg_mode, **denominators)
    return kl_loss, masked_mean(logp_BT - mb["ref_logprobs"], mask_BT)


def _router_aux_loss(stats, attention_mask_BL, num_real_tokens):
    """This micro-batch's share of the mini-batch's router load-balancing loss:
    (n_k / n) · load_balancing_loss(its stats), n_k its real tokens, n the mini-batch's.

    The loss (moe_aux.py) is a product of sums over the rows, so it does not split into
    micro-batches exactly; as transformers and Megatron under gradient accumulation, each
    micro-batch computes it on its own rows, and the shares sum to the real-token-weighted
    mean over the micro-batches: the loss itself with one micro-batch (the default)."""
    n_k = jnp.sum(attention_mask_BL.astype(jnp.float32))
    share = n_k / jnp.maximum(num_real_tokens, 1.0) if num_real_tokens is not None else 1.0
    return share * moe_aux.load_balancing_loss(*stats)


def loss_mode_kwargs(step_config: StepConfig, mb) -> dict:
    """`objectives.policy_loss`' loss-mode arguments; with off-policy sequence masking also
    μ, the sampler's log-probs (unless the rollout correction passes them already)."""
    kwargs = {
        name: getattr(step_config, name)
        for name in (
            "loss_mode",
            "sapo_tau_pos",
            "sapo_tau_neg",
            "dppo_delta_low",
            "dppo_delta_high",
            "dppo_max_weight",
            "opsm_delta",
        )
    }
    if step_config.opsm_delta is not None and not old_policy.corrects(step_config):
        kwargs["sampler_logprobs"] = mb["sampler_logprobs"]
    return kwargs


def _pass_logprobs(step_config: StepConfig, group: int, params, mb):
    """The π_old pass's forward of one micro-batch: the loss's own (`response_logprobs`)."""
    logp_BT, _, routing_MBLX = response_logprobs(
        step_config,
        params,
        mb["tokens"],
        mb["attention_mask"],
        mb["response_mask"].shape[1],
        group=group,
    )
    return logp_BT, routing_MBLX


def _micro_batching(step_config: StepConfig, mini_size: int) -> tuple[int, int]:
    """(micro-batches per mini-batch, `shared_group` of a micro-batch): the same for the π_old
    pass and the updates, so the first update recomputes π_old bit for bit."""
    micro = num_micro(step_config.micro_batch_size, mini_size)
    return micro, shared_group(step_config, step_config.num_mini_batches * micro)


def _mini_batch_grads(step_config: StepConfig, params, mini, *, frozen=None):
    """Accumulated gradient (of `params`, the trained leaves; `frozen`: the rest, LoRA's
    base weights, `lora.partition`) and metrics of one mini-batch over its micro-batches."""
    frozen = frozen or {}
    micro, group = _micro_batching(step_config, mini["tokens"].shape[0])
    mask_BT = mini["response_mask"]
    num_valid_tokens = jnp.sum(mask_BT)
    num_valid_seqs = jnp.sum(jnp.any(mask_BT > 0, axis=-1).astype(jnp.float32))
    num_real_tokens = jnp.sum(mini["attention_mask"].astype(jnp.float32))
    reductions = metric_reductions(step_config)

    def loss_fn(trained, *args):
        return _micro_loss(
            step_config,
            lora.combine(frozen, trained),
            *args,
            group=group,
            num_real_tokens=num_real_tokens,
        )

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    micro_batches = jax.tree.map(lambda x: strided_split(x, micro), mini)
    # Initial accumulators come from the metric names of one (abstract) call.
    names = jax.eval_shape(
        lambda: loss_fn(params, jax.tree.map(lambda x: x[0], micro_batches), 1.0, 1.0)[1]
    )
    init_metrics = init_micro(reductions, names)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, mb):
        grads_acc, metrics_acc = carry
        (_, metrics), grads = grad_fn(params, mb, num_valid_tokens, num_valid_seqs)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        mb_mask = mb["response_mask"]
        mb_tokens = jnp.sum(mb_mask)
        mb_seqs = jnp.sum(jnp.any(mb_mask > 0, axis=-1).astype(jnp.float32))
        metrics_acc = combine_micro(metrics_acc, metrics, mb_tokens, mb_seqs, reductions)
        return (grads_acc, metrics_acc), None

    if micro == 1:
        (grads, metrics), _ = body(
            (zero_grads, init_metrics), jax.tree.map(lambda x: x[0], micro_batches)
        )
    else:
        (grads, metrics), _ = jax.lax.scan(body, (zero_grads, init_metrics), micro_batches)
    return grads, finish_micro(metrics, reductions)


def _update(step_config: StepConfig, tx, mini_batches, carry, u):
    """Optimizer update u on mini-batch u mod num_mini_batches. A non-finite gradient, or a
    finite one the optimizer turned into a non-finite update (a NaN learning rate, eps = 0),
    never reaches the params or the moments: the update is skipped and counted."""
    step, all_params, opt_state = carry
    # Only the trained leaves get gradients and moments: LoRA's adapters, else all.
    frozen, params = lora.partition(all_params)
    mini = jax.tree.map(lambda x: x[u % step_config.num_mini_batches], mini_batches)
    grads, metrics = _mini_batch_grads(step_config, params, mini, frozen=frozen)
    grad_norm = optax.tree.norm(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    raw_update_norm = optax.tree.norm(updates)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(raw_update_norm)
    # |update| / |params| of the params the update applies to: a sane learning rate moves
    # them by a small fraction per update; one near or above 1 rewrites the model (the
    # loop warns, naming optim.learning_rate).
    update_ratio = raw_update_norm / jnp.maximum(optax.tree.norm(params), 1e-30)
    params = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_params, params)
    opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_opt_state, opt_state)
    metrics = dict(
        metrics,
        grad_norm=grad_norm,
        update_norm=jnp.where(finite, raw_update_norm, 0.0),
        update_ratio=jnp.where(finite, update_ratio, 0.0),
        skipped=1.0 - finite.astype(jnp.float32),
    )
    params = lora.combine(frozen, params)
    return (step + finite.astype(step.dtype), params, opt_state), metrics


def train_step(step_config: StepConfig, tx: optax.GradientTransformation, state: TrainState, batch):
    """ppo_epochs × num_mini_batches optimizer updates on one rollout batch.

    Returns the new state (its `step` counts the updates applied, skipped ones excluded)
    and a flat dict of f32 values:
      the loss's metrics (objectives.policy_loss) and the step's (loss, kl_loss, entropy,
        grad_norm, update_norm, MoE expert_change), each reduced over the updates as
        `metric_reductions` declares (most: the mean);
      router_aux_loss (MoE, `router_aux_loss_coef` > 0): the router load-balancing loss
        (models/moe_aux.py) before its coefficient, already inside `loss`;
      update_ratio: the largest |update| / |params| of the step's applied updates (0 for
        a skipped one);
      skipped_updates (a count); optimizer_step (the new state's update counter: the
        learning-rate schedule's position);
      ratio_noise_floor: max |r − 1| at the first update, whose params are π_old's (0 when
        π_old is recomputed; the train/inference mismatch with sampler log-probs);
      sampler/logprob_gap_mean, sampler/logprob_gap_max (|log π_trainer − log π_sampler|
        per token) and sampler/seq_logprob_gap_max (per sequence, of the token mean: the
        shift of log s_i), from the first update's forward on mini-batch 0;
      updates/<key> arrays [U], one value per update, of every metric declared per update.
    """
    mini_batches = jax.tree.map(lambda x: strided_split(x, step_config.num_mini_batches), batch)
    micro, group = _micro_batching(step_config, mini_batches["tokens"].shape[1])
    pass_fn = functools.partial(
        old_policy.old_policy_pass,
        step_config,
        micro_logprobs=functools.partial(_pass_logprobs, step_config, group),
        num_micro=micro,
    )
    mini_batches = old_policy.attach(step_config, state.params, mini_batches, pass_fn)
    update = functools.partial(_update, step_config, tx, mini_batches)
    carry = (state.step, state.params, state.opt_state)
    if step_config.num_updates == 1:  # one update per rollout: no loop (its carry copied the state)
        (step, params, opt_state), metrics = update(carry, 0)
        per_update = jax.tree.map(lambda x: x[None], metrics)
    else:
        (step, params, opt_state), per_update = jax.lax.scan(
            update, carry, jnp.arange(step_config.num_updates)
        )
    metrics = step_metrics(step_config, per_update)
    metrics["optimizer_step"] = step.astype(jnp.float32)
    return TrainState(step=step, params=params, opt_state=opt_state), metrics
