"""models.grouped: the MoE experts' grouped matmul and its weight gradient.

- value and both gradients equal `jax.lax.ragged_dot`'s own autodiff (the CPU path);
- the TPU weight gradient (megablox's tgmm, in the Pallas interpreter here) equals
  ragged_dot's transpose, an empty group included (its gradient is zero).
"""

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.models.grouped import grouped_matmul, weight_grad

SIZES = jnp.array([100, 0, 28, 128], jnp.int32)  # 256 rows, one empty group


def _operands():
    x = jax.random.normal(jax.random.key(0), (256, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (4, 64, 32), jnp.float32)
    return x, w


def test_value_and_gradients_equal_ragged_dot():
    x, w = _operands()

    def loss(product):
        return lambda x, w: jnp.sum(jnp.tanh(product(x, w, SIZES)))

    want = jax.value_and_grad(loss(jax.lax.ragged_dot), (0, 1))(x, w)
    got = jax.value_and_grad(loss(grouped_matmul), (0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_tpu_weight_gradient_equals_the_transpose():
    x, w = _operands()
    dy = jax.random.normal(jax.random.key(2), (256, 32), jnp.float32)
    want = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, SIZES), w)[1](dy)[0]
    got = weight_grad(x, dy, SIZES, w, interpret=True)
    assert got.shape == w.shape and got.dtype == w.dtype
    np.testing.assert_allclose(got, want, atol=1e-4 * float(jnp.abs(want).max()))
    assert float(jnp.abs(got[1]).max()) == 0.0  # the empty group
