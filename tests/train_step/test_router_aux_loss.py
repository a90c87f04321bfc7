"""Qwen3-MoE's router load-balancing loss in the train step and the warm start
(`model.router_aux_loss_coef`, models/moe_aux.py):

- with coefficient c the step's loss is the loss at c = 0 plus c times the aux loss, and
  its gradient differs from the c = 0 one by c times the gradient of an explicit
  composition (`models.hidden_states`' statistics -> `moe_aux.load_balancing_loss`),
  which flows through the router probabilities only; with two micro-batches the aux
  loss is their real-token-weighted mean;
- at c = 0 the statistics are never computed: the step and the warm start's loss trace
  with `router_load_stats` replaced by a function that raises.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_helpers import B, T, compiled_step, sgd, step_config_for, train_batch, train_state

from gspo_jax import models
from gspo_jax.models import moe_aux
from gspo_jax.sharding.split import strided_split
from gspo_jax.train_step import step as step_lib
from gspo_jax.trainer import warm_start

MOE = "tests/fixtures/models/qwen3_moe"
COEF = 0.5  # large, so that the aux loss's share of the update is well above rounding


@pytest.fixture(scope="module")
def moe():
    return models.load_pretrained(MOE)


def _explicit_aux(cfg, params, batch, micro):
    """Σ_k (n_k / n) · load_balancing_loss(stats of micro-batch k), n_k its real tokens."""
    parts = {k: strided_split(batch[k], micro) for k in ("tokens", "attention_mask")}
    n = jnp.sum(batch["attention_mask"].astype(jnp.float32))
    total = 0.0
    for k in range(micro):
        tokens, mask = parts["tokens"][k], parts["attention_mask"][k]
        _, _, stats = models.hidden_states(cfg, params, tokens, mask, router_stats=True)
        total = total + jnp.sum(mask.astype(jnp.float32)) / n * moe_aux.load_balancing_loss(*stats)
    return total


def test_the_aux_loss_adds_to_the_loss_and_its_gradient(moe):
    cfg, params = moe
    micro = 2
    states, metrics = {}, {}
    for coef in (0.0, COEF):
        sc = step_config_for(
            cfg,
            num_mini_batches=1,
            micro_batch_size=B // micro,
            horizon=T,
            router_aux_loss_coef=coef,
        )
        batch = train_batch(cfg, params, sc)
        state, m = compiled_step(sc, sgd())(train_state(params, sgd()), batch)
        states[coef], metrics[coef] = state.params, jax.device_get(m)
    assert "router_aux_loss" not in metrics[0.0]
    aux, grad = jax.jit(jax.value_and_grad(_explicit_aux, argnums=1), static_argnums=(0, 3))(
        cfg, params, batch, micro
    )
    assert float(aux) > 0
    m0, mc = metrics[0.0], metrics[COEF]
    assert mc["router_aux_loss"] == pytest.approx(float(aux), rel=1e-5)
    assert mc["updates/router_aux_loss"].shape == (1,)
    assert mc["pg_loss"] == pytest.approx(m0["pg_loss"], rel=1e-6, abs=1e-7)
    assert mc["loss"] == pytest.approx(m0["loss"] + COEF * float(aux), rel=1e-5, abs=1e-6)
    # sgd(1): params − update = gradient, so the updates differ by COEF · ∇aux.
    diff = jax.tree.map(lambda a, b: a - b, states[0.0], states[COEF])
    flat_diff, flat_want = jax.tree.leaves(diff), jax.tree.leaves(grad)
    assert max(float(jnp.max(jnp.abs(g))) for g in flat_want) > 0
    for got, want in zip(flat_diff, flat_want):
        np.testing.assert_allclose(
            got, COEF * want, atol=2e-5 * max(1.0, COEF * float(jnp.max(jnp.abs(want))))
        )
    # Only the routers and what feeds them get the aux gradient: not the last MoE layer's
    # experts, nor the final norm.
    assert float(jnp.max(jnp.abs(grad["layers"]["moe"]["router"]["kernel"]))) > 0
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert float(jnp.max(jnp.abs(grad["layers"]["moe"][name][-1]))) == 0
    assert float(jnp.max(jnp.abs(grad["final_norm"]["scale"]))) == 0
    assert float(jnp.max(jnp.abs(grad["lm_head"]["kernel"]))) == 0


def test_at_coefficient_zero_the_statistics_are_never_computed(moe, monkeypatch):
    cfg, params = moe
    tokens = jnp.zeros((B, 6 + T), jnp.int32)
    mask = jnp.ones((B, 6 + T), jnp.int32)

    def refuse(*args, **kwargs):
        raise AssertionError("router_load_stats traced")

    monkeypatch.setattr(moe_aux, "router_load_stats", refuse)
    for coef in (0.0, COEF):
        sc = step_config_for(cfg, num_mini_batches=1, horizon=T, router_aux_loss_coef=coef)
        batch = {
            "tokens": tokens,
            "attention_mask": mask,
            "response_mask": jnp.ones((B, T), jnp.float32),
            "sampler_logprobs": jnp.zeros((B, T), jnp.float32),
            "advantages": jnp.zeros((B,), jnp.float32),
        }

        def trace(sc=sc, batch=batch, coef=coef):
            jax.eval_shape(
                lambda s, b: step_lib.train_step(sc, sgd(), s, b), train_state(params, sgd()), batch
            )
            jax.eval_shape(
                lambda p, coef=coef: warm_start.sft_loss(
                    cfg, p, tokens, mask, mask, router_aux_loss_coef=coef
                ),
                params,
            )

        if coef:
            with pytest.raises(AssertionError, match="router_load_stats traced"):
                trace()
        else:
            trace()


def test_the_warm_start_adds_the_aux_loss(moe):
    cfg, params = moe
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 10)), jnp.int32)
    mask = jnp.ones((4, 10), jnp.int32).at[0, :3].set(0)
    loss0, m0 = warm_start.sft_loss(cfg, params, tokens, mask, mask)
    loss, m = warm_start.sft_loss(cfg, params, tokens, mask, mask, router_aux_loss_coef=COEF)
    _, _, stats = models.hidden_states(cfg, params, tokens, mask, router_stats=True)
    aux = float(moe_aux.load_balancing_loss(*stats))
    assert "sft/router_aux_loss" not in m0
    assert float(m["sft/router_aux_loss"]) == pytest.approx(aux, rel=1e-6)
    assert float(m["sft/loss"]) == pytest.approx(float(loss0), rel=1e-6)
    assert float(loss) == pytest.approx(float(loss0) + COEF * aux, rel=1e-6)


@pytest.mark.parametrize(
    "arch,coef,match",
    [
        ("qwen3_moe", -0.01, r"model.router_aux_loss_coef=-0.01 must be a finite number >= 0"),
        ("qwen3", 0.01, r"model.router_aux_loss_coef=0.01 needs a Mixture-of-Experts model"),
    ],
)
def test_bad_coefficients_are_one_line_errors_naming_the_field(arch, coef, match):
    import warnings

    from configs import base
    from gspo_jax.config.validate import ConfigError, validate

    c = base.get_config()
    c.model.arch, c.model.num_experts = arch, 8 if arch == "qwen3_moe" else 0
    c.model.router_aux_loss_coef = coef
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=match) as info:
            validate(c)
    assert "\n" not in str(info.value)
    c.model.router_aux_loss_coef = 0.0
    if arch == "qwen3_moe":
        c.model.router_aux_loss_coef = 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validate(c)  # 0 on any model, > 0 on an MoE: fine


def test_sharding_does_not_change_the_aux_loss(moe):
    """Each micro-batch's statistics are sums over its rows: split over 8 devices (data x
    expert), GSPMD sums them across the devices, and the step equals the one-device step."""
    from gspo_jax import sharding
    from gspo_jax.train_step import TrainState, make_train_step

    cfg, params = moe
    sc = step_config_for(cfg, num_mini_batches=2, horizon=T, router_aux_loss_coef=COEF)
    tx = sgd()
    batch = train_batch(cfg, params, sc)
    ref_state, ref = compiled_step(sc, tx)(train_state(params, tx), batch)
    mesh = sharding.make_mesh({"data": 4, "fsdp": 1, "tensor": 1, "expert": 2})
    abstract = models.abstract_params(cfg)
    p_shard = sharding.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=p_shard,
        opt_state=sharding.optimizer_state_shardings(tx, abstract, p_shard, mesh),
    )
    state = jax.device_put(train_state(params, tx), shardings)
    fn = make_train_step(sc, tx, state_shardings=shardings, mesh=mesh, donate=False)
    new_state, got = fn(state, jax.device_put(batch, sharding.batch_shardings(mesh, batch)))
    np.testing.assert_allclose(
        got["updates/router_aux_loss"], ref["updates/router_aux_loss"], rtol=1e-5
    )
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-4, atol=1e-7)
    for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(new_state.params)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(np.asarray(a)).max())))
