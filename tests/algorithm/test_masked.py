"""gspo_jax.algorithm.masked: hand-computed values, garbage at masked positions, empty selections."""

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.algorithm.masked import masked_mean, row_mean, safe_count


def test_masked_mean_ignores_garbage_and_empty_is_zero():
    x = jnp.array([[1.0, 2.0, jnp.nan], [4.0, -jnp.inf, 6.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 1]], jnp.float32)
    assert float(masked_mean(x, mask)) == (1 + 2 + 4 + 6) / 4
    assert float(masked_mean(x, jnp.zeros_like(mask))) == 0.0
    grad = jax.grad(lambda x: masked_mean(x, mask))(x)
    np.testing.assert_array_equal(grad, [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]])


def test_row_mean_is_the_length_normalised_mean():
    # GSPO's 1/|y_i|: rows of 2 and 1 valid tokens, and an empty row.
    x = jnp.array([[0.2, -0.4, 9.0], [1.5, jnp.nan, 7.0], [3.0, 3.0, 3.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], jnp.float32)
    np.testing.assert_allclose(row_mean(x, mask), [-0.1, 1.5, 0.0], rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(row_mean(x, mask)))(x)
    np.testing.assert_allclose(grad, [[0.5, 0.5, 0], [1, 0, 0], [0, 0, 0]])


def test_safe_count():
    np.testing.assert_array_equal(safe_count(jnp.array([0, 3, 0])), [1.0, 3.0, 1.0])
