"""Rounding: stochastic rounding is unbiased, nearest rounding is the reference exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize import dequantize, quantize
from pallas_kernels.quantize.reference import dequantize_reference, quantize_reference


def mean_of_roundings(x, fmt, rounding, n=2000):
  keys = jax.random.split(jax.random.key(7), n)

  @jax.vmap
  def one(key):
    q, s = quantize(x, fmt, (0,), rounding, key if rounding == "stochastic" else None)
    return dequantize(q, s)

  return jnp.mean(one(keys), axis=0), jnp.std(one(keys), axis=0) / np.sqrt(n)


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "e5m2"])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(fmt):
  # Values between grid points (never on them), so nearest rounding has a visible bias.
  x = jax.random.uniform(jax.random.key(0), (256,), jnp.float32, -3.0, 3.0)
  mean, stderr = mean_of_roundings(x, fmt, "stochastic")
  z = np.abs(np.asarray(mean - x)) / np.maximum(np.asarray(stderr), 1e-12)
  # Unbiased: the mean over 2000 draws lies within ~3 standard errors for (almost) all 256.
  assert np.mean(z < 3.5) > 0.98, np.sort(z)[-10:]
  # The same statistic detects the bias of nearest rounding (so the test can fail).
  nearest, _ = mean_of_roundings(x, fmt, "nearest", n=1)
  z_nearest = np.abs(np.asarray(nearest - x)) / np.maximum(np.asarray(stderr), 1e-12)
  assert np.mean(z_nearest > 3.5) > 0.5


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("axes", [(0, 1), (0,), (1,)])
def test_nearest_rounding_matches_reference_exactly(fmt, axes):
  x = jax.random.normal(jax.random.key(1), (33, 17), jnp.float32) * 5
  q, s = quantize(x, fmt, axes)
  q_ref, s_ref = quantize_reference(x, fmt, axes)
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_ref, np.float32))
  np.testing.assert_array_equal(s, s_ref)
  # and it is a round trip within half a step of the grid
  err = np.abs(np.asarray(dequantize_reference(q, s) - x))
  if fmt == "int8":
    assert (err <= np.asarray(s) / 2 + 1e-6).all()


def test_int8_nearest_is_round_half_to_even_of_x_over_scale():
  x = jnp.array([0.5, 1.5, 2.5, -0.5, 127.0], jnp.float32)
  q, s = quantize_reference(x, "int8", (0,))
  assert float(s[0]) == 1.0
  np.testing.assert_array_equal(q, np.array([0, 2, 2, 0, 127], np.int8))
