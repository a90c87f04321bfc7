"""Specification of gspo_jax.algorithm.logprobs: chunked log-probs equal the full-softmax ones.

References: a float64 NumPy log-softmax (values), `token_logprobs_naive` under plain JAX
autodiff (gradients; the chunked path uses a hand-written VJP), hand-computed sequence sums.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.algorithm import logprobs as lp

# Shape letters: B batch, T tokens, D model width, V vocabulary.

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(B, T, D, V, seed=0, dtype=jnp.float32):
    # NumPy randomness: eager jax.random would compile a kernel per shape, for nothing.
    rng = np.random.default_rng(seed)
    hidden_BTD = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32).astype(dtype)
    # Scale so logits have O(1..3) spread: a peaked-but-not-degenerate softmax.
    unembed_DV = jnp.asarray(rng.standard_normal((D, V)) * 2.0 / D**0.5, jnp.float32)
    targets_BT = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    coef_BT = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
    coef_entropy_BT = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
    return hidden_BTD, unembed_DV.astype(dtype), targets_BT, coef_BT, coef_entropy_BT


def _numpy_reference(hidden_BTD, unembed_DV, targets_BT, temperature):
    """float64 log p(target) and entropy, straight from the definitions."""
    z = np.einsum(
        "btd,dv->btv", np.asarray(hidden_BTD, np.float64), np.asarray(unembed_DV, np.float64)
    )
    z = z / temperature
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    logp = z - lse[..., None]
    target_logp = np.take_along_axis(logp, np.asarray(targets_BT)[..., None], -1)[..., 0]
    entropy = -np.sum(np.exp(logp) * logp, -1)
    return target_logp, entropy


def _linear_objective(fn, targets_BT, coef_BT, coef_entropy_BT, temperature, entropy, **kw):
    """value_and_grad of a random linear function of the outputs, w.r.t. hidden and unembed."""

    def objective(hidden_BTD, unembed_DV):
        out = fn(
            hidden_BTD,
            unembed_DV,
            targets_BT,
            temperature=temperature,
            return_entropy=entropy,
            **kw,
        )
        if entropy:
            logprobs_BT, entropy_BT = out
            return jnp.sum(coef_BT * logprobs_BT) + jnp.sum(coef_entropy_BT * entropy_BT), out
        return jnp.sum(coef_BT * out), out

    return jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))


# (B, T, D, V, chunk_size, temperature, return_entropy)
PARITY_CASES = [
    # B·T = 18 not divisible by 4; C = 2 positions per chunk, T padded 9 -> 10; the backward
    # takes 3 vocab slices of 128 (the last one shifted to overlap the second).
    pytest.param(2, 9, 8, 300, 4, 1.0, False, id="ragged-chunks-vocab-overlap"),
    # Entropy and temperature != 1; 7 backward vocab slices of 128 over V = 777.
    pytest.param(1, 13, 16, 777, 4, 0.7, True, id="entropy-tau0.7"),
    # chunk_size larger than B·T: one chunk, one vocab slice.
    pytest.param(3, 5, 8, 50, 64, 1.6, True, id="chunk-larger-than-BT"),
    # chunk_size smaller than B: one position per chunk (chunks of B tokens).
    pytest.param(4, 3, 8, 130, 1, 1.0, False, id="chunk-smaller-than-B"),
]


@pytest.mark.parametrize("B, T, D, V, chunk_size, temperature, entropy", PARITY_CASES)
def test_chunked_matches_naive_values_and_gradients(B, T, D, V, chunk_size, temperature, entropy):
    hidden_BTD, unembed_DV, targets_BT, coef_BT, coef_entropy_BT = _inputs(B, T, D, V)
    args = (targets_BT, coef_BT, coef_entropy_BT, temperature, entropy)
    (obj_c, out_c), grads_c = _linear_objective(lp.token_logprobs, *args, chunk_size=chunk_size)(
        hidden_BTD, unembed_DV
    )
    (obj_n, out_n), grads_n = _linear_objective(lp.token_logprobs_naive, *args)(
        hidden_BTD, unembed_DV
    )

    ref_logp, ref_entropy = _numpy_reference(hidden_BTD, unembed_DV, targets_BT, temperature)
    logprobs_c = out_c[0] if entropy else out_c
    assert logprobs_c.shape == (B, T) and logprobs_c.dtype == jnp.float32
    np.testing.assert_allclose(logprobs_c, ref_logp, **TOL)
    np.testing.assert_allclose(out_n[0] if entropy else out_n, ref_logp, **TOL)
    if entropy:
        assert out_c[1].shape == (B, T) and out_c[1].dtype == jnp.float32
        np.testing.assert_allclose(out_c[1], ref_entropy, **TOL)
        np.testing.assert_allclose(out_n[1], ref_entropy, **TOL)
    np.testing.assert_allclose(obj_c, obj_n, **TOL)
    for g_c, g_n, name in zip(grads_c, grads_n, ("hidden", "unembed")):
        assert float(jnp.max(jnp.abs(g_n))) > 1e-3, f"degenerate {name} gradient"
        np.testing.assert_allclose(g_c, g_n, **TOL, err_msg=f"d/d{name}")


def test_entropy_gradient_alone_matches_naive():
    """Gradient of Σ H only (zero cotangent on log p) — the entropy-bonus path of the loss."""
    hidden_BTD, unembed_DV, targets_BT, _, coef_entropy_BT = _inputs(2, 6, 8, 260, seed=3)

    def entropy_objective(fn, **kw):
        def objective(hidden_BTD, unembed_DV):
            _, entropy_BT = fn(
                hidden_BTD, unembed_DV, targets_BT, temperature=0.9, return_entropy=True, **kw
            )
            return jnp.sum(coef_entropy_BT * entropy_BT)

        return jax.grad(objective, argnums=(0, 1))(hidden_BTD, unembed_DV)

    grads_c = jax.jit(lambda: entropy_objective(lp.token_logprobs, chunk_size=3))()
    grads_n = jax.jit(lambda: entropy_objective(lp.token_logprobs_naive))()
    for g_c, g_n in zip(grads_c, grads_n):
        assert float(jnp.max(jnp.abs(g_n))) > 1e-3
        np.testing.assert_allclose(g_c, g_n, **TOL)


def test_return_entropy_does_not_change_logprobs():
    hidden_BTD, unembed_DV, targets_BT, _, _ = _inputs(2, 5, 8, 200, seed=1)
    plain, (with_entropy, entropy_BT) = jax.jit(
        lambda h, w, y: (
            lp.token_logprobs(h, w, y, chunk_size=4),
            lp.token_logprobs(h, w, y, chunk_size=4, return_entropy=True),
        )
    )(hidden_BTD, unembed_DV, targets_BT)
    np.testing.assert_array_equal(plain, with_entropy)
    # Entropy of a V-way distribution lies in [0, log V].
    assert bool(jnp.all((entropy_BT >= 0) & (entropy_BT <= np.log(200) + 1e-5)))


def test_bf16_inputs_give_f32_outputs_close_to_f32():
    hidden_BTD, unembed_DV, targets_BT, coef_BT, _ = _inputs(2, 7, 16, 300, seed=2)
    h16, w16 = hidden_BTD.astype(jnp.bfloat16), unembed_DV.astype(jnp.bfloat16)

    @jax.jit
    def compute(h16, w16, hidden_BTD, unembed_DV):
        def objective(fn, **kw):
            def f(h, w):
                logprobs_BT = fn(h, w, targets_BT, temperature=0.8, **kw)
                return jnp.sum(coef_BT * logprobs_BT), logprobs_BT

            return f

        def grad(f, h, w):
            return jax.grad(f, argnums=(0, 1), has_aux=True)(h, w)

        chunked = grad(objective(lp.token_logprobs, chunk_size=4), h16, w16)
        # The same bf16 values in f32: only matmul rounding differs (f32 accumulation).
        same_values = grad(
            objective(lp.token_logprobs_naive), h16.astype(jnp.float32), w16.astype(jnp.float32)
        )
        unrounded = lp.token_logprobs_naive(hidden_BTD, unembed_DV, targets_BT, temperature=0.8)
        return chunked, same_values, unrounded

    ((dh16, dw16), logprobs16), ((dh32, dw32), logprobs32), unrounded = compute(
        h16, w16, hidden_BTD, unembed_DV
    )
    assert logprobs16.dtype == jnp.float32
    np.testing.assert_allclose(logprobs16, logprobs32, rtol=1e-5, atol=1e-5)
    # Against the unrounded f32 inputs: within bf16 input rounding.
    np.testing.assert_allclose(logprobs16, unrounded, atol=0.1)
    assert dh16.dtype == jnp.bfloat16 and dw16.dtype == jnp.bfloat16
    # The logit cotangent is rounded to bf16 before the matmuls: a few bf16 ulps.
    for g16, g32 in ((dh16, dh32), (dw16, dw32)):
        scale = float(jnp.max(jnp.abs(g32)))
        np.testing.assert_allclose(g16.astype(jnp.float32), g32, atol=0.02 * scale)


def test_logprobs_from_logits_matches_naive_and_numpy():
    hidden_BTD, unembed_DV, targets_BT, _, _ = _inputs(3, 4, 8, 90, seed=4)
    temperature = 0.6

    @jax.jit
    def compute(hidden_BTD, unembed_DV, targets_BT):
        logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD, unembed_DV)
        from_logits = lp.logprobs_from_logits(logits_BTV, targets_BT, temperature)
        naive = lp.token_logprobs_naive(hidden_BTD, unembed_DV, targets_BT, temperature=temperature)
        # The sampler's case: [B, V] last-position logits, bf16 upcast to f32.
        last_BV = logits_BTV[:, -1].astype(jnp.bfloat16)
        got_B = lp.logprobs_from_logits(last_BV, targets_BT[:, -1], temperature)
        want_B = jax.nn.log_softmax(last_BV.astype(jnp.float32) / temperature)[
            jnp.arange(3), targets_BT[:, -1]
        ]
        return from_logits, naive, got_B, want_B

    from_logits, naive, got_B, want_B = compute(hidden_BTD, unembed_DV, targets_BT)
    np.testing.assert_allclose(from_logits, naive, rtol=1e-6, atol=1e-6)
    ref, _ = _numpy_reference(hidden_BTD, unembed_DV, targets_BT, temperature)
    np.testing.assert_allclose(from_logits, ref, **TOL)
    assert got_B.shape == (3,) and got_B.dtype == jnp.float32
    np.testing.assert_allclose(got_B, want_B, rtol=1e-6, atol=1e-6)


def test_out_of_range_target_is_nan_not_silent():
    logits_BV = jnp.zeros((3, 5))
    got = lp.logprobs_from_logits(logits_BV, jnp.array([-1, 5, 2]))
    assert bool(jnp.isnan(got[0])) and bool(jnp.isnan(got[1]))
    np.testing.assert_allclose(got[2], -np.log(5.0), rtol=1e-6)


def test_sequence_sum_and_mean_hand_example():
    logprobs_BT = jnp.array(
        [[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -jnp.inf, jnp.nan], [-7.0, -8.0, -9.0, -1.0]]
    )
    mask_BT = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)
    np.testing.assert_allclose(lp.sequence_logprob_sum(logprobs_BT, mask_BT), [-6.0, -0.75, 0.0])
    np.testing.assert_allclose(lp.sequence_logprob_mean(logprobs_BT, mask_BT), [-2.0, -0.375, 0.0])
    # Masked -inf / NaN and the empty row: finite gradient, zero on masked positions.
    grad = jax.grad(lambda x: jnp.sum(lp.sequence_logprob_mean(x, mask_BT)))(logprobs_BT)
    np.testing.assert_allclose(
        grad, [[1 / 3, 1 / 3, 1 / 3, 0], [0.5, 0.5, 0, 0], [0, 0, 0, 0]], rtol=1e-6
    )


def test_sequence_reductions_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="mask_BT"):
        lp.sequence_logprob_sum(jnp.zeros((2, 3)), jnp.ones((2, 4)))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_rejects_bad_temperature(temperature):
    hidden_BTD, unembed_DV, targets_BT, _, _ = _inputs(1, 2, 4, 10)
    with pytest.raises(ValueError, match="temperature"):
        lp.token_logprobs(hidden_BTD, unembed_DV, targets_BT, temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        lp.logprobs_from_logits(jnp.zeros((2, 10)), jnp.zeros((2,), jnp.int32), temperature)


def test_rejects_traced_temperature():
    hidden_BTD, unembed_DV, targets_BT, _, _ = _inputs(1, 2, 4, 10)
    with pytest.raises(TypeError, match="temperature"):
        jax.jit(lambda t: lp.token_logprobs(hidden_BTD, unembed_DV, targets_BT, temperature=t))(1.0)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True, None])
def test_rejects_bad_chunk_size(chunk_size):
    hidden_BTD, unembed_DV, targets_BT, _, _ = _inputs(1, 2, 4, 10)
    with pytest.raises(ValueError, match="chunk_size"):
        lp.token_logprobs(hidden_BTD, unembed_DV, targets_BT, chunk_size=chunk_size)


def test_rejects_bad_shapes_and_dtypes():
    hidden_BTD, unembed_DV, targets_BT, _, _ = _inputs(2, 3, 4, 10)
    with pytest.raises(ValueError, match="hidden_BTD"):
        lp.token_logprobs(hidden_BTD[0], unembed_DV, targets_BT)
    with pytest.raises(ValueError, match="unembed_DV"):
        lp.token_logprobs(hidden_BTD, unembed_DV.T, targets_BT)
    with pytest.raises(ValueError, match="targets_BT"):
        lp.token_logprobs(hidden_BTD, unembed_DV, targets_BT[:, :2])
    with pytest.raises(TypeError, match="targets_BT"):
        lp.token_logprobs(hidden_BTD, unembed_DV, targets_BT.astype(jnp.float32))
    with pytest.raises(ValueError, match="targets"):
        lp.logprobs_from_logits(jnp.zeros((2, 10)), jnp.zeros((3,), jnp.int32))


def test_batch_sharded_hidden_gives_same_result():
    """8 fake devices, hidden and targets sharded over B: same values and gradients."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    hidden_BTD, unembed_DV, targets_BT, coef_BT, _ = _inputs(8, 6, 8, 200, seed=5)
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def objective(h, w, y, c):
        return jnp.sum(c * lp.token_logprobs(h, w, y, chunk_size=16))

    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))
    want = step(hidden_BTD, unembed_DV, targets_BT, coef_BT)
    got = step(
        jax.device_put(hidden_BTD, batch),
        jax.device_put(unembed_DV, replicated),
        jax.device_put(targets_BT, batch),
        jax.device_put(coef_BT, batch),
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, **TOL)


def test_compiled_temp_memory_is_far_below_full_logits():
    """Structural check: value_and_grad's XLA temp buffers << one copy of [B·T, V] f32 logits."""
    B, T, D, V, chunk_size = 1, 512, 8, 8192, 64
    args = (
        jax.ShapeDtypeStruct((B, T, D), jnp.float32),
        jax.ShapeDtypeStruct((D, V), jnp.float32),
        jax.ShapeDtypeStruct((B, T), jnp.int32),
    )

    def temp_bytes(fn):
        step = jax.jit(jax.value_and_grad(lambda h, w, y: jnp.sum(fn(h, w, y)), argnums=(0, 1)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    full_logits = B * T * V * 4
    chunked = temp_bytes(lambda h, w, y: lp.token_logprobs(h, w, y, chunk_size=chunk_size))
    naive = temp_bytes(lp.token_logprobs_naive)
    assert naive >= full_logits  # the reference does hold the full logits
    assert chunked < full_logits / 4, (chunked, full_logits)
