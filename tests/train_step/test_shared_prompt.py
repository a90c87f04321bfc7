"""The prompt once per group in training: hidden states, log-probs, losses and gradients
equal the repeated-prompt computation (f32, left-padded prompts, responses ending early,
all three ratio modes, micro-batches)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
from gspo_jax import models, train_step
from gspo_jax.config.specs import step_config
from gspo_jax.train_step import step as step_lib

FIXTURE = "tests/fixtures/models/qwen2"  # q/k/v biases, tied embeddings
N, G, P, T = 2, 4, 6, 5
B = N * G


@pytest.fixture(scope="module")
def model():
    return models.load_pretrained(FIXTURE)


def _rows(cfg, seed=0):
    """N left-padded prompts, G responses each (some ending early), and the repeated rows."""
    rng = np.random.default_rng(seed)
    prompt_NP = rng.integers(3, cfg.vocab_size, (N, P)).astype(np.int32)
    prompt_mask_NP = np.ones((N, P), np.int32)
    prompt_mask_NP[0, :2] = 0  # prompt 0 is two tokens shorter: left padding
    prompt_NP[0, :2] = 0
    response_BT = rng.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
    lengths = np.array([T, 1, 3, T, 2, T, 4, 1])
    response_mask_BT = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    tokens_BL = np.concatenate([np.repeat(prompt_NP, G, 0), response_BT], 1)
    mask_BL = np.concatenate([np.repeat(prompt_mask_NP, G, 0), response_mask_BT], 1)
    return prompt_NP, prompt_mask_NP, response_BT, response_mask_BT, tokens_BL, mask_BL


def _sc(cfg, **overrides):
    sc = step_config(base_config.get_config(), cfg)
    overrides = {"packing": False, **overrides}  # padded rows (packed: test_packing.py)
    return dataclasses.replace(sc, group_size=G, horizon=T, **overrides)


def test_hidden_states_equal_the_repeated_prompt(model):
    cfg, params = model
    prompt_NP, prompt_mask_NP, response_BT, response_mask_BT, tokens_BL, mask_BL = _rows(cfg)
    prompt_NPD, response_BTD = models.hidden_states_shared(
        cfg, params, prompt_NP, prompt_mask_NP, response_BT, response_mask_BT
    )
    full_BLD, _ = models.hidden_states(cfg, params, tokens_BL, mask_BL)
    shared_BLD = np.concatenate([np.repeat(prompt_NPD, G, 0), response_BTD], 1)
    real = mask_BL.astype(bool)
    assert real.sum() < real.size  # padding on both sides, compared where it is real
    np.testing.assert_allclose(shared_BLD[real], np.asarray(full_BLD)[real], atol=1e-5)


def test_logprobs_fn_equals_the_repeated_prompt(model):
    """π_old / π_ref pass: the rollout's rows, each prompt once (group G) vs G times."""
    cfg, params = model
    *_, tokens_BL, mask_BL = _rows(cfg)
    shared = train_step.make_logprobs_fn(_sc(cfg, shared_prompt=True))
    plain = train_step.make_logprobs_fn(_sc(cfg, shared_prompt=False))
    assert train_step.shared_group(_sc(cfg, shared_prompt=True), 1) == G
    for a, b in zip(shared(params, tokens_BL, mask_BL, T), plain(params, tokens_BL, mask_BL, T)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-5)


def _grads(sc, params, batch):
    return jax.jit(step_lib._mini_batch_grads, static_argnums=0)(sc, params, batch)


@pytest.mark.parametrize("mode, micro", [("token", None), ("seq", 4), ("seq_token", None)])
def test_loss_and_gradients_equal_the_repeated_prompt(model, mode, micro):
    """One mini-batch's loss, metrics and accumulated gradient; micro-batches of 4 rows
    keep 2 responses of each prompt together (group 2), the whole batch all G (group 4)."""
    cfg, params = model
    *_, tokens_BL, mask_BL = _rows(cfg, seed=1)
    mask_BT = mask_BL[:, P:].astype(np.float32)
    logp_BT, _, _ = train_step.make_logprobs_fn(_sc(cfg, shared_prompt=False))(
        params, tokens_BL, mask_BL, T
    )
    rng = np.random.default_rng(2)
    batch = {
        "tokens": jnp.asarray(tokens_BL),
        "attention_mask": jnp.asarray(mask_BL),
        "response_mask": jnp.asarray(mask_BT),
        # π_old off the current policy, so ratios leave 1 and the clip acts on some rows
        "old_logprobs": logp_BT + jnp.asarray(rng.normal(0, 0.3, (B, T)), jnp.float32),
        "sampler_logprobs": logp_BT,  # only read by the train/inference gap metrics
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
    }
    kw = {"importance_sampling": mode, "micro_batch_size": micro, "num_mini_batches": 1}
    shared_sc, plain_sc = _sc(cfg, shared_prompt=True, **kw), _sc(cfg, shared_prompt=False, **kw)
    assert train_step.shared_group(shared_sc, B // (micro or B)) == (2 if micro else G)
    shared_grads, shared_metrics = _grads(shared_sc, params, batch)
    plain_grads, plain_metrics = _grads(plain_sc, params, batch)
    assert float(plain_metrics["clipfrac"]) > 0 or mode != "token"
    for key in plain_metrics:
        # gap_*: |log π − the plain pass's own log π|, 0 on the plain side, float noise here
        atol = 1e-5 if key.startswith("gap") else 1e-6
        np.testing.assert_allclose(
            shared_metrics[key], plain_metrics[key], rtol=1e-5, atol=atol, err_msg=key
        )
    largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain_grads))
    assert largest > 1e-3  # a real gradient, not zeros on both sides
    paths = jax.tree_util.tree_flatten_with_path(plain_grads)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(shared_grads)):
        np.testing.assert_allclose(b, a, atol=1e-5 * largest, err_msg=jax.tree_util.keystr(path))


def test_split_that_breaks_groups_falls_back_to_repeated_prompts(model):
    cfg, _ = model
    sc = _sc(cfg, shared_prompt=True)
    assert train_step.shared_group(sc, 4) == 1  # 4 parts of a group of 4: one row each
    assert train_step.shared_group(sc, 3) == 1  # 3 does not divide G
    assert train_step.shared_group(dataclasses.replace(sc, shared_prompt=False), 1) == 1
