"""``qconv.im2col`` is ``lax.conv_general_dilated_patches`` (values and gradients), by slicing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qsync_jax.ops.qconv import im2col, library_patches

CASES = [
  # (input shape N, spatial..., C), filter, strides, padding, rhs_dilation
  ((2, 9, 7, 3), (3, 3), (1, 1), "SAME", (1, 1)),
  ((2, 9, 7, 3), (3, 3), (2, 2), "SAME", (1, 1)),
  ((2, 9, 7, 3), (3, 2), (2, 1), "VALID", (1, 1)),
  ((1, 10, 10, 2), (3, 3), (1, 1), "SAME", (2, 2)),
  ((1, 10, 10, 2), (2, 3), (1, 2), ((1, 2), (0, 1)), (1, 2)),
  ((3, 11, 4), (5,), (2,), "SAME", (1,)),
  ((1, 5, 6, 4, 2), (3, 1, 2), (1, 2, 1), "SAME", (1, 1, 1)),
]


@pytest.mark.parametrize("shape, filter_shape, strides, padding, rhs_dilation", CASES)
def test_patches_and_their_gradient_equal_the_library_patches(
  shape, filter_shape, strides, padding, rhs_dilation
):
  x = jax.random.normal(jax.random.key(0), shape)
  ones = (1,) * (len(shape) - 2)
  want, want_vjp = jax.vjp(
    lambda x: library_patches(x, filter_shape, strides, padding, ones, rhs_dilation), x
  )
  got, got_vjp = jax.vjp(lambda x: im2col(x, filter_shape, strides, padding, ones, rhs_dilation), x)
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)  # data movement: exact
  cotangent = jax.random.normal(jax.random.key(1), want.shape)
  # the gradient sums up to prod(filter) shifted copies: equal up to the order of the adds
  np.testing.assert_allclose(got_vjp(cotangent)[0], want_vjp(cotangent)[0], rtol=1e-5, atol=1e-5)


def test_input_dilation_keeps_the_library_call():
  x = jnp.arange(2 * 5 * 5 * 2, dtype=jnp.float32).reshape(2, 5, 5, 2)
  args = (x, (3, 3), (1, 1), ((1, 1), (1, 1)), (2, 2), (1, 1))
  np.testing.assert_array_equal(im2col(*args), library_patches(*args))
  assert library_patches(*args).shape == (2, 9, 9, 18)  # the input dilated to 9x9, 2 channels x 9
