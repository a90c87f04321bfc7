"""Attention kernels specification: every implementation equals the einsum reference.

- splash (the Pallas TPU kernel, run here in Pallas interpret mode on CPU) equals `attend`
  at every real query, value and gradient, with left and right padding, GQA and a length
  that is not a multiple of 128; also inside shard_map over a mesh (batch over the batch
  axes, heads over the tensor axis, and kv heads the tensor axis does not divide);
- the cuDNN wrapper (row rotation + sequence lengths), run with jax's XLA implementation
  standing in for cuDNN (no GPU here), equals `attend` likewise;
- the whole model with attention_impl "splash" equals "xla" in logits and gradients;
- "auto" picks splash on TPU, cuDNN on GPU with 16-bit compute, the einsum otherwise.
"""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.models.attention import (
    attend,
    causal_allowed,
    cudnn_attention,
    resolve_impl,
    splash_attention,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
# Shape letters: B rows, L tokens, H query heads, K kv heads, C head dim.
B, L, H, K, C = 4, 200, 4, 2, 32


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, n, C)), jnp.float32) for n in (H, K, K))
    mask = np.ones((B, L), np.int32)
    mask[0, :37] = 0  # left padding
    mask[1, 150:] = 0  # right padding (a response that ended)
    mask[2, :5] = 0
    mask[2, 190:] = 0  # both
    return q, k, v, jnp.asarray(mask)


def _reference(q, k, v, mask):
    return attend(q, k, v, causal_allowed(mask))


def _check(fn, tol=2e-5):
    """fn(q, k, v, mask) equals `attend` at real queries, in value and in the gradient of
    a loss that reads real queries only."""
    q, k, v, mask = _inputs()
    real = np.asarray(mask).astype(bool)
    got, want = jax.jit(fn)(q, k, v, mask), jax.jit(_reference)(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=tol)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, L, H, C)), jnp.float32)

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v, mask) * weights * mask[:, :, None, None])

    g_got = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2)))(q, k, v)
    g_want = jax.jit(jax.grad(functools.partial(loss, _reference), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_got, g_want):
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=tol * scale, err_msg=f"d{name}")
    return got


def test_splash_equals_einsum_reference():
    _check(splash_attention)


@pytest.mark.parametrize(
    "sizes",
    [
        {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1},  # tensor divides the 2 kv heads
        {"data": 2, "fsdp": 1, "tensor": 4, "expert": 1},  # it does not: kv heads repeated
    ],
    ids=["kv-heads-sharded", "kv-heads-repeated"],
)
def test_splash_under_a_mesh_equals_einsum_reference(sizes):
    """8 devices: batch over the batch axes, heads over the tensor axis, in shard_map."""
    mesh = sharding_lib.make_mesh(sizes)
    with jax.set_mesh(mesh):
        _check(splash_attention)
        q, k, v, mask = _inputs()
        row = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES))
        text = jax.jit(splash_attention).lower(q, k, v, jax.device_put(mask, row)).as_text()
    assert "manual" in text.lower()  # the kernel runs per shard


def test_cudnn_wrapper_equals_einsum_reference():
    """The rotation to right padding and back, with jax's XLA attention standing in for
    cuDNN (same arguments: causal, query/key sequence lengths, GQA)."""
    _check(functools.partial(cudnn_attention, implementation="xla"))


@pytest.mark.parametrize("remat", ["none", "save_qkv_attention"])
def test_model_with_splash_equals_xla(remat):
    """The fixture Qwen3 (GQA 4/2, head dim 16) with left padding: logits and gradients of
    the splash model equal the einsum model's at real tokens; also when the backward reuses
    the kernel's saved residuals (remat "save_qkv_attention": the kernel names them)."""
    cfg, params = models.load_pretrained(FIXTURES / "qwen3")
    ref = dict(np.load(FIXTURES / "reference_qwen3.npz"))
    tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask_left"])
    real = ref["mask_left"].astype(bool)
    configs = {
        impl: dataclasses.replace(cfg, attention_impl=impl, remat=remat)
        for impl in ("xla", "splash")
    }

    def loss(c, p):
        logits = models.forward(c, p, tokens, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)

    results = {
        impl: (models.forward(c, params, tokens, mask), jax.grad(loss, argnums=1)(c, params))
        for impl, c in configs.items()
    }
    (lx, gx), (ls, gs) = results["xla"], results["splash"]
    np.testing.assert_allclose(np.asarray(ls)[real], np.asarray(lx)[real], atol=2e-5)
    np.testing.assert_allclose(np.asarray(ls)[real], ref["logits_left"][real], atol=1e-4)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gx)):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def test_auto_resolves_per_platform():
    assert resolve_impl("auto", platform="tpu") == "splash"
    assert resolve_impl("auto", dtype="bfloat16", platform="gpu") == "cudnn"
    assert resolve_impl("auto", dtype="float32", platform="gpu") == "xla"  # cuDNN: 16-bit only
    assert resolve_impl("auto", platform="cpu") == "xla"
    assert resolve_impl("auto") == "xla"  # these tests run on CPU
    assert resolve_impl("splash", platform="cpu") == "splash"  # explicit choices stand
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        resolve_impl("flash")
    with pytest.raises(ValueError, match="attention_impl"):
        models.ModelConfig.from_hf_config(
            {
                "model_type": "qwen3",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "head_dim": 4,
            },
            attention_impl="flash",
        )
