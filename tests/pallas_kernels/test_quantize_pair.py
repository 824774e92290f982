"""quantize_pair: one tensor quantized per row and per column (transposed) in two kernel passes,
against two calls of the jnp reference, in interpret mode on the CPU and compiled on a GPU."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize import api, pair_kernel
from pallas_kernels.quantize.config import QuantizeConfig
from tests.pallas_kernels.test_quantize import IMPLS, assert_codes_match, draw

FMTS = ["int8", "e4m3", "e5m2"]


def scales_for(x, split, seed):
  """Positive in-scales: the first varies along the tail axes, the second along the head."""
  tail = (1,) * split + x.shape[split:]
  head = x.shape[:split] + (1,) * (x.ndim - split)
  return (
    jnp.exp(jax.random.normal(jax.random.key(seed), tail)),
    jnp.exp(jax.random.normal(jax.random.key(seed + 1), head)),
  )


def check_pair(impl, x, fmt, split, rounding, in_scales):
  keys = (jax.random.key(5), jax.random.key(6)) if rounding == "stochastic" else (None, None)
  name, interpret = impl
  got = api.quantize_pair(x, fmt, split, rounding, keys, in_scales=in_scales, impl=name, interpret=interpret)
  head, tail = tuple(range(split)), tuple(range(split, x.ndim))
  want = [
    api.quantize(x, fmt, axes, rounding, key, in_scale=s, contract_axes=axes, impl="reference")
    for axes, key, s in ((tail, keys[0], in_scales[0]), (head, keys[1], in_scales[1]))
  ]
  for (q, s), (q_ref, s_ref) in zip(got, want):
    assert s.shape == s_ref.shape
    assert_codes_match(impl, q, q_ref)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=3e-7 if interpret else 1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", FMTS)
def test_pair_matches_two_reference_quantizations(impl, fmt, rounding):
  shape = (512, 1024) if impl == ("pallas", False) else (64, 128)
  x = draw(shape, zlib.crc32(repr((fmt, rounding)).encode()) % 997, jnp.bfloat16)
  check_pair(impl, x, fmt, 1, rounding, scales_for(x, 1, 11))


@pytest.mark.parametrize("impl", IMPLS[:2])
def test_pair_of_a_higher_rank_gradient_without_in_scales(impl):
  """A Dense layer's dY of shape [batch, sequence, features] (head = batch and sequence)."""
  x = draw((2, 32, 64), 3, jnp.bfloat16)
  check_pair(impl, x, "int8", 2, "stochastic", (None, None))
  check_pair(impl, x, "e5m2", 2, "nearest", scales_for(x, 2, 12))


def test_pair_kernels_read_the_same_tile_grid():
  """The kernels on a non-square tile grid: the partial maxima of every tile reach the scales."""
  x = draw((64, 256), 9)
  col_in, row_in = (s.reshape(-1) for s in scales_for(x, 1, 13))
  cfg = QuantizeConfig(block_rows=16, block_cols=32)
  row_scale, col_scale = pair_kernel.pair_scales(x, "int8", col_in, row_in, config=cfg, interpret=True)
  want_rows = jnp.max(jnp.abs(x * col_in[None, :]), axis=1) / 127.0
  want_cols = jnp.max(jnp.abs(x * row_in[:, None]), axis=0) / 127.0
  np.testing.assert_array_equal(np.asarray(row_scale), np.asarray(want_rows))
  np.testing.assert_array_equal(np.asarray(col_scale), np.asarray(want_cols))


def test_pair_falls_back_where_a_scale_varies_on_the_other_side():
  """An in-scale along the other side runs the reference quantizations; the result is the
  same either way."""
  x = draw((64, 128), 4, jnp.bfloat16)
  wrong_side = scales_for(x, 1, 14)[::-1]
  with pytest.raises(NotImplementedError, match="varies off"):
    api._pallas_pair(x, "int8", 1, "nearest", (None, None), wrong_side, None, True)
  check_pair(("pallas", True), x, "int8", 1, "nearest", wrong_side)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"split": 0}, "split"),
    ({"split": 2}, "split"),
    ({"fmt": "int4"}, "fmt"),
    ({"rounding": "stochastic"}, "key"),
    ({"in_scales": (jnp.ones((3,)), None)}, "in_scale"),
  ],
)
def test_bad_pair_calls_name_the_argument(kwargs, match):
  args = {"x": draw((8, 16), 0), "fmt": "int8", "split": 1}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    api.quantize_pair(**args)
