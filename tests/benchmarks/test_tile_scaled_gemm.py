"""``benchmarks/diagnosis/tile_scaled_gemm.py``: the tile-scaled 8-bit GEMMs and the tile quantizer,
in interpret mode against their jnp references and against the float product."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.diagnosis import tile_scaled_gemm as tsg

M, K, N = 256, 512, 256
CONFIG = tsg.TileConfig(64, 128, 4, 3)
X_TILE_MAGNITUDE = (1.0, 100.0, 0.01, 10.0)
"""Each 128-column tile of X is this much larger than the first: the four K blocks' scales differ by
up to 10⁴, so a product that left out the per-block promotion would be off by far more than rounding."""
W_BLOCK_MAGNITUDE = (1.0, 0.1, 10.0, 1.0)
"""Likewise for W's four 128-row block rows."""


def operands():
  kx, kw = jax.random.split(jax.random.key(7))
  x = jax.random.normal(kx, (M, K), jnp.float32) * jnp.repeat(jnp.array(X_TILE_MAGNITUDE), tsg.TILE)
  x = x.at[:8, : tsg.TILE].set(0.0)  # a zero tile: scale 1, zero codes
  w = jax.random.normal(kw, (K, N), jnp.float32) * jnp.repeat(jnp.array(W_BLOCK_MAGNITUDE), tsg.TILE)[:, None]
  return x.astype(jnp.bfloat16), (w / K**0.5).astype(jnp.bfloat16)


