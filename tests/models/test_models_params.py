"""Parameter-tree specification: logical axes, abstract shapes, sharded creation, remat,
the stacked layers and the scan over them.

- logical_axes has the params' tree structure, one name (or None) per dimension, and the
  expected names on each kind of tensor (per-layer tensors lead with "layers");
- abstract_params matches init_params without allocating;
- params can be created sharded on an 8-device mesh from the logical names alone, and
  the sharded forward equals the single-device one (no model-code change);
- every remat policy (none, full, dots, save_qkv, save_qkv_attention) gives the same loss and
  gradients;
- the scanned decoder equals a plain Python loop over its layers (one Block per layer),
  for mixed dense/MoE orders too, and `layer_runs` cuts them as documented.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gspo_jax import models
from gspo_jax.models.config import REMAT_POLICIES

MOE = models.ModelConfig(
    arch="qwen3_moe",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)
QWEN2 = models.ModelConfig(
    arch="qwen2",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    qkv_bias=True,
    tie_word_embeddings=True,
)

EXPECTED_AXES = {
    "embedding": ("vocab", "embed"),
    "lm_head/kernel": ("embed", "vocab"),
    "final_norm/scale": (None,),
    "q_proj/kernel": ("layers", "embed", "heads", None),
    "q_proj/bias": ("layers", "heads", None),
    "k_proj/kernel": ("layers", "embed", "kv_heads", None),
    "k_proj/bias": ("layers", "kv_heads", None),
    "v_proj/kernel": ("layers", "embed", "kv_heads", None),
    "v_proj/bias": ("layers", "kv_heads", None),
    "o_proj/kernel": ("layers", "heads", None, "embed"),
    "scale": ("layers", None),
    "gate_proj/kernel": ("layers", "embed", "mlp"),
    "up_proj/kernel": ("layers", "embed", "mlp"),
    "down_proj/kernel": ("layers", "mlp", "embed"),
    "router/kernel": ("layers", "embed", None),
    "moe/gate_proj": ("layers", "expert", "embed", "mlp"),
    "moe/up_proj": ("layers", "expert", "embed", "mlp"),
    "moe/down_proj": ("layers", "expert", "mlp", "embed"),
}


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in leaves}


@pytest.mark.parametrize("cfg", [MOE, QWEN2], ids=["moe", "qwen2"])
def test_logical_axes_cover_every_param(cfg):
    params = models.abstract_params(cfg)
    axes = models.logical_axes(cfg)
    flat_p, flat_a = _flat(params), _flat(axes)
    assert flat_p.keys() == flat_a.keys()
    for path, leaf in flat_p.items():
        names = flat_a[path]
        assert isinstance(names, tuple) and len(names) == leaf.ndim, path
        suffix = [k for k in EXPECTED_AXES if path.endswith(k)]
        assert suffix, f"unexpected param {path}"
        assert names == EXPECTED_AXES[max(suffix, key=len)], path
    # jax.tree.map with params first hands each tuple over whole.
    mapped = jax.tree.map(lambda p, a: len(a) == p.ndim, params, axes)
    assert all(jax.tree.leaves(mapped))
    if cfg.tie_word_embeddings:
        assert "lm_head/kernel" not in flat_p


def _random_params(cfg, seed=0):
    """Random values on the abstract tree (cheaper than init_params for tests)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), models.abstract_params(cfg)
    )


def test_abstract_params_match_init_and_dtypes():
    cfg = dataclasses.replace(MOE, param_dtype="bfloat16")
    abstract = models.abstract_params(cfg)
    real = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(1))
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert a.shape == r.shape and a.dtype == r.dtype == jnp.bfloat16
    embedding = real["embed"]["embedding"].astype(jnp.float32)
    assert float(jnp.std(embedding)) == pytest.approx(0.02, rel=0.2)
    np.testing.assert_array_equal(real["final_norm"]["scale"].astype(jnp.float32), 1.0)
    # Stacked layers are initialised independently, with the same distribution.
    q = real["layers"]["attn"]["q_proj"]["kernel"].astype(jnp.float32)
    assert q.shape[0] == MOE.num_layers and not np.array_equal(q[0], q[1])
    assert float(jnp.std(q)) == pytest.approx(0.02, rel=0.2)
    # 2 layers; layer 0 MoE (4 experts, 2 active), layer 1 dense.
    expert = 3 * 16 * 8
    assert models.param_count(MOE) - models.param_count(MOE, active=True) == 2 * expert


def test_unembedding_is_tied_embedding():
    p = _random_params(QWEN2)
    np.testing.assert_array_equal(models.unembedding(QWEN2, p), p["embed"]["embedding"].T)


