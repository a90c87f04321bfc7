"""The forward's router load statistics (`models.hidden_states(..., router_stats=True)`,
summed over the MoE layers by the layer stack) against a layer-by-layer reference: each
MoE layer's router logits recomputed from its input, then the float64 NumPy statistics
and loss of transformers' `load_balancing_loss_func` (tests/models/test_moe_aux.py's
reference), padding masked; scanned runs and the unscanned loop, several runs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_aux import _np_reference

from gspo_jax import models
from gspo_jax.models import moe_aux

# 5 layers, MoE at 1, 2 and 4: runs (dense), 2 x (MoE) scanned, (dense, MoE).
CFG = models.ModelConfig(
    arch="qwen3_moe",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=8,
    norm_topk_prob=True,
    mlp_only_layers=(0, 3),
    moe_impl="dense",
)


def _router_logits(cfg, params, tokens, mask):
    """[M, B·L, E] router logits, one Block per layer in a Python loop: each MoE layer's
    input (post-attention norm of the residual) times its router kernel, in float64."""
    from gspo_jax.models.contexts import full_context
    from gspo_jax.models.layer_stack import _merge_block
    from gspo_jax.models.layers import rope_cos_sin

    x = jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(cfg.dtype)
    cos, sin = rope_cos_sin(cfg, models.positions_from_mask(mask))
    context = full_context(cfg, mask)
    stacks, dense, moe, out = params["layers"], 0, 0, []
    for i in range(cfg.num_layers):
        layer = {
            k: jax.tree.map(lambda a, i=i: a[i], stacks[k])
            for k in stacks
            if k not in ("mlp", "moe")
        }
        is_moe = cfg.is_moe_layer(i)
        kind, index = ("moe", moe) if is_moe else ("mlp", dense)
        layer["mlp"] = jax.tree.map(lambda a, j=index: a[j], stacks[kind])
        block = _merge_block(cfg, is_moe, layer)
        if is_moe:
            h = block.attn(block.input_norm(x), cos, sin, lambda q, k, v: context(None, q, k, v))[0]
            normed = np.asarray(block.post_attn_norm(x + h), np.float64)
            kernel = np.asarray(layer["mlp"]["router"]["kernel"], np.float64)
            out.append(normed.reshape(-1, cfg.hidden_size) @ kernel)
            moe += 1
        else:
            dense += 1
        x = block(x, cos, sin, lambda q, k, v: context(None, q, k, v))[0]
    return np.stack(out)


def _np_stats(logits_MJE, k, mask_J):
    counts, probs, rows = 0.0, 0.0, 0.0
    for layer in logits_MJE:
        p = np.exp(layer - layer.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        onehot = np.zeros_like(p)
        np.put_along_axis(onehot, top, 1.0, axis=-1)
        counts = counts + (onehot * mask_J[:, None]).sum(0)
        probs = probs + (p * mask_J[:, None]).sum(0)
        rows += mask_J.sum()
    return counts, probs, rows


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "scan_layers=False"])
def test_pooled_stats_equal_a_layer_by_layer_reference(scan):
    cfg = dataclasses.replace(CFG, scan_layers=scan)
    assert [(r.kinds, r.repeats) for r in models.layer_runs(cfg)] == [
        ((False,), 1),
        ((True,), 2),
        ((False, True), 1),
    ]
    rng = np.random.default_rng(3)
    params = jax.tree.map(
        lambda a: jnp.asarray(0.5 * rng.normal(size=a.shape), a.dtype),
        models.abstract_params(cfg),
    )
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    mask = np.ones((3, 9), np.int32)
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    hidden, routing, (counts, probs, rows) = models.hidden_states(
        cfg, params, tokens, jnp.asarray(mask), router_stats=True
    )
    # The statistics change nothing else.
    hidden0, routing0 = models.hidden_states(cfg, params, tokens, jnp.asarray(mask))
    np.testing.assert_array_equal(hidden, hidden0)
    np.testing.assert_array_equal(routing, routing0)

    logits = _router_logits(cfg, params, tokens, jnp.asarray(mask))
    m = mask.reshape(-1).astype(np.float64)
    want_counts, want_probs, want_rows = _np_stats(logits, cfg.num_experts_per_tok, m)
    assert float(rows) == want_rows == 3 * mask.sum()
    np.testing.assert_array_equal(counts, want_counts)  # no near-ties at these logits
    np.testing.assert_allclose(probs, want_probs, rtol=2e-5)
    got = float(moe_aux.load_balancing_loss(counts, probs, rows))
    assert got == pytest.approx(_np_reference(logits, cfg.num_experts_per_tok, m), rel=2e-5)


def test_stats_count_the_routers_own_choice_under_replay():
    """Under Routing Replay the counts are of the router's own top-k (what transformers'
    loss sees), not of the forced experts that run: one MoE layer, so the router's input
    does not depend on the forced choice either."""
    cfg = dataclasses.replace(CFG, num_layers=1, mlp_only_layers=())
    rng = np.random.default_rng(4)
    params = jax.tree.map(
        lambda a: jnp.asarray(0.5 * rng.normal(size=a.shape), a.dtype),
        models.abstract_params(cfg),
    )
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    mask = jnp.ones((2, 5), jnp.int32)
    _, own, free = models.hidden_states(cfg, params, tokens, mask, router_stats=True)
    forced = (own + 1) % cfg.num_experts
    _, _, replayed = models.hidden_states(
        cfg, params, tokens, mask, routing=forced, router_stats=True
    )
    for a, b in zip(free, replayed):
        np.testing.assert_array_equal(a, b)
    own_counts = np.bincount(np.asarray(own).reshape(-1), minlength=cfg.num_experts)
    np.testing.assert_array_equal(replayed[0], own_counts)
    assert not np.array_equal(replayed[0], np.bincount(np.asarray(forced).reshape(-1), minlength=8))


def test_dense_models_have_no_router_stats():
    cfg = dataclasses.replace(CFG, arch="qwen3", num_experts=0, mlp_only_layers=())
    params = models.abstract_params(cfg)
    with pytest.raises(ValueError, match="router_stats needs a Mixture-of-Experts model"):
        jax.eval_shape(
            lambda p: models.hidden_states(
                cfg, p, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4)), router_stats=True
            ),
            params,
        )
