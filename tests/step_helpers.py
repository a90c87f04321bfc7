"""The train-step tests' shared builders: a step config at the base defaults, a random batch
on the Qwen3 fixture, a fresh train state, one compiled step per (config, optimizer)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import base as base_config
from gspo_jax.config.specs import step_config
from gspo_jax.train_step import StepConfig, TrainState, make_logprobs_fn, make_train_step

FIXTURE = "tests/fixtures/models/qwen3"
N, G, P, T = 4, 4, 6, 8  # prompts, group, prompt tokens, response tokens
B = N * G


def step_config_for(cfg, **overrides) -> StepConfig:
    """The train step's config at configs/base.py's defaults, with `overrides`. Every row
    of `train_batch` has its own prompt, so the prompt is not shared (test_shared_prompt.py),
    and the step runs padded rows (packing: test_packing.py)."""
    sc = step_config(base_config.get_config(), cfg)
    return dataclasses.replace(sc, shared_prompt=False, **{"packing": False, **overrides})


def train_batch(cfg, params, step_config, seed=0, *, advantages=None):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, cfg.vocab_size, (B, P + T)).astype(np.int32)
    attn = np.ones((B, P + T), np.int32)
    attn[::3, :2] = 0  # some left padding
    lengths = rng.integers(1, T + 1, B)
    resp_mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    attn[:, P:] = resp_mask
    del step_config  # π_old depends only on the model (temperature 1, default chunking)
    old, _, _ = compiled_logprobs(step_config_for(cfg))(params, tokens, attn, T)
    if advantages is None:
        advantages = rng.normal(size=B).astype(np.float32)
    return {
        "tokens": jnp.asarray(tokens),
        "attention_mask": jnp.asarray(attn),
        "response_mask": jnp.asarray(resp_mask),
        "sampler_logprobs": old,
        "advantages": jnp.asarray(advantages),
    }


def train_state(params, tx):
    params = jax.tree.map(jnp.copy, params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def optim_spec(lr=1e-2, max_grad_norm=1.0):
    from gspo_jax.train_step.optim import OptimSpec

    return OptimSpec(
        learning_rate=lr,
        schedule="constant",
        warmup_steps=0,
        end_lr_ratio=0.1,
        weight_decay=0.0,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        max_grad_norm=max_grad_norm,
        total_updates=100,
    )


@functools.cache
def optimizer(lr=1e-2):
    from gspo_jax.train_step.optim import make_optimizer

    return make_optimizer(optim_spec(lr))


@functools.cache
def compiled_step(sc: StepConfig, tx):
    """One compiled train step per (config, optimizer), shared across tests."""
    return make_train_step(sc, tx, donate=False)


@functools.cache
def compiled_logprobs(sc: StepConfig):
    return make_logprobs_fn(sc)


@functools.cache
def sgd():
    return optax.sgd(1.0)