def test_sharded_creation_and_forward_need_no_model_change():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # kv_heads (2) do not divide the 4-way axis: left replicated, like sharding.py does.
    rules = {"vocab": "model", "heads": "model", "mlp": "model", "expert": "data"}

    def spec(names):
        return NamedSharding(mesh, PartitionSpec(*(rules.get(n) for n in names)))

    shardings = jax.tree.map(
        lambda _, a: spec(a), models.abstract_params(MOE), models.logical_axes(MOE)
    )
    init = jax.jit(models.init_params, static_argnums=0, out_shardings=shardings)
    params = init(MOE, jax.random.key(3))
    q = params["layers"]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == PartitionSpec(None, None, "model", None)
    experts = params["layers"]["moe"]["gate_proj"]
    assert experts.sharding.spec == PartitionSpec(None, "data", None, "model")
    assert len(experts.addressable_shards) == 8 and experts.addressable_shards[0].data.shape == (
        1,
        2,
        16,
        2,
    )
    tokens = jax.random.randint(jax.random.key(4), (4, 8), 0, MOE.vocab_size)
    mask = jnp.ones((4, 8), jnp.int32).at[1, :3].set(0)
    batch = NamedSharding(mesh, PartitionSpec("data"))
    sharded = models.forward(
        MOE, params, jax.device_put(tokens, batch), jax.device_put(mask, batch)
    )
    local = models.forward(MOE, jax.device_get(params), tokens, mask)
    np.testing.assert_allclose(sharded, local, atol=1e-5)


def test_remat_policies_give_identical_gradients():
    params = jax.tree.map(lambda x: 0.3 * x, _random_params(MOE, seed=5))
    tokens = jax.random.randint(jax.random.key(6), (2, 8), 0, MOE.vocab_size)
    mask = jnp.ones((2, 8), jnp.int32).at[0, :2].set(0)

    def loss(cfg, p):
        return jnp.mean(jax.nn.log_softmax(models.forward(cfg, p, tokens, mask))[..., 3])

    grad_fn = jax.grad(loss, argnums=1)
    jaxpr = str(
        jax.make_jaxpr(grad_fn, static_argnums=0)(dataclasses.replace(MOE, remat="full"), params)
    )
    assert "checkpoint" in jaxpr or "remat" in jaxpr  # the policy is really applied
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
    results = {r: value_and_grad(dataclasses.replace(MOE, remat=r), params) for r in REMAT_POLICIES}
    base_loss, base_grad = results["none"]
    for r in REMAT_POLICIES[1:]:
        loss_r, grad_r = results[r]
        np.testing.assert_allclose(loss_r, base_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grad_r), jax.tree.leaves(base_grad)):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_params_that_do_not_fit_the_config_are_named():
    params = _random_params(QWEN2)
    tokens = jnp.zeros((1, 4), jnp.int32)
    mask = jnp.ones((1, 4), jnp.int32)
    bad = jax.tree.map(lambda x: x, params)
    del bad["layers"]["attn"]["q_proj"]["bias"]
    with pytest.raises(ValueError, match="missing.*layers/attn/q_proj/bias"):
        models.forward(QWEN2, bad, tokens, mask)
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"]["mlp"]["up_proj"]["kernel"] = jnp.zeros((2, 16, 31))
    with pytest.raises(ValueError, match=r"layers/mlp/up_proj/kernel has shape \(2, 16, 31\)"):
        models.forward(QWEN2, bad, tokens, mask)


# ------------------------------------------------------------------- scanned layers


def _unrolled_forward(cfg, params, tokens, mask, routing=None):
    """Reference: a Python loop over the layers, one `Block` per layer merged from its
    slices of the stacks (no scan), then the final norm and the unembedding."""
    from gspo_jax.models.contexts import full_context
    from gspo_jax.models.layer_stack import _merge_block
    from gspo_jax.models.layers import rope_cos_sin
    from gspo_jax.models.params import merge

    x = jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(cfg.dtype)
    cos, sin = rope_cos_sin(cfg, models.positions_from_mask(mask))
    context = full_context(cfg, mask)
    stacks, dense, moe, routes = params["layers"], 0, 0, []

    def at(tree, index):
        return jax.tree.map(lambda a: a[index], tree)

    for i in range(cfg.num_layers):
        layer = {k: at(stacks[k], i) for k in ("input_norm", "attn", "post_attn_norm")}
        is_moe = cfg.is_moe_layer(i)
        layer["mlp"] = at(stacks["moe"], moe) if is_moe else at(stacks["mlp"], dense)
        block = _merge_block(cfg, is_moe, layer)
        forced = routing[moe] if is_moe and routing is not None else None
        x, _, idx = block(x, cos, sin, lambda q, k, v: context(None, q, k, v), forced)
        if is_moe:
            routes.append(idx)
            moe += 1
        else:
            dense += 1
    hidden = merge(cfg, params).final_norm(x)
    logits = models.logits_from_hidden(cfg, params, hidden)
    return logits, (jnp.stack(routes) if routes else None)


