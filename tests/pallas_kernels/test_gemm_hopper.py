"""The Mosaic GPU 8-bit GEMM (``pallas_kernels/gemm/hopper.py``).

Mosaic GPU has no CPU lowering (and jax 0.10's GPU interpret mode cannot run the epilogue's
layout-typed loads), so on the CPU the kernel is traced — its body runs under JAX's tracer,
which catches shape and type errors — and the api's fallback is checked; the numerics are
checked against the reference on the GPU (``gpu`` marker, run with the device tool).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.gemm import api, hopper
from pallas_kernels.gemm.reference import scaled_dot_general_reference
from pallas_kernels.quantize.reference import quantize_reference
from tests.tolerances import rel_err

NT = (((1,), (1,)), ((), ()))
PAIRS = {
  "int8": ("int8", "int8"),
  "e4m3": ("e4m3", "e4m3"),
  "e5m2_e4m3": ("e5m2", "e4m3"),  # an input gradient dY·Wᵀ
  "e4m3_e5m2": ("e4m3", "e5m2"),  # a weight gradient Xᵀ·dY
}
MIXED = {"e5m2_e4m3", "e4m3_e5m2"}
MIXED_FP8 = jax.__version_info__ >= (0, 11)


def nt_operands(m, k, n, pair, seed=0):
  ka, kb = jax.random.split(jax.random.key(seed))
  a, sa = quantize_reference(jax.random.normal(ka, (m, k), jnp.float32), PAIRS[pair][0], (1,))
  b, sb = quantize_reference(jax.random.normal(kb, (n, k), jnp.float32), PAIRS[pair][1], (1,))
  return a, b, sa.reshape(m), sb.reshape(n)


def reference_nt(a, b, sa, sb, out_dtype):
  return scaled_dot_general_reference(a, b, sa[:, None], sb[:, None], NT, out_dtype)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_traces_to_one_wgmma_kernel(pair, out_dtype):
  if pair in MIXED and not MIXED_FP8:
    with pytest.raises(NotImplementedError, match="e5m2"):
      hopper.scaled_matmul_nt(*nt_operands(256, 256, 256, pair), out_dtype)
    return
  args = nt_operands(256, 384, 512, pair)
  jaxpr = jax.make_jaxpr(functools.partial(hopper.scaled_matmul_nt, out_dtype=out_dtype))(*args)
  (out,) = jaxpr.out_avals
  assert out.shape == (256, 512) and out.dtype == jnp.dtype(out_dtype)
  text = str(jaxpr)
  # one kernel whose body issues wgmma into an accumulator and stores through shared memory
  assert text.count("mpmd_map") == 1
  for primitive in ("wgmma_ref", "wgmma_wait", "wgmma_accumulator_deref", "copy_smem_to_gmem"):
    assert primitive in text


@pytest.mark.parametrize(
  "shape,dim", [((200, 256, 256), "M=200"), ((256, 256, 320), "N=320"), ((256, 192, 256), "K=192")]
)
def test_shapes_off_the_tile_grid_are_refused(shape, dim):
  m, k, n = shape
  with pytest.raises(NotImplementedError, match=dim):
    hopper.scaled_matmul_nt(*nt_operands(m, k, n, "int8"))


def test_bad_operands():
  a, b, sa, sb = nt_operands(256, 256, 256, "int8")
  with pytest.raises(NotImplementedError, match="int8×int8"):
    hopper.scaled_matmul_nt(a.astype(jnp.bfloat16), b, sa, sb)
  with pytest.raises(ValueError, match="contraction"):
    hopper.scaled_matmul_nt(a, b[:, :128], sa, sb)


def test_api_mosaic_off_gpu_falls_back_to_the_same_numbers():
  """impl='mosaic' where the kernel cannot run (here: the CPU; on a GPU: a bias, an off-grid
  shape) computes the reference's values through XLA."""
  lq, ls = quantize_reference(jax.random.normal(jax.random.key(1), (32, 64)), "int8", (1,))
  rq, rs = quantize_reference(jax.random.normal(jax.random.key(2), (64, 48)), "int8", (0,))
  dims = (((1,), (0,)), ((), ()))
  out = api.scaled_dot_general(lq, rq, ls, rs, dims, impl="mosaic")
  assert rel_err(out, scaled_dot_general_reference(lq, rq, ls, rs, dims)) < 4e-6


