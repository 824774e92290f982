"""quantize: one suite over every implementation (the reference, the Pallas kernels in
interpret mode on the CPU, the compiled kernels on a GPU), checked against the jnp
reference on fresh random inputs."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize import api, kernel, noise
from pallas_kernels.quantize.reference import QFORMATS, dequantize_reference, quantize_reference

FMTS = ["int8", "e4m3", "e5m2"]
# name: (reduce_axes, contract_axes) on a 2-D [rows, cols] input
LAYOUTS = {
  "per_row": ((1,), None),
  "per_row_contract_last": ((1,), (1,)),
  "per_col": ((0,), None),
  "per_col_transposed": ((0,), (0,)),
  "per_tensor": ((0, 1), None),
  "per_tensor_transposed": ((0, 1), (0,)),
}
IMPLS = [
  pytest.param(("reference", False), id="reference"),
  pytest.param(("pallas", True), id="pallas_interpret"),
  pytest.param(("pallas", False), id="pallas_gpu", marks=pytest.mark.gpu),
]


def draw(shape, seed, dtype=jnp.float32):
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  x = x * jnp.exp(jax.random.normal(jax.random.key(seed + 1), shape[:1] + (1,) * (len(shape) - 1)))
  return x.astype(dtype)


def run(impl, *args, **kwargs):
  name, interpret = impl
  return api.quantize(*args, impl=name, interpret=interpret, **kwargs)


def expected(x, fmt, reduce_axes, contract, **kwargs):
  q, s = quantize_reference(x, fmt, reduce_axes, **kwargs)
  if contract is not None:
    perm = tuple(a for a in range(x.ndim) if a not in contract) + tuple(contract)
    q, s = jnp.transpose(q, perm), jnp.transpose(s, perm)
  return q, s


def assert_codes_match(impl, q, q_ref):
  """Bitwise on the CPU; on a GPU Triton's float32 division is within 2 ulp of IEEE, which
  can move a value sitting on a rounding boundary by one code: allow that, rarely."""
  got, want = np.asarray(q.astype(jnp.float32)), np.asarray(q_ref.astype(jnp.float32))
  assert got.shape == want.shape and q.dtype == q_ref.dtype
  if impl == ("pallas", False):
    ref_f = np.asarray(q_ref.astype(jnp.float32))
    bad = got != want
    assert bad.mean() < 1e-3, bad.mean()
    # a mismatch is one grid step: at most the distance to the next code
    assert np.all(np.abs(got - want)[bad] <= np.maximum(np.abs(ref_f[bad]) * 0.25, 1.0))
  else:
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("fmt", FMTS)
def test_nearest_matches_reference(impl, layout, fmt):
  reduce_axes, contract = LAYOUTS[layout]
  shape = (256, 384) if impl == ("pallas", False) else (32, 48)
  x = draw(shape, zlib.crc32(repr((layout, fmt)).encode()) % 997, jnp.bfloat16)
  q, s = run(impl, x, fmt, reduce_axes, contract_axes=contract)
  q_ref, s_ref = expected(x, fmt, reduce_axes, contract)
  assert_codes_match(impl, q, q_ref)
  np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=3e-7 if impl[1] else 1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", FMTS)
def test_rows_too_small_for_a_normal_scale_quantize_to_zeros(impl, rounding, fmt):
  """A row whose max|x| / qmax is below float32's smallest normal never divides by a 0 scale:
  where the quotient is flushed to 0 (XLA, on the CPU and the GPU) the row gets scale 1 and zero
  codes; where it is kept as a subnormal (the compiled Triton kernel) it is the scale. Either
  way no inf or NaN, and the rows beside it are unaffected."""
  x = draw((32, 48), 611)
  # Row 0: magnitudes 1e-35 with exact zeros; e5m2's quotient 1e-35 / 57344 is subnormal.
  tiny = jnp.where(jnp.arange(48) % 3 == 0, 0.0, 1e-35 * jnp.sign(x[0] + 0.5))
  x = x.at[0].set(tiny)
  key = jax.random.key(12) if rounding == "stochastic" else None
  q, s = run(impl, x, fmt, (1,), rounding, key)
  back = np.asarray(dequantize_reference(q, s))
  assert np.all(np.isfinite(back))
  # The largest error is the row's own magnitude (zeros) or one grid step of it.
  assert np.max(np.abs(back[0] - np.asarray(tiny))) <= 2e-35
  q_ref, _ = quantize_reference(x, fmt, (1,), rounding, key)
  if impl[0] == "reference" or impl[1]:  # bitwise where XLA computes the kernel (see assert_codes_match)
    np.testing.assert_array_equal(
      np.asarray(q[1:].astype(jnp.float32)), np.asarray(q_ref[1:].astype(jnp.float32))
    )
  if fmt == "e5m2":
    row_scale = float(s[0, 0])
    assert row_scale == 1.0 or 0.0 < row_scale < np.finfo(np.float32).tiny
    if row_scale == 1.0:  # flushed: all codes 0
      assert not np.any(np.asarray(q[0].astype(jnp.float32)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["per_row", "per_col_transposed"])
def test_requantize_from_in_scale(impl, layout):
  """A quantized residual re-quantized along the other axis, without a float copy."""
  reduce_axes, contract = LAYOUTS[layout]
  shape = (128, 256) if impl == ("pallas", False) else (32, 64)
  x = draw(shape, 11)
  other = (0,) if reduce_axes == (1,) else (1,)
  q0, s0 = quantize_reference(x, "int8", other)
  q, s = run(impl, q0, "int8", reduce_axes, in_scale=s0, contract_axes=contract)
  q_ref, s_ref = expected(dequantize_reference(q0, s0), "int8", reduce_axes, contract)
  assert_codes_match(impl, q, q_ref)
  np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["per_row", "per_col_transposed"])
@pytest.mark.parametrize(
  "fmt,rounding", [("int8", "stochastic"), ("e5m2", "stochastic"), ("int8", "nearest")]
)
def test_fold_a_scale_along_the_reduced_axis(impl, layout, fmt, rounding):
  """A gradient with a saved operand's scale folded in (``in_scale`` varying along the axis
  the absmax reduces, as in the backward legs of an 8-bit forward): the kernels quantize the
  product, scale from its absmax, as the reference does."""
  reduce_axes, contract = LAYOUTS[layout]
  shape = (128, 256) if impl == ("pallas", False) else (32, 64)
  g = draw(shape, 13)
  fold_shape = tuple(d if a in reduce_axes else 1 for a, d in enumerate(shape))
  in_scale = jnp.exp(jax.random.normal(jax.random.key(14), fold_shape))
  key = jax.random.key(15) if rounding == "stochastic" else None
  q, s = run(impl, g, fmt, reduce_axes, rounding, key, in_scale=in_scale, contract_axes=contract)
  q_ref, s_ref = expected(g * in_scale, fmt, reduce_axes, contract, rounding=rounding, key=key)
  assert_codes_match(impl, q, q_ref)
  np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "e5m2"])
@pytest.mark.parametrize("layout", ["per_row", "per_col_transposed", "per_tensor"])
def test_stochastic_kernel_draws_the_references_noise(fmt, layout):
  """Interpret mode: the kernel's stochastic rounding is the reference's with the same key —
  both hash each element's row-major index (``noise.uniform_noise``), whatever the tiling or
  the output layout."""
  reduce_axes, contract = LAYOUTS[layout]
  x = draw((32, 64), 5)
  key = jax.random.key(7)
  q, _ = api.quantize(
    x, fmt, reduce_axes, "stochastic", key, contract_axes=contract, impl="pallas", interpret=True
  )
  q_ref, _ = expected(x, fmt, reduce_axes, contract, rounding="stochastic", key=key)
  np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), np.asarray(q_ref.astype(jnp.float32)))
  other, _ = expected(x, fmt, reduce_axes, contract, rounding="stochastic", key=jax.random.key(8))
  assert not np.array_equal(np.asarray(other.astype(jnp.float32)), np.asarray(q_ref.astype(jnp.float32)))


def test_int8_codes_round_as_the_reference_on_ties_edges_and_overflow():
  """The kernels' int8 rounding (float adds and integer arithmetic, no floor or conversion
  instruction) equals ``round_to_format``'s: half to even at every tie, floor(y + noise) at exact
  integers, clipped at ±127 from far outside the range."""
  grid = jnp.linspace(-140.0, 140.0, 56001, dtype=jnp.float32)
  ties = jnp.arange(-130, 131, dtype=jnp.float32)
  y = jnp.concatenate([grid, ties, ties + 0.5, jnp.array([3e6, -3e6, 1e30, -1e30, -0.0], jnp.float32)])
  u = jax.random.uniform(jax.random.key(0), y.shape)
  u = jnp.where(jnp.arange(y.size) % 5 == 0, 0.5, jnp.where(jnp.arange(y.size) % 5 == 1, 0.0, u))
  from pallas_kernels.quantize.reference import round_to_format

  for noise_ in (None, u):
    rounding = "nearest" if noise_ is None else "stochastic"
    want = round_to_format(y, "int8", rounding, noise=noise_)
    np.testing.assert_array_equal(np.asarray(kernel.int8_codes(y, noise_)), np.asarray(want))


def test_uniform_noise_hashes_each_elements_row_major_index():
  key = jax.random.key(3)
  got = noise.uniform_noise(key, (4, 6))
  seed = noise.seed_words(key)
  idx = noise.element_index(jnp.arange(4)[:, None], jnp.arange(6)[None, :], 6)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(noise.hash_uniform(seed[0], seed[1], idx)))
  assert got.dtype == jnp.float32 and 0.0 <= float(got.min()) and float(got.max()) < 1.0
  assert len(np.unique(np.asarray(got))) == got.size  # 24 random bits: no repeats among 24 draws


def _bias_z(impl, fmt, rounding, n_rows=4096, n_cols=64, seed=0):
  """z-scores of E[dequantize(quantize(x))] - x over many stochastic draws of one row."""
  row = jax.random.uniform(jax.random.key(seed), (n_cols,), jnp.float32, -1.0, 1.0)
  row = row.at[0].set(1.0)  # pins the per-row scale: every row quantizes identically
  x = jnp.broadcast_to(row, (n_rows, n_cols))
  q, s = run(impl, x, fmt, (1,), rounding, jax.random.key(seed + 1))
  deq = np.asarray(dequantize_reference(q, s), np.float64)
  mean, sd = deq.mean(0), deq.std(0) + 1e-12
  z = (mean - np.asarray(row, np.float64)) / (sd / np.sqrt(n_rows))
  spread = np.asarray(s, np.float64)[0, 0] * (1.0 if fmt == "int8" else 0.25)
  exact = sd < 1e-9 * spread  # values already on the grid: no noise, no bias possible
  return np.where(exact, 0.0, z), mean - np.asarray(row, np.float64)


@pytest.mark.parametrize(
  "impl",
  [
    pytest.param(("reference", False), id="reference"),
    pytest.param(("pallas", True), id="pallas_interpret"),
    pytest.param(("pallas", False), id="pallas_gpu", marks=pytest.mark.gpu),
  ],
)
@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_stochastic_rounding_is_unbiased(impl, fmt):
  """A statistical test that can fail: with 4096 draws per element the mean error of an
  unbiased rounding is within ~4.5 standard errors for all 64 elements (false-alarm rate
  ~1e-4); round-to-nearest fails it (checked below), so the test has power."""
  z, _ = _bias_z(impl, fmt, "stochastic")
  assert np.max(np.abs(z)) < 4.5, np.max(np.abs(z))


def test_unbiasedness_check_has_power():
  _, err = _bias_z(("reference", False), "int8", "nearest", n_rows=8)
  assert np.max(np.abs(err)) > 0.1 * 1.0 / 127  # nearest rounding leaves a visible bias


@pytest.mark.parametrize("impl", [pytest.param(("pallas", True), id="pallas_interpret")])
def test_stochastic_keys(impl):
  x = draw((32, 64), 3)
  a = run(impl, x, "int8", (1,), "stochastic", jax.random.key(1))[0]
  b = run(impl, x, "int8", (1,), "stochastic", jax.random.key(1))[0]
  c = run(impl, x, "int8", (1,), "stochastic", jax.random.key(2))[0]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.any(np.asarray(a) != np.asarray(c))
  y = np.asarray(x) / np.asarray(run(impl, x, "int8", (1,), "stochastic", jax.random.key(1))[1])
  assert np.all((np.asarray(a) == np.floor(y)) | (np.asarray(a) == np.ceil(y)))


def test_shapes_off_the_block_grid():
  """Kernels raise NotImplementedError naming the shape; the api then runs the reference."""
  x = draw((33, 50), 4)
  with pytest.raises(NotImplementedError, match="not a multiple"):
    kernel.quantize_rows(x, "int8", config=kernel.QuantizeConfig(block_rows=8, block_cols=16), interpret=True)
  q, s = api.quantize(x, "int8", (1,), impl="pallas", interpret=True)
  q_ref, s_ref = quantize_reference(x, "int8", (1,))
  np.testing.assert_array_equal(np.asarray(q), np.asarray(q_ref))
  # odd sizes the default config can tile (a 1-wide block) still run in the kernel
  x = draw((7, 12), 4)
  q, _ = kernel.quantize_rows(x, "e4m3", interpret=True)
  assert_codes_match(("pallas", True), q, quantize_reference(x, "e4m3", (1,))[0])


def test_higher_rank_and_fallback_layouts():
  x = draw((4, 6, 16), 8)
  for reduce_axes, contract in [((1, 2), (1, 2)), ((0,), (0,)), ((1,), None)]:
    q, s = api.quantize(x, "int8", reduce_axes, contract_axes=contract, impl="pallas", interpret=True)
    q_ref, s_ref = expected(x, "int8", reduce_axes, contract)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q_ref))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"fmt": "int4"}, "fmt"),
    ({"rounding": "up"}, "rounding"),
    ({"rounding": "stochastic"}, "key"),
    ({"reduce_axes": (2,)}, "reduce_axes"),
    ({"contract_axes": (0, 0)}, "contract_axes"),
    ({"in_scale": jnp.ones((3,))}, "in_scale"),
    ({"impl": "cuda"}, "impl"),
  ],
)
def test_bad_calls_name_the_argument(kwargs, match):
  args = {"x": draw((8, 16), 0), "fmt": "int8", "reduce_axes": (1,)}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    api.quantize(**args)


def test_qformats_cover_every_storage_dtype():
  assert {np.dtype(v[0]).name for v in QFORMATS.values()} == {"int8", "float8_e4m3fn", "float8_e5m2"}


def test_seed_words_are_a_threefry_keys_data_with_no_draw():
  """A split key's two data words seed the hash: no Threefry computation in the program."""
  key = jax.random.split(jax.random.key(3), 2)[1]
  np.testing.assert_array_equal(np.asarray(noise.seed_words(key)), np.asarray(jax.random.key_data(key)))
  prims = {e.primitive.name for e in jax.make_jaxpr(noise.seed_words)(key).eqns}
  assert not prims & {"random_bits", "random_split", "random_fold_in", "threefry2x32"}, prims
  # keys of another implementation (longer data) get two drawn words, different per key
  a, b = (noise.seed_words(jax.random.key(s, impl="rbg")) for s in (3, 4))
  assert a.shape == (2,) and a.dtype == jnp.uint32 and not np.array_equal(np.asarray(a), np.asarray(b))


