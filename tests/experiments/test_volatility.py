"""The MoE volatility measurement's own pieces (experiments/gspo_vs_grpo/volatility.py): the
free-vs-replayed log-prob difference Routing Replay acts on, its statistics, and the
optimizer whose learning rate lives in its state."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.gspo_vs_grpo import volatility
from gspo_jax import models

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "models"


@pytest.fixture(scope="module")
def moe():
    cfg, params = models.load_pretrained(FIXTURES / "qwen3_moe")
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 3, cfg.vocab_size)
    mask = jnp.ones_like(tokens)
    _, routing = models.forward_with_routing(cfg, params, tokens, mask)
    return cfg, params, tokens, mask, np.asarray(routing)


def test_own_routing_replayed_changes_nothing(moe):
    cfg, params, tokens, mask, routing = moe
    free, replay, again = volatility.free_vs_replayed(cfg, params, tokens, mask, routing)
    np.testing.assert_array_equal(np.asarray(again), routing)
    np.testing.assert_allclose(np.asarray(free), np.asarray(replay), atol=1e-6)
    assert volatility.gap_stats(free, replay, np.ones(free.shape))["max"] <= 1e-6


def test_a_changed_choice_moves_only_later_tokens(moe):
    """Row 0, position 5, MoE layer 0: one chosen expert swapped for an unchosen one. Tokens
    up to position 5 are predicted from positions < 5 (entries 0..3) and cannot change
    (causal attention); the replayed log-probs equal log_softmax of `models.forward` with
    the same routing forced, computed here in NumPy."""
    cfg, params, tokens, mask, routing = moe
    forced = routing.copy()
    unused = next(e for e in range(cfg.num_experts) if e not in forced[0, 0, 5])
    forced[0, 0, 5, 0] = unused
    free, replay, _ = volatility.free_vs_replayed(cfg, params, tokens, mask, jnp.asarray(forced))
    gap = np.abs(np.asarray(free) - np.asarray(replay))
    np.testing.assert_allclose(gap[0, :4], 0.0, atol=1e-6)
    np.testing.assert_allclose(gap[1], 0.0, atol=1e-6)  # row 1 keeps its routing
    assert gap[0, 5] > 1e-4  # token 6 is predicted at position 5
    logits = np.asarray(models.forward(cfg, params, tokens, mask, routing=jnp.asarray(forced)))
    z = logits[:, :-1].astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(replay), want, atol=1e-5)


def test_gap_stats_hand_values():
    free = np.array([[0.0, 1.0, 3.0], [2.0, 2.0, 2.0]])
    replay = np.array([[0.0, 0.0, 0.0], [2.0, 2.0, 7.0]])
    mask = np.array([[1, 1, 0], [0, 0, 0]])
    # valid |differences| [0, 1]: mean 0.5, p99 = 0 + 0.99·(1 − 0), max 1
    assert volatility.gap_stats(free, replay, mask) == pytest.approx(
        {"mean": 0.5, "p99": 0.99, "max": 1.0}
    )
    with pytest.raises(ValueError, match="no valid token"):
        volatility.gap_stats(free, replay, np.zeros_like(mask))


@pytest.mark.parametrize("first_only", [True, False])
def test_held_lr_scales_by_the_stored_rate(first_only):
    tx = volatility.held_lr()
    params = {"w": jnp.ones(3)}
    state = volatility.set_lr((tx.init(params),), 0.5, first_only)[0]
    grads = {"w": jnp.array([1.0, -2.0, 4.0])}
    first, state = tx.update(grads, state)
    second, _ = tx.update(grads, state)
    np.testing.assert_allclose(first["w"], [-0.5, 1.0, -2.0])
    np.testing.assert_allclose(second["w"], [0.0] * 3 if first_only else [-0.5, 1.0, -2.0])
