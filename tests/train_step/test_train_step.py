"""The single jitted train step: updates, clipping from the 2nd mini-batch, invariances."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from step_helpers import (
    FIXTURE,
    B,
    P,
    T,
    compiled_logprobs,
    compiled_step,
    optimizer,
    sgd,
    step_config_for,
    train_batch,
    train_state,
)

from gspo_jax import models, sharding
from gspo_jax.train_step import TrainState, make_train_step


@pytest.fixture(scope="module")
def model():
    cfg, params = models.load_pretrained(FIXTURE)
    return cfg, params


@pytest.fixture(scope="module")
def gspo_run(model):
    """One GSPO step at the paper's ε with 4 mini-batches (shared by several tests)."""
    cfg, params = model
    sc = step_config_for(cfg, num_mini_batches=4, horizon=T)
    tx = optimizer(1e-2)
    batch = train_batch(cfg, params, sc)
    state, metrics = compiled_step(sc, tx)(train_state(params, tx), batch)
    return params, state, jax.device_get(metrics)


def test_one_step_changes_params_and_metrics_are_finite(gspo_run):
    params, state, metrics = gspo_run
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, state.params)
    assert max(jax.tree.leaves(diff)) > 0
    for key, value in metrics.items():
        assert np.all(np.isfinite(value)), key


def test_number_of_updates_is_epochs_times_mini_batches(model):
    cfg, params = model
    for epochs, minis in [(2, 2), (1, 4)]:
        sc = step_config_for(cfg, num_mini_batches=minis, ppo_epochs=epochs, horizon=T)
        tx = optimizer()
        state, metrics = compiled_step(sc, tx)(
            train_state(params, tx), train_batch(cfg, params, sc)
        )
        assert int(state.step) == epochs * minis
        assert metrics["skipped_updates"] == 0
        for key in ("ratio_max", "loss", "grad_norm"):
            assert metrics[f"updates/{key}"].shape == (epochs * minis,), key
        # Adam's own counter agrees: every update really went through the optimizer.
        counts = [int(x) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) == 0]
        assert epochs * minis in counts


def test_first_mini_batch_is_on_policy_later_ones_clip_at_paper_eps(gspo_run):
    _, _, metrics = gspo_run
    rmin, rmax = metrics["updates/ratio_min"], metrics["updates/ratio_max"]
    clip = metrics["updates/clipfrac"]
    # Update 0 sees π_θ = π_old: the ratio is 1 (up to float rounding) and nothing clips.
    assert abs(rmin[0] - 1) < 1e-5 and abs(rmax[0] - 1) < 1e-5 and clip[0] == 0
    # Later mini-batches are off-policy: ratios leave 1 by more than GSPO's ε, so it clips.
    assert np.all(np.maximum(rmax[1:] - 1, 1 - rmin[1:]) > 4e-4)
    assert np.all(clip[1:] > 0)
    assert metrics["clipfrac_seq"] > 0


def test_grpo_clips_far_less_than_gspo_on_the_same_batch(model):
    """The paper's Fig. 4 direction: GSPO's sequence-level ε clips much more than GRPO's."""
    cfg, params = model
    fractions = {}
    for mode, lo, hi in [("seq", 3e-4, 4e-4), ("token", 0.2, 0.27)]:
        sc = step_config_for(cfg, importance_sampling=mode, clip_low=lo, clip_high=hi, horizon=T)
        tx = optimizer(1e-3)
        _, metrics = compiled_step(sc, tx)(
            train_state(params, tx), train_batch(cfg, params, sc, seed=3)
        )
        fractions[mode] = float(metrics["clipfrac"])
    assert fractions["seq"] > 10 * max(fractions["token"], 1e-6)