@pytest.mark.gpu
@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(128, 128, 256), (384, 640, 768)])
def test_kernel_matches_reference_on_gpu(pair, out_dtype, shape):
  m, k, n = shape
  args = nt_operands(m, k, n, pair, seed=m + k)
  if pair in MIXED and not MIXED_FP8:  # mixed-fp8 wgmma came in jax 0.11: refused before
    with pytest.raises(NotImplementedError, match="e5m2"):
      hopper.scaled_matmul_nt(*args, out_dtype)
    return
  out = jax.jit(functools.partial(hopper.scaled_matmul_nt, out_dtype=out_dtype))(*args)
  ref = reference_nt(*args, jnp.float32)
  # int32 sums are exact and the epilogue is the reference's float32 arithmetic: a bf16 result
  # is one rounding from it. fp8 tensor cores add partial sums with ~14 mantissa bits before
  # the float32 accumulator (as in test_gemm.py): not float32-tight.
  tol = 4e-3 if out_dtype == jnp.bfloat16 else (1e-6 if pair == "int8" else 2e-3)
  assert out.dtype == jnp.dtype(out_dtype) and rel_err(out, ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize(
  "lhs,rhs,dims",
  [
    ((256, 512), (512, 256), (((1,), (0,)), ((), ()))),  # forward X·W
    ((256, 256), (512, 256), (((1,), (1,)), ((), ()))),  # dlhs dY·Wᵀ
    ((512, 256), (512, 256), (((0,), (0,)), ((), ()))),  # drhs Xᵀ·dY
  ],
)
def test_training_gemms_through_the_api_run_the_mosaic_kernel(lhs, rhs, dims):
  (lc, rc), _ = dims
  lq, ls = quantize_reference(jax.random.normal(jax.random.key(1), lhs), "int8", lc)
  rq, rs = quantize_reference(jax.random.normal(jax.random.key(2), rhs), "int8", rc)
  f = jax.jit(lambda *a: api.scaled_dot_general(*a, dims, jnp.float32, impl="mosaic"))
  assert "mosaic_gpu" in f.lower(lq, rq, ls, rs).as_text()
  assert rel_err(f(lq, rq, ls, rs), scaled_dot_general_reference(lq, rq, ls, rs, dims)) < 1e-6


def test_api_mosaic_hands_a_weight_gradient_to_the_kernel_as_it_is(monkeypatch):
  """A weight gradient's e4m3 · e5m2 product (Xᵀ·dY) reaches the kernel in that order, its
  result in the product's own layout: a transposed product would leave XLA a transpose of
  the weight gradient, which it fuses into the optimizer update (a slow multi-output
  transpose fusion on a GPU). On the CPU the kernel is replaced by its reference."""
  calls = []

  def kernel(a, b, sa, sb, out_dtype=jnp.bfloat16, config=None):
    calls.append((a.dtype, a.shape, b.dtype, b.shape))
    return reference_nt(a, b, sa, sb, out_dtype)

  monkeypatch.setattr(api, "on_gpu", lambda: True)
  monkeypatch.setattr(hopper, "scaled_matmul_nt", kernel)
  lq, ls = quantize_reference(jax.random.normal(jax.random.key(1), (256, 128)), "e4m3", (0,))  # X
  rq, rs = quantize_reference(jax.random.normal(jax.random.key(2), (256, 512)), "e5m2", (0,))  # dY
  dims = (((0,), (0,)), ((), ()))
  out = api.scaled_dot_general(lq, rq, ls, rs, dims, jnp.float32, impl="mosaic")
  e4m3, e5m2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
  assert calls == [(e4m3, (128, 256), e5m2, (512, 256))]
  assert out.shape == (128, 512)
  assert rel_err(out, scaled_dot_general_reference(lq, rq, ls, rs, dims)) < 1e-6


@pytest.mark.parametrize(
  "a,b,mixed",
  [
    ("int8", "int8", False),
    ("e4m3", "e4m3", False),
    ("e5m2", "e4m3", True),
    ("e4m3", "e5m2", True),
    ("e5m2", "e5m2", None),
    ("int8", "e4m3", None),
  ],
)
def test_supported_pairs(a, b, mixed):
  """Mixed e4m3/e5m2 pairs run from jax 0.11 (mixed-type wgmma); e5m2×e5m2 (no product of
  the training step) and int8 with fp8 never."""
  dtypes = {"int8": jnp.int8, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
  expected = False if mixed is None else (MIXED_FP8 or not mixed)
  assert hopper._supported(dtypes[a], dtypes[b]) is expected


@pytest.mark.gpu
def test_weight_gradient_e4m3_times_e5m2_runs_the_mosaic_kernel():
  lq, ls = quantize_reference(jax.random.normal(jax.random.key(1), (512, 256)), "e4m3", (0,))
  rq, rs = quantize_reference(jax.random.normal(jax.random.key(2), (512, 256)), "e5m2", (0,))
  dims = (((0,), (0,)), ((), ()))
  f = jax.jit(lambda *a: api.scaled_dot_general(*a, dims, jnp.float32, impl="mosaic"))
  assert ("mosaic_gpu" in f.lower(lq, rq, ls, rs).as_text()) == MIXED_FP8
  assert rel_err(f(lq, rq, ls, rs), scaled_dot_general_reference(lq, rq, ls, rs, dims)) < 2e-3