SPARSE_STEP_2 = dataclasses.replace(
    MOE, num_layers=6, decoder_sparse_step=2, mlp_only_layers=(), num_kv_heads=2
)
ODD = dataclasses.replace(MOE, num_layers=5, mlp_only_layers=(0, 3))


@pytest.mark.parametrize(
    "cfg, runs",
    [
        (QWEN2, [(0, (False,), 2)]),
        (MOE, [(0, (True, False), 1)]),  # layer 1 dense via mlp_only_layers
        (SPARSE_STEP_2, [(0, (False, True), 3)]),  # 3 x (dense, MoE)
        (ODD, [(0, (False,), 1), (1, (True,), 2), (3, (False, True), 1)]),
    ],
    ids=["dense", "moe-2-layers", "sparse-step-2", "mlp-only-0-3"],
)
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "scan_layers=False"])
def test_scanned_layers_equal_an_unrolled_loop(cfg, runs, scan):
    """Same logits (and routing) as one Block per layer in a Python loop, value and
    gradient, for every cut `layer_runs` makes: one run, a unit of two kinds, several runs;
    scanned, and with `scan_layers=False` (the decoder's own loop, no scan in the program)."""
    cfg = dataclasses.replace(cfg, scan_layers=scan)
    got = [(r.start, r.kinds, r.repeats) for r in models.layer_runs(cfg)]
    assert got == runs
    assert sum(r.num_layers for r in models.layer_runs(cfg)) == cfg.num_layers
    params = jax.tree.map(lambda x: 0.5 * x, _random_params(cfg, seed=7))
    tokens = jax.random.randint(jax.random.key(8), (2, 8), 0, cfg.vocab_size)
    mask = jnp.ones((2, 8), jnp.int32).at[1, :3].set(0)
    program = str(jax.make_jaxpr(functools.partial(models.forward, cfg))(params, tokens, mask))
    assert ("scan[" in program) == (scan and any(repeats > 1 for _, _, repeats in runs))
    logits, routing = models.forward_with_routing(cfg, params, tokens, mask)
    want, want_routing = jax.jit(_unrolled_forward, static_argnums=0)(cfg, params, tokens, mask)
    np.testing.assert_allclose(logits, want, atol=2e-5)
    if cfg.num_moe_layers:
        np.testing.assert_array_equal(routing, want_routing)
    else:
        assert routing.shape == (0, 2, 8, 0)

    def loss(fn, p):
        out = fn(cfg, p, tokens, mask)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jax.nn.log_softmax(out)[..., 1] * mask)

    # Jitted: op by op, the scan's body and the unrolled loop dispatch every primitive.
    g_scan = jax.jit(jax.grad(functools.partial(loss, models.forward)))(params)
    g_loop = jax.jit(jax.grad(functools.partial(loss, _unrolled_forward)))(params)
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_loop)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def test_selective_remat_policies_save_exactly_their_named_tensors():
    """save_qkv keeps each layer's q, k and v ([B, L, H + 2K, C] per layer) beyond what "full"
    keeps; save_qkv_attention also keeps the attention output ([B, L, H, C]): the residual
    bytes grow by exactly those sizes, so the names really reach the policy."""
    from jax._src.ad_checkpoint import saved_residuals

    params = _random_params(MOE, seed=5)
    B, L = 2, 8
    tokens = jnp.zeros((B, L), jnp.int32)
    mask = jnp.ones((B, L), jnp.int32)

    def residual_bytes(remat):
        cfg = dataclasses.replace(MOE, remat=remat)

        def loss(p):
            return jnp.mean(jax.nn.log_softmax(models.forward(cfg, p, tokens, mask))[..., 3])

        return sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(loss, params))

    per_token = B * L * MOE.num_layers * MOE.head_dim * jnp.dtype(MOE.dtype).itemsize
    full, qkv, qkv_attn = map(residual_bytes, ("full", "save_qkv", "save_qkv_attention"))
    assert qkv - full == per_token * (MOE.num_heads + 2 * MOE.num_kv_heads)
    assert qkv_attn - qkv == per_token * MOE.num_heads
