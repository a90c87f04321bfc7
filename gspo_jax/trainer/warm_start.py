"""Supervised warm start on the task itself, so RL starts from a non-trivial policy.

A model trained from scratch never emits a well-formed answer, so every reward is 0, every
group has zero variance and GSPO/GRPO have no signal. A few hundred steps of next-token
cross-entropy on (prompt, "#### answer<|im_end|>") pairs fix that. Only used by configs that
start from scratch (`WarmStartSpec.steps` > 0, from config.warm_start); RL gets a fresh
optimizer afterwards.

Shapes: N examples, L = P + R tokens (prompt left-padded into P columns, then the answer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from gspo_jax import data, models
from gspo_jax import sharding as sharding_lib
from gspo_jax.algorithm import logprobs as logprobs_lib
from gspo_jax.config.specs import PromptSpec, WarmStartSpec
from gspo_jax.models import moe_aux

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmStartResult:
    """What a warm start did: SFT steps run, (step, accuracy) of each check (trained to a
    target), and whether the target was reached (None: no target)."""

    steps: int
    checks: tuple[tuple[int, float], ...] = ()
    reached: bool | None = None

    def describe(self) -> str:
        if self.reached is None:
            return f"{self.steps} supervised warm-start steps"
        last = self.checks[-1][1] if self.checks else float("nan")
        if self.reached:
            return f"{self.steps} supervised warm-start steps (target reached: {last:.1%})"
        return f"{self.steps} supervised warm-start steps (target NOT reached: {last:.1%})"


def sft_loss(
    model_config,
    params,
    tokens_NL,
    attention_mask_NL,
    loss_mask_NL,
    chunk_size=256,
    router_aux_loss_coef=0.0,
):
    """Mean negative log-likelihood of the loss-masked tokens (token t predicted at t−1),
    plus, with `router_aux_loss_coef` > 0 (MoE), that times the router load-balancing loss
    of every real token (models/moe_aux.py; as `Qwen3MoeForCausalLM` adds it).

    Returns (loss, {"sft/loss": the NLL, "sft/tokens": supervised tokens, and
    "sft/router_aux_loss" when it is on}).
    """
    aux = router_aux_loss_coef > 0
    hidden_NLD, _, *stats = models.hidden_states(
        model_config, params, tokens_NL, attention_mask_NL, router_stats=aux
    )
    logp_NT = logprobs_lib.token_logprobs(
        hidden_NLD[:, :-1],
        models.unembedding(model_config, params),
        tokens_NL[:, 1:],
        chunk_size=chunk_size,
    )
    mask_NT = loss_mask_NL[:, 1:].astype(jnp.float32)
    num_tokens = jnp.sum(mask_NT)
    nll = -jnp.sum(logp_NT * mask_NT) / jnp.maximum(num_tokens, 1.0)
    metrics = {"sft/loss": nll, "sft/tokens": num_tokens}
    if not aux:
        return nll, metrics
    metrics["sft/router_aux_loss"] = moe_aux.load_balancing_loss(*stats[0])
    return nll + router_aux_loss_coef * metrics["sft/router_aux_loss"], metrics


def make_sft_optimizer(spec: WarmStartSpec) -> optax.GradientTransformation:
    """AdamW with 10% linear warm-up then cosine decay over the warm-start steps (to 0.1 of
    the peak, which holds past them: a warm start trained to a target may run longer)."""
    steps = max(int(spec.steps), 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=spec.learning_rate,
        warmup_steps=max(steps // 10, 1),
        decay_steps=steps,
        end_value=spec.learning_rate * 0.1,
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))


def make_sft_step(
    model_config,
    tx: optax.GradientTransformation,
    *,
    chunk_size: int = 256,
    state_shardings: tuple | None = None,
    router_aux_loss_coef: float = 0.0,
):
    """Jitted (params, opt_state, batch) -> (params, opt_state, metrics); both states donated.

    `state_shardings` = (param shardings, optimizer-state shardings) pins both states'
    layout in and out; the batch keeps the layout `sharding.to_global` gave it.
    """

    def step(params, opt_state, batch):
        loss_fn = functools.partial(
            sft_loss,
            model_config,
            tokens_NL=batch["tokens"],
            attention_mask_NL=batch["attention_mask"],
            loss_mask_NL=batch["loss_mask"],
            chunk_size=chunk_size,
            router_aux_loss_coef=router_aux_loss_coef,
        )
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, metrics

    kwargs = {}
    if state_shardings is not None:
        kwargs["in_shardings"] = (*state_shardings, None)
        kwargs["out_shardings"] = (*state_shardings, None)
    return jax.jit(step, donate_argnums=(0, 1), **kwargs)


def warm_start(
    model_config,
    params,
    source,
    tokenizer,
    mesh,
    *,
    spec: WarmStartSpec,
    prompt: PromptSpec,
    data_spec,
    progress: bool = True,
    param_shardings=None,
    check: Callable | None = None,
):
    """SFT steps on (prompt, target) pairs of `source`; returns (params, WarmStartResult).

    `spec.steps` steps, or with `spec.target_accuracy` until `check(params)` (a greedy
    accuracy in [0, 1]: the loop's is on the first `spec.check_prompts` train-split
    problems) reaches it, checked every `spec.check_every` steps and at `spec.steps`, up to
    `spec.max_steps`. Short of the target at max_steps it warns and returns what it has.
    Why a target: this tiny task's warm start ends at very different accuracies with the
    CPU type's last-bit numerics or the seed (README, "The default run"); a target makes
    RL start from the same accuracy everywhere.

    With `spec.teacher_error_rate` > 0 the demonstrations come from an imperfect teacher
    (`data.NoisyTeacher`: carries dropped on that fraction of carrying additions).

    Targets follow the dataset's template (`data_spec.target_template`, e.g. "#### {answer}")
    plus the end token, laid out exactly as RL rollouts are (prompts templated and
    left-padded as `prompt` says), so the warm-started policy's first RL samples look the
    same. `param_shardings` (default: replicated over `mesh`) keeps params and the
    optimizer's moments sharded through the warm start.
    """
    target = spec.target_accuracy
    if target is not None and check is None:
        raise ValueError("warm_start: target_accuracy needs a `check` (params -> accuracy)")
    steps = int(spec.steps) if target is None else max(int(spec.max_steps), int(spec.steps))
    opt_state, step_fn = _sft_state(model_config, params, spec, mesh, param_shardings)
    it = demonstrations(source, tokenizer, spec, prompt, data_spec)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="warm start", dynamic_ncols=True)
    if target is not None:
        log.info(
            "warm start: until greedy accuracy %.3f on %d train-split problems, checked every "
            "%d steps, at most %d steps (warm_start.target_accuracy; 0: exactly %d steps)",
            target,
            spec.check_prompts,
            spec.check_every,
            steps,
            spec.steps,
        )
    checks: list[tuple[int, float]] = []
    shown: dict[str, str] = {}  # the bar's postfix: the loss and the last check
    done, reached = 0, None if target is None else False
    while done < steps:
        batch = next(it)
        batch = sharding_lib.to_global(
            mesh, {k: batch[k] for k in ("tokens", "attention_mask", "loss_mask")}
        )
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        done += 1
        if bar is not None:
            if done % 20 == 1 or done == steps:
                shown["loss"] = f"{float(metrics['sft/loss']):.3f}"
                bar.set_postfix(shown, refresh=False)
            bar.update(1)
        if target is not None and (done % spec.check_every == 0 or done in (spec.steps, steps)):
            checks.append((done, float(check(params))))
            log.info(
                "warm start step %d: greedy accuracy %.3f on the check problems (target %.3f)",
                done,
                checks[-1][1],
                target,
            )
            if bar is not None:
                shown["acc"], shown["target"] = f"{checks[-1][1]:.1%}", f"{target:.1%}"
                bar.set_postfix(shown)
            if checks[-1][1] >= target:
                reached = True
                break
    if bar is not None:
        bar.close()
    if reached is False:
        _warn_short(done, target, checks)
    return params, WarmStartResult(steps=done, checks=tuple(checks), reached=reached)


def _sft_state(model_config, params, spec: WarmStartSpec, mesh, param_shardings):
    """(the optimizer state, the jitted SFT step), both laid out like `param_shardings`
    (default: replicated over `mesh`)."""
    tx = make_sft_optimizer(spec)
    abstract = models.abstract_params(model_config)
    if param_shardings is None:
        param_shardings = jax.tree.map(lambda _: sharding_lib.replicated(mesh), abstract)
    opt_shardings = sharding_lib.optimizer_state_shardings(tx, abstract, param_shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step_fn = make_sft_step(
        model_config,
        tx,
        chunk_size=spec.chunk_size,
        state_shardings=(param_shardings, opt_shardings),
        router_aux_loss_coef=spec.router_aux_loss_coef,
    )
    return opt_state, step_fn


def demonstrations(source, tokenizer, spec: WarmStartSpec, prompt: PromptSpec, data_spec):
    """The SFT batches of `source` (through the imperfect teacher when
    `spec.teacher_error_rate` > 0), this process's share of each."""
    if spec.teacher_error_rate:
        source = data.NoisyTeacher(source, spec.teacher_error_rate, seed=spec.seed)
    return data.make_sft_iterator(
        source,
        tokenizer,
        batch_size=spec.batch_size // jax.process_count(),
        prompt_length=prompt.prompt_length,
        response_length=spec.response_length,
        seed=spec.seed,
        answer_key=data_spec.answer_key,
        target_template=data_spec.target_template,
        system_prompt=prompt.system_prompt,
        instruction=prompt.instruction,
        chat_template=prompt.chat_template,
        chat_template_kwargs=prompt.kwargs()["chat_template_kwargs"],
        overlong=prompt.overlong,
    )


def _warn_short(done: int, target: float, checks) -> None:
    log.warning(
        "warm start: %d steps (warm_start.max_steps) did not reach "
        "warm_start.target_accuracy=%.3f (last check: %.3f); RL starts from there. Raise "
        "warm_start.max_steps or lower the target.",
        done,
        target,
        checks[-1][1] if checks else float("nan"),
    )