def test_micro_batching_does_not_change_the_step(model):
    """Plain SGD (lr 1): the param change *is* the accumulated gradient, so this compares the
    mini-batch gradients exactly (Adam would amplify float-order noise where grads are ~0)."""
    cfg, params = model
    results = []
    for micro in (None, 2):
        sc = step_config_for(cfg, num_mini_batches=2, micro_batch_size=micro, horizon=T)
        tx = sgd()
        state, metrics = compiled_step(sc, tx)(
            train_state(params, tx), train_batch(cfg, params, sc)
        )
        results.append((state.params, metrics))
    (p0, m0), (p1, m1) = results
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        # rtol: the two splits share each prompt over different group sizes (shared_prompt),
        # so sums run in another order (measured: at most 2.5e-6 relative)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss", "pg_loss", "clipfrac", "ratio_max", "grad_norm", "entropy"):
        np.testing.assert_allclose(m0[key], m1[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_sharding_8_ways_does_not_change_the_step(model):
    cfg, params = model
    sc = step_config_for(cfg, num_mini_batches=2, horizon=T)
    tx = sgd()  # compare gradients, see the micro-batch test
    batch = train_batch(cfg, params, sc)
    ref_state, ref_metrics = compiled_step(sc, tx)(train_state(params, tx), batch)

    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1, "expert": 1})
    abstract = models.abstract_params(cfg)
    p_shard = sharding.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    state_shardings = TrainState(
        step=sharding.replicated(mesh),
        params=p_shard,
        opt_state=sharding.optimizer_state_shardings(tx, abstract, p_shard, mesh),
    )
    state = jax.device_put(train_state(params, tx), state_shardings)
    sharded_batch = jax.device_put(batch, sharding.batch_shardings(mesh, batch))
    fn = make_train_step(sc, tx, state_shardings=state_shardings, mesh=mesh, donate=False)
    new_state, metrics = fn(state, sharded_batch)
    embed = new_state.params["embed"]["embedding"]
    assert len(embed.sharding.device_set) == 8  # really spread over the mesh
    # The two programs do the same f32 arithmetic in another order (per-device partial sums,
    # then a cross-device reduction). Reordering a sum of n terms moves it by at most about
    # n·u times the size of its terms (u = 2^-24, Higham §4.2): the gradient of a weight sums
    # over a mini-batch's n = B/2 · L token positions, and each param is p0 - Δ with |p0|, |Δ|
    # the sizes in play. This bound is ~30x what one Intel machine measured (≤ 3.4e-7) and 7x
    # what an AMD one did under load (1.55e-6, which failed a fixed atol of 1e-6); a layout bug
    # (a per-device denominator, a missing reduction) moves params by the size of Δ (~0.1).
    n = (B // 2) * batch["tokens"].shape[1]
    u = float(np.finfo(np.float32).eps) / 2
    leaves = zip(
        *(jax.tree.leaves(s.params) for s in (train_state(params, tx), ref_state, new_state))
    )
    for p0, a, b in leaves:
        scale = float(np.abs(p0).max() + np.abs(np.asarray(a) - np.asarray(p0)).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=n * u * scale)
    np.testing.assert_allclose(ref_metrics["loss"], metrics["loss"], rtol=1e-4, atol=1e-7)


def test_non_finite_gradient_skips_the_update(model):
    cfg, params = model
    sc = step_config_for(cfg, num_mini_batches=2, horizon=T)
    tx = optimizer()
    adv = np.ones(B, np.float32)
    adv[1::2] = np.nan  # rows 1, 3, ... : with strided mini-batches, only mini-batch 1 is bad
    state, metrics = compiled_step(sc, tx)(
        train_state(params, tx), train_batch(cfg, params, sc, advantages=adv)
    )
    assert metrics["skipped_updates"] == 1
    assert int(state.step) == 1
    for leaf in jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state):
        assert np.all(np.isfinite(leaf))


def test_non_finite_update_from_finite_gradients_skips_the_update(model):
    """A NaN learning rate turns finite gradients into a NaN update: the guard looks at the
    update too, so the params stay finite (they used to become NaN, and were exported)."""
    cfg, params = model
    sc = step_config_for(cfg, num_mini_batches=2, horizon=T)
    tx = optax.sgd(float("nan"))
    state, metrics = compiled_step(sc, tx)(train_state(params, tx), train_batch(cfg, params, sc))
    assert np.isfinite(metrics["grad_norm"])
    assert metrics["skipped_updates"] == 2 and int(state.step) == 0
    for new, old in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(new, old)


def test_kl_and_entropy_terms(model):
    cfg, params = model
    base = step_config_for(cfg, num_mini_batches=1, horizon=T)
    batch = train_batch(cfg, params, base)
    tx = optimizer(0.0)
    # (lr 0: params stay π_old, so the policy's log-probs equal π_old's.)
    # Reference = current policy: the KL term is 0.
    sc = dataclasses.replace(base, use_kl_loss=True, kl_loss_coef=0.5, kl_estimator="k1")
    _, m = compiled_step(sc, tx)(
        train_state(params, tx), dict(batch, ref_logprobs=batch["sampler_logprobs"])
    )
    assert abs(float(m["kl_loss"])) < 1e-6
    # A reference 0.1 nat below: k1 = 0.1 on every token, added to the loss with coef 0.5.
    shifted = dict(batch, ref_logprobs=batch["sampler_logprobs"] - 0.1)
    _, m = compiled_step(sc, tx)(train_state(params, tx), shifted)
    np.testing.assert_allclose(m["kl_loss"], 0.1, rtol=1e-4)
    np.testing.assert_allclose(m["loss"], m["pg_loss"] + 0.5 * 0.1, rtol=1e-4)
    # Entropy bonus: loss = pg − c·H.
    sc = dataclasses.replace(base, entropy_coef=0.01)
    _, m = compiled_step(sc, tx)(train_state(params, tx), batch)
    assert m["entropy"] > 0
    np.testing.assert_allclose(m["loss"], m["pg_loss"] - 0.01 * m["entropy_loss"], rtol=1e-5)


