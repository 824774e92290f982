"""quantize_pair: one tensor quantized per row and per column (transposed) in two kernel passes,
against two calls of the jnp reference, in interpret mode on the CPU and compiled on a GPU; its
stochastic rounding (two 16-bit numbers from one hash per element) unbiased for both copies."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize import api, noise, pair_kernel
from pallas_kernels.quantize.config import QuantizeConfig
from pallas_kernels.quantize.reference import dequantize_reference
from tests.pallas_kernels.test_quantize import IMPLS, assert_codes_match, draw, expected

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
  """The pair against two reference quantizations: per row of the 2-D view (the tail axes
  reduced) and per column (the head axes reduced, moved last), stochastic rounding with the
  pair's two noise arrays (``noise.pair_noise``)."""
  key = jax.random.key(5) if rounding == "stochastic" else None
  name, interpret = impl
  got = api.quantize_pair(x, fmt, split, rounding, key, in_scales=in_scales, impl=name, interpret=interpret)
  head, tail = tuple(range(split)), tuple(range(split, x.ndim))
  noises = noise.pair_noise(key, x.shape) if key is not None else (None, None)
  want = [
    expected(x, fmt, axes, axes, rounding=rounding, in_scale=s, noise=n)
    for axes, n, s in ((tail, noises[0], in_scales[0]), (head, noises[1], in_scales[1]))
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


def test_pair_noise_hashes_each_elements_index_once_for_two_independent_uniforms():
  """Both copies' numbers come from one hash of the element's row-major index: each stream
  uniform on the 16-bit grid of [0, 1), the two uncorrelated with each other and with the
  pair noise of another key (65536 draws: a correlation's s.e. is 1/256; 5 s.e. bounds)."""
  key = jax.random.key(3)
  a, b = noise.pair_noise(key, (4, 6))
  seed = noise.seed_words(key)
  idx = noise.element_index(jnp.arange(4)[:, None], jnp.arange(6)[None, :], 6)
  for got, want in zip((a, b), noise.pair_uniforms(seed[0], seed[1], idx)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  a, b = (np.asarray(v) for v in noise.pair_noise(key, (1 << 16,)))
  c, _ = (np.asarray(v) for v in noise.pair_noise(jax.random.key(4), (1 << 16,)))
  for u in (a, b, c):
    assert 0.0 <= u.min() and u.max() < 1.0 and np.all(u * 65536 == np.floor(u * 65536))
    assert abs(u.mean() - 0.5) < 0.006 and abs(u.var() - 1 / 12) < 0.004
  corr = np.corrcoef(np.stack([a, b, c]))
  assert np.max(np.abs(corr - np.eye(3))) < 0.02, corr


@pytest.mark.parametrize("impl", IMPLS)
def test_pair_stochastic_rounding_is_unbiased_for_both_copies(impl):
  """With 4096 draws per element the mean error of each copy is within 4.5 standard errors
  for all 64 elements (false-alarm rate ~1e-4; ``test_quantize``'s check of the same kind has
  power against nearest rounding). The row copy draws the hash's high bits, the column copy
  its low bits: x and its transpose put the same 64 values in both."""
  row = jax.random.uniform(jax.random.key(0), (64,), jnp.float32, -1.0, 1.0).at[0].set(1.0)
  name, interpret = impl
  for x, copy in ((jnp.broadcast_to(row, (4096, 64)), 0), (jnp.broadcast_to(row[:, None], (64, 4096)), 1)):
    q, s = api.quantize_pair(x, "int8", 1, "stochastic", jax.random.key(1), impl=name, interpret=interpret)[
      copy
    ]
    deq = np.asarray(dequantize_reference(q, s), np.float64)  # [4096 draws, 64 values] either way
    mean, sd = deq.mean(0), deq.std(0) + 1e-12
    z = (mean - np.asarray(row, np.float64)) / (sd / np.sqrt(deq.shape[0]))
    exact = sd < 1e-9 * float(np.max(np.asarray(s)))  # values on the grid: no noise, no bias
    assert np.max(np.abs(np.where(exact, 0.0, z))) < 4.5, (copy, np.max(np.abs(z)))
