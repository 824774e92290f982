"""scaled_dot_general: one suite over every implementation (reference, XLA contraction-major,
the Pallas kernel in interpret mode, the compiled kernel on a GPU) against the reference."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemm import api, kernel
from pallas_kernels.gemm.config import GemmConfig
from pallas_kernels.gemm.reference import scaled_dot_general_reference
from pallas_kernels.quantize.reference import quantize_reference
from tests.tolerances import TIGHT, rel_err

# name: (lhs shape, rhs shape, dimension numbers, contraction size)
CASES = {
  "fwd_XW": ((32, 64), (64, 48), (((1,), (0,)), ((), ()))),
  "dlhs_dYWt": ((32, 48), (64, 48), (((1,), (1,)), ((), ()))),
  "drhs_XtdY": ((64, 32), (64, 48), (((0,), (0,)), ((), ()))),
  "dense_3d": ((2, 16, 64), (64, 32), (((2,), (0,)), ((), ()))),
  "two_contract_axes": ((16, 4, 32), (4, 32, 16), (((1, 2), (0, 1)), ((), ()))),
  "swapped_contract_order": ((16, 4, 32), (32, 4, 16), (((1, 2), (1, 0)), ((), ()))),
  "batched": ((2, 16, 32), (2, 32, 16), (((2,), (1,)), ((0,), (0,)))),
}
TYPES = {
  "int8": ("int8", "int8"),
  "e4m3": ("e4m3", "e4m3"),
  "e5m2_e4m3": ("e5m2", "e4m3"),
}
IMPLS = [
  pytest.param(("reference", False), id="reference"),
  pytest.param(("xla", False), id="xla"),
  pytest.param(("pallas", True), id="pallas_interpret"),
  pytest.param(("pallas", False), id="pallas_gpu", marks=pytest.mark.gpu),
  pytest.param(("xla", False), id="xla_gpu", marks=pytest.mark.gpu),
  # Hopper only; shapes off its 128 grid and calls with a bias fall back to XLA (api's rule)
  pytest.param(("mosaic", False), id="mosaic_gpu", marks=pytest.mark.gpu),
]
SMALL_CONFIG = GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)


def operand(shape, contract, fmt, seed):
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  return quantize_reference(x, fmt, contract)


def scale_up(shape, factor):
  return tuple(d * factor if d >= 16 else d for d in shape)


# Every dimension-number case in int8; the three training GEMMs in each fp8 pairing.
TYPE_CASES = [("int8", c) for c in sorted(CASES)] + [
  (t, c) for t in ("e4m3", "e5m2_e4m3") for c in ("fwd_XW", "dlhs_dYWt", "drhs_XtdY")
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("types,case", TYPE_CASES)
def test_matches_reference(impl, types, case):
  name, interpret = impl
  on_gpu = impl[1] is False and name != "reference" and jax.default_backend() == "gpu"
  ls, rs, dims = CASES[case]
  if on_gpu:  # sizes that fill a 128x256 tile on the GPU
    ls, rs = scale_up(ls, 8), scale_up(rs, 8)
  (lc, rc), _ = dims
  seed = zlib.crc32(repr((case, types)).encode()) % 1000
  lq, lsc = operand(ls, lc, TYPES[types][0], seed)
  rq, rsc = operand(rs, rc, TYPES[types][1], seed + 1)
  config = SMALL_CONFIG if interpret else None
  out = api.scaled_dot_general(
    lq, rq, lsc, rsc, dims, jnp.float32, impl=name, config=config, interpret=interpret
  )
  ref = scaled_dot_general_reference(lq, rq, lsc, rsc, dims, jnp.float32)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  tol = TIGHT["int8" if types == "int8" else "fp8"] * 4  # int32 sums are exact; the epilogue is not
  if on_gpu and types != "int8":
    # Hopper's fp8 tensor cores add partial sums with ~14 mantissa bits before the float32
    # accumulator (DeepSeek-V3 report, §3.3.2), cuBLAS and Triton alike: not float32-tight.
    tol = 2e-3
  assert rel_err(out, ref) < tol


@pytest.mark.parametrize("impl", IMPLS)
def test_bias_and_bf16_output(impl):
  name, interpret = impl
  m, k, n = (
    (256, 512, 256)
    if not interpret and name != "reference" and jax.default_backend() == "gpu"
    else (32, 64, 16)
  )
  lq, ls = operand((m, k), (1,), "int8", 1)
  rq, rs = operand((k, n), (0,), "int8", 2)
  bias = jax.random.normal(jax.random.key(3), (n,), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  out = api.scaled_dot_general(
    lq,
    rq,
    ls,
    rs,
    dims,
    jnp.bfloat16,
    bias=bias,
    impl=name,
    config=SMALL_CONFIG if interpret else None,
    interpret=interpret,
  )
  ref = scaled_dot_general_reference(lq, rq, ls, rs, dims, jnp.bfloat16, bias)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, ref) < 4e-3  # one bf16 rounding apart at most


@pytest.mark.parametrize("a_kmajor", [True, False])
@pytest.mark.parametrize("b_kmajor", [True, False])
@pytest.mark.parametrize("types", sorted(TYPES))
def test_kernel_reads_every_layout_in_place(a_kmajor, b_kmajor, types):
  """The three training GEMM layouts (and the fourth) without transposed copies."""
  m, k, n = 32, 64, 48
  a, sa = operand((m, k) if a_kmajor else (k, m), (1,) if a_kmajor else (0,), TYPES[types][0], 5)
  b, sb = operand((n, k) if b_kmajor else (k, n), (1,) if b_kmajor else (0,), TYPES[types][1], 6)
  out = kernel.scaled_matmul(
    a,
    b,
    sa.reshape(m),
    sb.reshape(n),
    a_kmajor=a_kmajor,
    b_kmajor=b_kmajor,
    config=SMALL_CONFIG,
    interpret=True,
  )
  dims = (((1 if a_kmajor else 0,), (1 if b_kmajor else 0,)), ((), ()))
  ref = scaled_dot_general_reference(a, b, sa, sb, dims)
  assert rel_err(out, ref) < 4e-6


def test_shapes_off_the_block_grid():
  lq, ls = operand((40, 96), (1,), "int8", 7)
  rq, rs = operand((96, 24), (0,), "int8", 8)
  with pytest.raises(NotImplementedError, match="not a multiple"):
    kernel.scaled_matmul(
      lq, rq.T, ls.reshape(40), rs.reshape(24), config=GemmConfig(32, 16, 32), interpret=True
    )
  dims = (((1,), (0,)), ((), ()))
  out = api.scaled_dot_general(
    lq, rq, ls, rs, dims, impl="pallas", config=GemmConfig(32, 16, 32), interpret=True
  )
  np.testing.assert_allclose(out, scaled_dot_general_reference(lq, rq, ls, rs, dims), rtol=1e-6)


@pytest.mark.parametrize(
  "change,match",
  [
    ({"dimension_numbers": (((3,), (0,)), ((), ()))}, "dimension_numbers"),
    ({"dimension_numbers": "ij,jk"}, "dimension_numbers"),
    ({"lhs_scale": jnp.ones((32, 64))}, "lhs_scale"),
    ({"impl": "cublas"}, "impl"),
    ({"bias": jnp.ones((7,))}, "bias"),
  ],
)
def test_bad_calls_name_the_argument(change, match):
  lq, ls = operand((32, 64), (1,), "int8", 1)
  rq, rs = operand((64, 48), (0,), "int8", 2)
  args = {
    "lhs_q": lq,
    "rhs_q": rq,
    "lhs_scale": ls,
    "rhs_scale": rs,
    "dimension_numbers": (((1,), (0,)), ((), ())),
  }
  args.update(change)
  impl = args.pop("impl", "xla")
  with pytest.raises(ValueError, match=match):
    api.scaled_dot_general(**args, impl=impl)


@pytest.mark.gpu
def test_auto_runs_the_architectures_implementation_on_gpu():
  """On a GPU, 'auto' lowers to the implementation the architecture table names first for a
  long contraction (a Mosaic GPU kernel on Hopper, cuBLAS through XLA elsewhere)."""
  from pallas_kernels._platform import gpu_arch
  from pallas_kernels.arch import SHORT_K, gemm_impls

  lq, ls = operand((256, 512), (1,), "int8", 1)
  rq, rs = operand((512, 256), (0,), "int8", 2)
  dims = (((1,), (0,)), ((), ()))
  hlo = jax.jit(lambda *a: api.scaled_dot_general(*a, dims)).lower(lq, rq, ls, rs).as_text()
  first = gemm_impls(gpu_arch(), "int8", 512)[0]
  if first == "mosaic":
    assert "mosaic_gpu" in hlo
  else:
    assert "dot_general" in hlo and "triton" not in hlo and "mosaic_gpu" not in hlo
  if gemm_impls(gpu_arch(), "int8", SHORT_K)[0] != "pallas":
    return
  # a short contraction takes the fused-epilogue kernel
  lq, ls = operand((256, SHORT_K), (1,), "int8", 3)
  rq, rs = operand((SHORT_K, 256), (0,), "int8", 4)
  hlo = jax.jit(lambda *a: api.scaled_dot_general(*a, dims)).lower(lq, rq, ls, rs).as_text()
  assert "triton" in hlo


def test_use_impl_auto_forces_nothing():
  """``use_impl("auto")`` (the benchmarks' default case) leaves the op's own choice in place:
  it once forced the literal 'auto', which the GEMM api ran as XLA."""
  with api.use_impl("mosaic"):
    with api.use_impl("auto"):
      assert api._override.current is None
    assert api._override.current == "mosaic"
  with pytest.raises(ValueError, match="impl"):
    with api.use_impl("cublas"):
      pass