def test_stream_keys_give_distinct_uncorrelated_streams_with_no_threefry():
  """An op's legs draw from keys derived by integer mixing, not jax.random.split: distinct,
  deterministic, each stream uniform, no two legs' streams correlated, no Threefry."""
  key = jax.random.fold_in(jax.random.key(21), 5)
  keys = noise.stream_keys(key, 6)
  again = noise.stream_keys(key, 6)
  words = [tuple(np.asarray(noise.seed_words(k))) for k in keys]
  assert len(set(words)) == 6 and tuple(np.asarray(jax.random.key_data(key))) not in words
  assert words == [tuple(np.asarray(noise.seed_words(k))) for k in again]
  streams = np.stack([np.asarray(noise.uniform_noise(k, (1 << 16,))) for k in keys])
  # 65536 uniforms: mean 0.5 ± 0.0011 (s.e.), a correlation's s.e. 1/256 = 0.0039; 5 s.e. bounds
  assert np.all(np.abs(streams.mean(1) - 0.5) < 0.006)
  corr = np.corrcoef(streams)
  assert np.max(np.abs(corr - np.eye(6))) < 0.02
  prims = {e.primitive.name for e in jax.make_jaxpr(lambda k: noise.stream_keys(k, 6))(key).eqns}
  assert not prims & {"random_bits", "random_split", "random_fold_in", "threefry2x32"}, prims
  assert noise.stream_keys(None, 3) == [None] * 3
  # keys of another implementation are split by JAX
  rbg = noise.stream_keys(jax.random.key(3, impl="rbg"), 2)
  assert len(rbg) == 2 and not np.array_equal(
    np.asarray(jax.random.key_data(rbg[0])), np.asarray(jax.random.key_data(rbg[1]))
  )


def test_a_forced_implementation_holds_in_its_own_thread_only():
  import threading

  seen = {}
  with api.use_impl("reference"):
    other = threading.Thread(target=lambda: seen.update(other=api._override.current))
    other.start()
    other.join()
    seen["here"] = api._override.current
  seen["after"] = api._override.current
  assert seen == {"other": None, "here": "reference", "after": None}