@functools.cache
def results(fmt: str) -> dict:
  """Every kernel of ``fmt`` in interpret mode, beside its reference, on ``operands()``."""
  x, w = operands()
  qx, sx = tsg.quantize_tiles(x, fmt, interpret=True)
  qw, sw = tsg.quantize_weight_blocks(w, fmt)
  qx_t, sx_t = tsg.quantize_per_tensor(x, fmt)
  qw_t, sw_t = tsg.quantize_per_tensor(w.T, fmt)
  qw_c, sw_c = tsg._vector_scale(tsg.quantize_reference(w.T, fmt, (1,)))
  run = functools.partial(tsg.block_scaled_matmul, config=CONFIG, out_dtype=jnp.float32, interpret=True)
  ref = tsg.block_scaled_matmul_reference
  return {
    "quantized": (qx, sx),
    "quantized_reference": tsg.quantize_tiles_reference(x, fmt),
    "on_load": (
      run(x, None, qw, tsg.expand_block_scales(sw), variant="on_load"),
      ref(None, None, qw, sw, variant="on_load", x=x),
    ),
    "tile_scaled": (
      run(qx, sx, qw, tsg.expand_block_scales(sw), variant="tile_scaled"),
      ref(qx, sx, qw, sw, variant="tile_scaled"),
    ),
    "tile_rows": (
      run(qx, sx, qw_c, sw_c, variant="tile_rows"),
      ref(qx, sx, qw_c, sw_c, variant="tile_rows"),
    ),
    "per_tensor": (
      run(qx_t, sx_t, qw_t, sw_t, variant="per_tensor"),
      ref(qx_t, sx_t, qw_t, sw_t, variant="per_tensor"),
    ),
    "tile_scaled_convert": run(
      qx, sx, qw, tsg.expand_block_scales(sw), variant="tile_scaled", int_to_float="convert"
    )
    if fmt == "int8"
    else None,
    "codes": (qx, sx, qw, sw),
    "exact": x.astype(jnp.float32) @ w.astype(jnp.float32),
  }


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_the_tile_quantizer_writes_the_references_codes_and_scales(fmt):
  got = results(fmt)
  (qx, sx), (rq, rs) = got["quantized"], got["quantized_reference"]
  assert qx.dtype == tsg.QFORMATS[fmt][0] and qx.shape == (M, K) and sx.shape == (K // tsg.TILE, M)
  np.testing.assert_array_equal(np.asarray(qx.astype(jnp.float32)), np.asarray(rq.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(sx), np.asarray(rs))
  assert float(sx[0, 0]) == 1.0 and not np.any(np.asarray(qx[:8, : tsg.TILE].astype(jnp.float32)))
  # one scale per row and tile: the four tiles' scales follow their magnitudes
  ratios = np.median(np.asarray(sx[:, 8:]) / np.asarray(sx[:1, 8:]), axis=1)
  np.testing.assert_allclose(ratios, X_TILE_MAGNITUDE, rtol=0.2)


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
@pytest.mark.parametrize("variant", tsg.VARIANTS)
def test_each_variant_matches_its_jnp_reference(fmt, variant):
  got, want = results(fmt)[variant]
  assert got.shape == (M, N) and got.dtype == jnp.float32
  # int8: each K block's product is an exact integer (below 2**24, exact in float32) and kernel and
  # reference apply the same float32 scale-multiply-add per block in the same order; XLA may fuse
  # a multiply-add into an FMA in one and not the other: a few float32 ulps of the result per K
  # block. e4m3: the 128 products of a block (exact in float32) are summed in an order the dot
  # leaves to the backend: up to ~128 ulps of the block's magnitude (per_tensor sums 512 at once).
  ulps = 4 * (K // tsg.TILE) if fmt == "int8" else 4 * K
  atol = ulps * np.finfo(np.float32).eps * float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=atol)


def test_int8_block_products_become_the_same_floats_by_bits_as_by_the_conversion():
  got = results("int8")
  np.testing.assert_array_equal(np.asarray(got["tile_scaled_convert"]), np.asarray(got["tile_scaled"][0]))
  p = jnp.array([0, 1, -1, 2_064_512, -2_064_512, 4_194_303, -4_194_303], jnp.int32)  # up to |p| < 2**22
  np.testing.assert_array_equal(np.asarray(tsg._to_float32(p, "bits")), np.asarray(p, np.float32))


def dropped_promotion(qx, sx, qw, sw):
  """The product of the same codes with the block scales applied once after the K loop (the
  first K block's, as a kernel that forgot the promotion would): what the check below rejects."""
  acc_dtype = jnp.int32 if qw.dtype == jnp.int8 else jnp.float32
  acc = jax.lax.dot_general(qx, qw, tsg.DIMS_NT, preferred_element_type=acc_dtype).astype(jnp.float32)
  return acc * sx[0][:, None] * tsg.expand_block_scales(sw)[0][None, :]


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_the_per_block_promotion_keeps_the_product_of_tiles_of_very_different_scales(fmt):
  got = results(fmt)
  exact = got["exact"]
  # both operands rounded to 8 bits per tile / block: ~1 % relative error of the product for int8
  # (half a step of 127 levels below each tile's absmax), ~4 % for e4m3 (3 mantissa bits)
  tolerance = 0.03 if fmt == "int8" else 0.08
  # (``tile_rows``, W per column over all of K, is checked against its reference only: this W's block
  # rows 100x apart leave its smallest block few int8 levels, by design of the data)
  for variant in ("on_load", "tile_scaled"):
    assert float(tsg.rel_err(got[variant][0], exact)) < tolerance, variant
  # the same codes without the promotion are off by the ratio of the blocks' scales
  assert float(tsg.rel_err(dropped_promotion(*got["codes"]), exact)) > 0.5
  if fmt == "int8":
    # one int8 scale for all of X and W leaves the small tiles few levels: worse than per tile (e4m3's
    # exponent covers the 10⁴ spread, so one scale loses nothing there)
    per_tensor, tiled = (float(tsg.rel_err(got[v][0], exact)) for v in ("per_tensor", "tile_scaled"))
    assert per_tensor > 2 * tiled


def test_every_kernel_lowers_to_triton_for_a_gpu():
  """The Pallas Triton lowering (what a GPU compiles) of each kernel and format, at every block
  config of the sweep, traced and lowered on the CPU."""
  shape = jax.ShapeDtypeStruct
  for fmt in ("int8", "e4m3"):
    codes = tsg.QFORMATS[fmt][0]
    lowered = [tsg.quantize_tiles.trace(shape((M, K), jnp.bfloat16), fmt).lower(lowering_platforms=("cuda",))]
    for config in tsg.CONFIGS:
      for variant, convert in [(v, "bits") for v in tsg.VARIANTS] + [("tile_scaled", "convert")]:
        x = shape((M, K), jnp.bfloat16 if variant == "on_load" else codes)
        per_tensor = variant == "per_tensor"
        sx = None if variant == "on_load" else shape((M,) if per_tensor else (K // tsg.TILE, M), jnp.float32)
        sw = shape((N,) if variant in ("per_tensor", "tile_rows") else (K // tsg.TILE, N), jnp.float32)
        lowered.append(
          tsg.block_scaled_matmul.trace(
            x, sx, shape((N, K), codes), sw, variant=variant, config=config, int_to_float=convert
          ).lower(lowering_platforms=("cuda",))
        )
    for low in lowered:
      assert "__gpu$xla.gpu.triton" in low.as_text()


def test_a_shape_off_the_tiles_and_an_unknown_variant_are_refused_with_the_fix():
  with pytest.raises(SystemExit, match="K a power of two"):
    tsg.parse_shapes("qkv,8192x3000x6144", tsg.SHAPES)
  assert tsg.parse_shapes("qkv,256x512x256", tsg.SHAPES) == {
    "qkv": tsg.SHAPES["qkv"],
    "256x512x256": (256, 512, 256),
  }
  x = jnp.zeros((M, K), jnp.int8)
  with pytest.raises(ValueError, match="variant='fused'"):
    tsg.block_scaled_matmul(x, None, x, None, variant="fused")
  with pytest.raises(ValueError, match="N=192 is not a multiple"):
    tsg.block_scaled_matmul(
      x, jnp.ones((M,)), jnp.zeros((192, K), jnp.int8), jnp.ones((192,)), variant="per_tensor"
    )