def test_logprobs_fn_returns_the_same_structure_for_dense_models(model):
    """(logprobs, entropy, routing) always; a dense model's routing is empty [B, 0, L, 0]."""
    cfg, params = model
    batch = train_batch(cfg, params, None)
    logp, entropy, routing = compiled_logprobs(step_config_for(cfg))(
        params, batch["tokens"], batch["attention_mask"], T
    )
    assert logp.shape == entropy.shape == (B, T)
    assert routing.shape == (B, 0, P + T, 0) and routing.dtype == jnp.int32


def test_routing_replay_on_moe(model):
    cfg, params = models.load_pretrained("tests/fixtures/models/qwen3_moe")
    sc = step_config_for(cfg, num_mini_batches=2, horizon=T, routing_replay=True)
    batch = train_batch(cfg, params, sc)
    logp, _, routing = compiled_logprobs(sc)(params, batch["tokens"], batch["attention_mask"], T)
    assert routing.shape[:2] == (B, cfg.num_moe_layers)
    np.testing.assert_allclose(logp, batch["sampler_logprobs"], atol=1e-6)
    tx = optimizer()
    state, metrics = compiled_step(sc, tx)(train_state(params, tx), batch)
    assert int(state.step) == 2 and np.isfinite(metrics["loss"])
    # Update 0 runs at π_old's params: the router picks exactly π_old's experts.
    assert metrics["updates/expert_change"].shape == (2,)
    assert metrics["updates/expert_change"][0] == 0


@pytest.mark.parametrize("mode", ["seq", "token", "seq_token"])
def test_update_raises_positive_and_lowers_negative_advantage_responses(model, mode):
    """The direction of the policy gradient: one small SGD step on an on-policy batch raises
    the mean log-prob of every A>0 response and lowers every A<0 one."""
    cfg, params = model
    sc = step_config_for(cfg, importance_sampling=mode, num_mini_batches=1, horizon=T)
    tx = _sgd_small()
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batch = train_batch(cfg, params, sc, advantages=adv)
    state, _ = compiled_step(sc, tx)(train_state(params, tx), batch)
    new, _, _ = compiled_logprobs(step_config_for(cfg))(
        state.params, batch["tokens"], batch["attention_mask"], T
    )
    mask = np.asarray(batch["response_mask"])
    change = np.sum((np.asarray(new) - np.asarray(batch["sampler_logprobs"])) * mask, 1) / mask.sum(
        1
    )
    assert np.all(change[adv > 0] > 0) and np.all(change[adv < 0] < 0)


@functools.cache
def _sgd_small():
    return optax.sgd(1e-2)


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_mode": "sapo", "importance_sampling": "seq", "opsm_delta": 1e-4},
        {"loss_mode": "gmpo", "importance_sampling": "token", "clip_low": 0.4, "clip_high": 0.4},
    ],
    ids=["sapo_seq_opsm", "gmpo"],
)
def test_a_loss_mode_is_invariant_to_micro_batches_and_the_mesh(model, overrides):
    """The GSPO family (docs/objectives.md) goes through the same aggregation as the clip:
    splitting a mini-batch into micro-batches, or sharding it 8 ways, leaves the step alone
    (tolerances: test_micro_batching_does_not_change_the_step, test_sharding_8_ways_...)."""
    cfg, params = model
    tx = sgd()
    sc = step_config_for(cfg, num_mini_batches=2, horizon=T, **overrides)
    batch = train_batch(cfg, params, sc)
    ref_state, ref_m = compiled_step(sc, tx)(train_state(params, tx), batch)
    assert 0.0 <= float(ref_m["limited_frac"]) <= 1.0 and np.isfinite(float(ref_m["loss"]))
    micro = dataclasses.replace(sc, micro_batch_size=2)
    micro_state, micro_m = compiled_step(micro, tx)(train_state(params, tx), batch)
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1, "expert": 1})
    abstract = models.abstract_params(cfg)
    p_shard = sharding.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=p_shard,
        opt_state=sharding.optimizer_state_shardings(tx, abstract, p_shard, mesh),
    )
    fn = make_train_step(sc, tx, state_shardings=shardings, mesh=mesh, donate=False)
    mesh_state, mesh_m = fn(
        jax.device_put(train_state(params, tx), shardings),
        jax.device_put(batch, sharding.batch_shardings(mesh, batch)),
    )
    n = (B // 2) * batch["tokens"].shape[1]
    u = float(np.finfo(np.float32).eps) / 2
    states = (train_state(params, tx), ref_state, micro_state, mesh_state)
    for p0, a, b, c in zip(*(jax.tree.leaves(s.params) for s in states)):
        scale = float(np.abs(p0).max() + np.abs(np.asarray(a) - np.asarray(p0)).max())
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=0, atol=n * u * scale)
    for key in ("loss", "limited_frac", "weight_mean", "grad_norm"):
        np.testing.assert_allclose(ref_m[key], micro_m[key], rtol=1e-4, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(ref_m[key], mesh_m[key], rtol=1e-4, atol=1e-6, err_msg=key)
