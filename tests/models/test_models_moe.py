"""MoE specification: routing, Routing Replay (paper §5.3), dense == ragged experts.

- top-k routing equals a NumPy reference (softmax, top-k, renormalised gates);
- forcing the model's own routing reproduces the unforced logits exactly; forcing other
  experts changes them; the router still receives gradient under forced routing;
- routing_disagreement is 0 for identical params and > 0 after perturbing a router;
- moe_impl "dense" and "ragged" agree in value and gradient;
- under a mesh the ragged experts run per device (each sorts its own tokens) and agree
  with one device.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from routing_checks import routing_disagreement

from gspo_jax import models
from gspo_jax.models.layers import route

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"


@pytest.fixture(scope="module")
def moe():
    cfg, params = models.load_pretrained(FIXTURES / "qwen3_moe")
    ref = dict(np.load(FIXTURES / "reference_qwen3_moe.npz"))
    return cfg, params, jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask_left"])


def test_route_matches_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 6)).astype(np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    chosen = np.take_along_axis(probs, top, -1)
    for norm in (False, True):
        gates, idx = route(jnp.asarray(logits), 2, norm)
        np.testing.assert_array_equal(idx, top)
        want = chosen / chosen.sum(-1, keepdims=True) if norm else chosen
        np.testing.assert_allclose(gates, want, rtol=1e-6)
    forced = np.array([[5, 0]] * 5, np.int32)
    gates, idx = route(jnp.asarray(logits), 2, True, jnp.asarray(forced))
    np.testing.assert_array_equal(idx, forced)
    f = np.take_along_axis(probs, forced, -1)
    np.testing.assert_allclose(gates, f / f.sum(-1, keepdims=True), rtol=1e-6)


def test_routing_output_format(moe):
    cfg, params, tokens, mask = moe
    _logits, routing = models.forward_with_routing(cfg, params, tokens, mask)
    assert routing.shape == (cfg.num_moe_layers, *tokens.shape, cfg.num_experts_per_tok)
    assert routing.dtype == jnp.int32
    r = np.asarray(routing)
    assert r.min() >= 0 and r.max() < cfg.num_experts
    assert np.all(r[..., 0] != r[..., 1])  # k distinct experts per token
    _hidden, routing_h = models.hidden_states(cfg, params, tokens, mask)
    np.testing.assert_array_equal(routing, routing_h)


def test_forced_own_routing_reproduces_output_and_other_routing_changes_it(moe):
    cfg, params, tokens, mask = moe
    logits, routing = models.forward_with_routing(cfg, params, tokens, mask)
    replay, replay_routing = models.forward_with_routing(cfg, params, tokens, mask, routing=routing)
    np.testing.assert_array_equal(replay, logits)
    np.testing.assert_array_equal(replay_routing, routing)
    # Shift every choice to another expert (keeps the k choices distinct).
    other = (routing + 1) % cfg.num_experts
    changed = np.asarray(models.forward(cfg, params, tokens, mask, routing=other))
    valid = np.asarray(mask).astype(bool)
    assert np.abs(changed - np.asarray(logits))[valid].min() > 0  # every real token moved
    with pytest.raises(ValueError, match="routing has shape"):
        models.forward(cfg, params, tokens, mask, routing=routing[:1])


def test_forced_routing_in_prefill_and_decode(moe):
    """prefill/decode return and accept routing in the same format as forward."""
    cfg, params, tokens, mask = moe
    _, routing = models.forward_with_routing(cfg, params, tokens, mask)
    cache, _, r_pre = models.prefill_shared(cfg, params, tokens[:, :9], mask[:, :9])
    # Padding tokens route arbitrarily (their attention has no real key); compare real ones.
    real = np.asarray(mask[:, :9]).astype(bool)
    np.testing.assert_array_equal(
        np.asarray(r_pre)[:, real], np.asarray(routing)[:, :, :9][:, real]
    )
    response = models.init_response_cache(cfg, tokens.shape[0], 1)
    _, _, r_dec = models.decode_step_shared(
        cfg, params, cache, response, tokens[:, 9], 0, routing=routing[:, :, 9:]
    )
    np.testing.assert_array_equal(r_dec, routing[:, :, 9:])


def test_router_gets_gradient_under_forced_routing(moe):
    cfg, params, tokens, mask = moe
    _, routing = models.forward_with_routing(cfg, params, tokens, mask)

    def loss(p):
        return jnp.mean(models.forward(cfg, p, tokens, mask, routing=routing) ** 2)

    grads = jax.grad(loss)(params)
    router_grad = grads["layers"]["moe"]["router"]["kernel"][0]  # MoE layer 0 = layer 0
    assert np.abs(np.asarray(router_grad)).max() > 0


def test_routing_disagreement(moe):
    cfg, params, tokens, mask = moe
    same = float(routing_disagreement(cfg, params, params, tokens, mask))
    assert same == 0.0
    perturbed = jax.tree.map(lambda x: x, params)
    routers = perturbed["layers"]["moe"]["router"]["kernel"]  # [M, D, E]; MoE 1 = layer 2
    noise = jax.random.normal(jax.random.key(0), routers.shape[1:])
    perturbed["layers"]["moe"]["router"] = {"kernel": routers.at[1].add(0.5 * noise)}
    frac = float(routing_disagreement(cfg, params, perturbed, tokens, mask))
    # Only the last MoE layer (one of two) changed: at most half of all decisions differ.
    assert 0 < frac <= 0.5
    # Matches a direct count from the two routings.
    _, ra = models.forward_with_routing(cfg, params, tokens, mask)
    _, rb = models.forward_with_routing(cfg, perturbed, tokens, mask)
    ra, rb, m = np.asarray(ra), np.asarray(rb), np.asarray(mask).astype(bool)
    differ = sum(
        len(set(ra[l, b, t]) - set(rb[l, b, t]))
        for l in range(ra.shape[0])
        for b in range(ra.shape[1])
        for t in range(ra.shape[2])
        if m[b, t]
    )
    np.testing.assert_allclose(frac, differ / (m.sum() * ra.shape[0] * ra.shape[3]), rtol=1e-6)


def test_dense_and_ragged_experts_agree_in_value_and_gradient(moe):
    cfg, params, tokens, mask = moe
    assert cfg.moe_impl == "ragged"  # the default
    dense_cfg = dataclasses.replace(cfg, moe_impl="dense")

    def loss(c, p):
        logits = models.forward(c, p, tokens, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)

    lr, gr = jax.value_and_grad(loss, argnums=1)(cfg, params)
    ld, gd = jax.value_and_grad(loss, argnums=1)(dense_cfg, params)
    np.testing.assert_allclose(lr, ld, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gd)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    expert_grad = gr["layers"]["moe"]["gate_proj"][0]
    assert np.abs(np.asarray(expert_grad)).max() > 0


def test_ragged_experts_per_device_under_a_mesh(moe):
    """Under a mesh (8 devices, rows over data x fsdp, experts over the expert axis) each
    device sorts its own tokens (shard_map): same logits, routing and gradients as on one
    device."""
    from jax.sharding import NamedSharding, PartitionSpec

    from gspo_jax import sharding as sharding_lib

    cfg, params, tokens, mask = moe
    tokens, mask = jnp.tile(tokens, (8, 1)), jnp.tile(mask, (8, 1))  # 8 x 3 = 24 rows

    def loss(p, t, m):
        logits, routing = models.forward_with_routing(cfg, p, t, m)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * m), routing

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    (want, want_routing), want_grads = grad_fn(params, tokens, mask)
    mesh = sharding_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2})
    shardings = sharding_lib.tree_shardings(params, models.logical_axes(cfg), mesh)
    rows = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES))
    sharded = jax.device_put(params, shardings)
    assert sharded["layers"]["moe"]["gate_proj"].sharding.spec[1] == "expert"
    with jax.set_mesh(mesh):
        t, m = jax.device_put(tokens, rows), jax.device_put(mask, rows)
        (got, got_routing), got_grads = jax.jit(grad_fn)(sharded, t, m)
        assert "manual" in jax.jit(grad_fn).lower(sharded, t, m).as_text().lower()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(got_routing, want_routing)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("layout", ["trainer", "tensor"])
def test_decode_experts_run_on_their_chips(moe, layout):
    """A decode step (one token per row) under a mesh whose expert axis splits the experts
    (8 = 2 per chip): each chip runs its own experts, outputs summed over the expert axis
    (and the MLP width's, split over fsdp in the rollout's tensor layout): the logits of
    one device, and no expert weight gathered in the program."""
    from gspo_jax import sharding as sharding_lib
    from gspo_jax.models import partition
    from tools import hlo_stats

    cfg, params, tokens, mask = moe
    tokens, mask = jnp.tile(tokens[:, -1:], (4, 1)), jnp.tile(mask[:, -1:], (4, 1))
    want = models.forward(cfg, params, tokens, mask)
    mesh = sharding_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 1, "expert": 4})
    rules = sharding_lib.layout_rules(layout)
    with jax.set_mesh(mesh), partition.layout(rules):
        abstract = jax.eval_shape(lambda p: p, params)
        shardings = sharding_lib.tree_shardings(
            abstract, models.logical_axes(cfg), mesh, rules or sharding_lib.LOGICAL_RULES
        )
        fn = jax.jit(lambda p, t, m: models.forward(cfg, models.for_decoding(cfg, p), t, m))
        sharded = jax.device_put(params, shardings)
        text = fn.lower(sharded, tokens, mask).compile().as_text()
        got = fn(sharded, tokens, mask)
    np.testing.assert_allclose(got, want, atol=2e-5)
    if layout == "tensor":  # its attention and MLP sum partial activations of their own
        return
    # Past the weights' gathers (for_decoding), the only collectives are the sums of the
    # experts' [rows, hidden] outputs: no routing metadata nor [rows, width] activations
    # moved, as GSPMD's own partitioning of a ragged_dot over split experts does.
    moved = {c.shape for c in hlo_stats.collectives(text) if c.kind != "all-gather"}
    assert moved and all(s.startswith("f32[") and s.endswith(f",{cfg.hidden_size}]") for s in moved)
