"""Supervised warm start on the task itself, so RL starts from a non-trivial policy.

A model trained from scratch never emits a well-formed answer, so every reward is 0, every
group has zero variance and GSPO/GRPO have no signal. A few hundred steps of next-token
cross-entropy on (prompt, "#### answer<|im_end|>") pairs fix that. Only used by configs that
start from scratch (`WarmStartSpec.steps` > 0, from config.warm_start); RL gets a fresh
optimizer afterwards.

Shapes: N examples, L = P + R tokens (prompt left-padded into P columns, then the answer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from gspo_jax import data, models
from gspo_jax import logprobs as logprobs_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.trainer.specs import PromptSpec, WarmStartSpec


def sft_loss(model_config, params, tokens_NL, attention_mask_NL, loss_mask_NL, chunk_size=256):
    """Mean negative log-likelihood of the loss-masked tokens (token t predicted at t−1).

    Returns (loss, number of supervised tokens).
    """
    hidden_NLD, _ = models.hidden_states(model_config, params, tokens_NL, attention_mask_NL)
    logp_NT = logprobs_lib.token_logprobs(
        hidden_NLD[:, :-1],
        models.unembedding(model_config, params),
        tokens_NL[:, 1:],
        chunk_size=chunk_size,
    )
    mask_NT = loss_mask_NL[:, 1:].astype(jnp.float32)
    num_tokens = jnp.sum(mask_NT)
    return -jnp.sum(logp_NT * mask_NT) / jnp.maximum(num_tokens, 1.0), num_tokens


def make_sft_optimizer(spec: WarmStartSpec) -> optax.GradientTransformation:
    """AdamW with 10% linear warm-up then cosine decay over the warm-start steps."""
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
        )
        (loss, num_tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"sft/loss": loss, "sft/tokens": num_tokens}

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
):
    """`spec.steps` SFT steps on (prompt, target) pairs of `source`; returns the new params.

    With `spec.teacher_error_rate` > 0 the demonstrations come from an imperfect teacher
    (`data.NoisyTeacher`: carries dropped on that fraction of carrying additions).

    Targets follow the dataset's template (`data_spec.target_template`, e.g. "#### {answer}")
    plus the end token, laid out exactly as RL rollouts are (prompts templated and
    left-padded as `prompt` says), so the warm-started policy's first RL samples look the
    same. `param_shardings` (default: replicated over `mesh`) keeps params and the
    optimizer's moments sharded through the warm start.
    """
    steps = int(spec.steps)
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
    )
    if spec.teacher_error_rate:
        source = data.NoisyTeacher(source, spec.teacher_error_rate, seed=spec.seed)
    it = data.make_sft_iterator(
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
        overlong=prompt.overlong,
    )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="warm start", dynamic_ncols=True)
    for i in range(steps):
        batch = next(it)
        batch = sharding_lib.to_global(
            mesh, {k: batch[k] for k in ("tokens", "attention_mask", "loss_mask")}
        )
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        if bar is not None:
            if i % 20 == 0 or i == steps - 1:
                bar.set_postfix(loss=f"{float(metrics['sft/loss']):.3f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    return params
