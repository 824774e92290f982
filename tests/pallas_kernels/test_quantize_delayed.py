"""Quantization at a given (delayed) per-tensor scale with the input's absmax as a side output:
the kernels' ``with_absmax`` outputs against ``jnp.max(jnp.abs(.))``, their codes against the
kernels without it, and ``quantize_both_at`` / ``quantize_pair_at`` against the jnp reference
``quantize_at_scale``, in interpret mode on the CPU and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize import api, delayed, kernel, noise, pair_kernel
from pallas_kernels.quantize.config import QuantizeConfig
from pallas_kernels.quantize.reference import absmax_scale, quantize_at_scale
from tests.pallas_kernels.test_quantize import IMPLS, assert_codes_match, draw

GRID = QuantizeConfig(block_rows=16, block_cols=32)  # a 4 x 8 grid of tiles on [64, 256]


def spiked(seed, spike_at, dtype=jnp.float32):
  """A [64, 256] draw whose absmax (-50) sits at ``spike_at``: one tile, not the first."""
  return draw((64, 256), seed).at[spike_at].set(-50.0).astype(dtype)


@pytest.mark.parametrize("layout", ["both", "transposed"])
def test_tiled_kernel_side_output_is_the_absmax_and_leaves_the_codes_alone(layout):
  for spike_at in ((63, 3), (17, 200)):  # the last row of tile (3, 0); tile (1, 6)
    x = spiked(1, spike_at, jnp.bfloat16)
    scale = jnp.full((256,), 0.05, jnp.float32)  # below 50 / 127: the spike saturates
    in_scale = jnp.exp(jax.random.normal(jax.random.key(2), (64,)))
    kwargs = dict(in_scale=in_scale, in_scale_axis="rows", layout=layout, config=GRID, interpret=True)
    plain = kernel.quantize_tiled(x, "int8", scale, **kwargs)
    *codes, amax = kernel.quantize_tiled(x, "int8", scale, with_absmax=True, **kwargs)
    assert amax.shape == () and amax.dtype == jnp.float32
    assert float(amax) == float(jnp.max(jnp.abs(x.astype(jnp.float32) * in_scale[:, None])))
    for got, want in zip(codes, plain if layout == "both" else (plain,)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(jnp.min(codes[0])) == -127


def test_pair_kernel_side_outputs_are_both_inputs_absmaxes():
  x = spiked(3, (40, 255))
  col_in = jnp.exp(jax.random.normal(jax.random.key(4), (256,)))
  row_in = jnp.exp(jax.random.normal(jax.random.key(5), (64,)))
  row_scale, col_scale = jnp.full((64,), 0.02), jnp.full((256,), 0.3)
  seeds = noise.seed_words(jax.random.key(6))
  args = (x, "e5m2", col_in, row_in, row_scale, col_scale)
  plain = pair_kernel.pair_quantize(*args, seeds=seeds, config=GRID, interpret=True)
  q_rows, q_cols, amax_rows, amax_cols = pair_kernel.pair_quantize(
    *args, seeds=seeds, with_absmax=True, config=GRID, interpret=True
  )
  assert float(amax_rows) == float(jnp.max(jnp.abs(x * col_in[None, :])))
  assert float(amax_cols) == float(jnp.max(jnp.abs(x * row_in[:, None])))
  assert float(amax_rows) != float(amax_cols)  # the two inputs differ: a swap would show
  for got, want in zip((q_rows, q_cols), plain):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt,rounding", [("int8", "nearest"), ("int8", "stochastic"), ("e4m3", "nearest")])
def test_both_at_a_delayed_scale_matches_the_reference(impl, fmt, rounding):
  """X [batch, sequence, features] of a Dense, contraction last, at a scale a little below its
  own (the largest values saturate, as a stale amax makes them)."""
  shape = (2, 128, 256) if impl == ("pallas", False) else (2, 16, 64)
  x = draw(shape, 7, jnp.bfloat16)
  key = jax.random.key(8) if rounding == "stochastic" else None
  scale = 0.8 * absmax_scale(x, fmt, (0, 1, 2)).reshape(())
  name, interpret = impl
  (q, s), (q_other, s_other), amax = delayed.quantize_both_at(
    x, fmt, scale, rounding, key, contract_axes=(2,), impl=name, interpret=interpret
  )
  q_ref, amax_ref = quantize_at_scale(x, fmt, scale, rounding, key)
  assert_codes_match(impl, q, q_ref)
  assert_codes_match(impl, q_other, jnp.transpose(q_ref, (2, 0, 1)))
  assert s.shape == s_other.shape == (1, 1, 1) and float(s[0, 0, 0]) == float(scale)
  assert float(amax) == float(amax_ref) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
  qmax = {"int8": 127.0, "e4m3": 448.0}[fmt]
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == qmax  # saturated, not wrapped


@pytest.mark.parametrize("impl", IMPLS[:2])
def test_both_at_the_tensors_own_scale_is_quantize_both(impl):
  """A weight [K, N] contracted first: at its own absmax scale the codes are quantize_both's."""
  w = draw((64, 96), 9, jnp.bfloat16)
  name, interpret = impl
  scale = absmax_scale(w, "int8", (0, 1))
  want = api.quantize_both(w, "int8", (0, 1), contract_axes=(0,), impl=name, interpret=interpret)
  got = delayed.quantize_both_at(w, "int8", scale, contract_axes=(0,), impl=name, interpret=interpret)
  for (q, s), (q_ref, s_ref) in zip(got[:2], want):
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q_ref))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt,rounding", [("int8", "stochastic"), ("e5m2", "nearest")])
def test_pair_at_delayed_scales_matches_the_reference(impl, fmt, rounding):
  """dY [tokens, N] of a Dense with W's per-column scale folded into the row copy."""
  shape = (256, 512) if impl == ("pallas", False) else (64, 128)
  g = draw(shape, 10, jnp.bfloat16)
  s_w = jnp.exp(jax.random.normal(jax.random.key(11), (1, shape[1])))
  key = jax.random.key(12) if rounding == "stochastic" else None
  scales = (jnp.float32(0.01), jnp.float32(0.02))
  name, interpret = impl
  (q, s0), (q2, s1), (amax0, amax1) = delayed.quantize_pair_at(
    g, fmt, 1, scales, rounding, key, in_scales=(s_w, None), impl=name, interpret=interpret
  )
  a, b = noise.pair_noise(key, shape) if key is not None else (None, None)
  q_ref, amax0_ref = quantize_at_scale(g, fmt, scales[0], rounding, None, s_w, a)
  q2_ref, amax1_ref = quantize_at_scale(g, fmt, scales[1], rounding, None, None, b)
  assert_codes_match(impl, q, q_ref)
  assert_codes_match(impl, q2, q2_ref.T)
  assert s0.shape == s1.shape == (1, 1) and float(s1[0, 0]) == pytest.approx(0.02)
  assert float(amax0) == float(amax0_ref) and float(amax1) == float(amax1_ref)
  assert float(amax1) == float(jnp.max(jnp.abs(g.astype(jnp.float32))))


def test_a_scale_of_more_than_one_value_is_refused_by_name():
  x = draw((8, 16), 0)
  with pytest.raises(ValueError, match="scale of shape"):
    delayed.quantize_both_at(x, "int8", jnp.ones((16,)), contract_axes=(1,))
  with pytest.raises(ValueError, match=r"scales\[1\]"):
    delayed.quantize_pair_at(x, "int8", 1, (jnp.float32(1.0), jnp.ones((2,))))
  with pytest.raises(ValueError, match="split"):
    delayed.quantize_pair_at(x, "int8", 2, (1.0, 1.0))
