"""Picks the implementation of the scaled low-precision GEMM.

``scaled_dot_general(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, out_dtype)`` is
``reference.scaled_dot_general_reference``. Implementations:

* ``reference``: the jnp definition (CPU, fallback, oracle).
* ``xla``: the same arithmetic, with both operands handed to XLA's 8-bit ``dot_general``
  contraction-major ("NT": ``[M, K]·[N, K]ᵀ``), the layout Hopper's 8-bit tensor cores read
  (faster than a row-major right operand, ``docs/kernels.md``); XLA fuses the scale
  epilogue into one elementwise pass over the accumulator.
* ``pallas``: ``kernel.scaled_matmul``, the epilogue fused into the GEMM.
* ``mosaic``: ``hopper.scaled_matmul_nt`` (Pallas Mosaic GPU: TMA + wgmma,
  warp-specialized; int8, e4m3, e5m2×e4m3, e4m3×e5m2), the epilogue fused into the GEMM.

``impl='auto'`` runs, on a GPU, the first implementation that the architecture's entry of
``pallas_kernels.arch.KERNELS`` lists for the operand kind and contraction length (an untested
one only if a tiny instance of it compiles there, ``_platform.compiles``), and the reference
elsewhere. General
dimension numbers are flattened to one 2-D product when the operands allow it (no batch
dims); otherwise the reference runs (XLA's own dot_general).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._platform import ImplOverride, compiles, gpu_arch, on_gpu
from pallas_kernels.arch import arch_kernels, gemm_impls
from pallas_kernels.gemm import hopper as _hopper
from pallas_kernels.gemm import kernel as _kernel
from pallas_kernels.gemm.config import GemmConfig
from pallas_kernels.gemm.reference import accumulator_dtype, free_axes, scaled_dot_general_reference

IMPLS = ("auto", "pallas", "mosaic", "xla", "reference")

_override = ImplOverride(IMPLS)
use_impl = _override.use
"""``with use_impl("reference"): ...``: calls traced in the block use that implementation."""


class Canonical(NamedTuple):
  """The GEMM as ``out[M, N] = A·Bᵀ`` over 2-D views of the operands."""

  a: jax.Array  # [M, K] if a_kmajor else [K, M]
  b: jax.Array  # [N, K] if b_kmajor else [K, N]
  a_kmajor: bool
  b_kmajor: bool
  a_scale: jax.Array  # [M] float32
  b_scale: jax.Array  # [N] float32
  bias: jax.Array | None  # [N]
  out_shape: tuple[int, ...]

  def kmajor(self) -> tuple[jax.Array, jax.Array]:
    """``(A [M, K], B [N, K])``: both operands contraction-major (an XLA transpose where one
    is not), the layout Hopper's 8-bit MMA path reads."""
    return (self.a if self.a_kmajor else self.a.T), (self.b if self.b_kmajor else self.b.T)


def _scale_vector(scale, ndim, contract, free, shape, name):
  if scale.ndim != ndim:
    raise ValueError(f"{name} of shape {scale.shape} must have its operand's rank {ndim}.")
  for a in contract:
    if scale.shape[a] != 1:
      raise ValueError(
        f"{name} of shape {scale.shape} varies along contracting axis {a}; scales must be "
        "per tensor or per channel over the non-contracting axes."
      )
  free_shape = tuple(shape[a] for a in free)
  s = jnp.transpose(scale, tuple(free) + tuple(contract)).reshape(tuple(scale.shape[a] for a in free))
  return jnp.broadcast_to(s.astype(jnp.float32), free_shape).reshape(math.prod(free_shape))


def _view(x, free, contract):
  """``(2-D array, kmajor)`` of ``x`` as ``[free, contract]``, in place when possible."""
  nf, nk = math.prod(x.shape[a] for a in free), math.prod(x.shape[a] for a in contract)
  axes = list(range(x.ndim))
  if axes == list(free) + list(contract):
    return x.reshape(nf, nk), True
  if axes == list(contract) + list(free):
    return x.reshape(nk, nf), False
  return jnp.transpose(x, tuple(free) + tuple(contract)).reshape(nf, nk), True


def canonicalize(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, bias=None) -> Canonical:
  """The 2-D form of a dot_general with no batch dims; ``NotImplementedError`` otherwise."""
  (lc, rc), (lb, rb) = dimension_numbers
  if lb or rb:
    raise NotImplementedError("batch dimensions: the reference (XLA dot_general) runs them")
  lf, rf = free_axes(lhs_q.ndim, lc, lb), free_axes(rhs_q.ndim, rc, rb)
  order = sorted(range(len(lc)), key=lambda i: lc[i])  # pair the K axes in lhs memory order
  lk, rk = [lc[i] for i in order], [rc[i] for i in order]
  a, a_kmajor = _view(lhs_q, lf, lk)
  b, b_kmajor = _view(rhs_q, rf, rk)
  sa = _scale_vector(lhs_scale, lhs_q.ndim, lc, lf, lhs_q.shape, "lhs_scale")
  sb = _scale_vector(rhs_scale, rhs_q.ndim, rc, rf, rhs_q.shape, "rhs_scale")
  rf_shape = tuple(rhs_q.shape[x] for x in rf)
  if bias is not None:
    if tuple(bias.shape) != rf_shape:
      raise ValueError(f"bias of shape {bias.shape} must have the rhs free shape {rf_shape}.")
    bias = bias.reshape(math.prod(rf_shape))
  out_shape = tuple(lhs_q.shape[x] for x in lf) + rf_shape
  return Canonical(a, b, a_kmajor, b_kmajor, sa, sb, bias, out_shape)


def xla_nt(c: Canonical, out_dtype) -> jax.Array:
  """XLA's dot_general on contraction-major operands, then the scale epilogue (fused by XLA)."""
  a, b = c.kmajor()
  acc = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=accumulator_dtype(a.dtype))
  out = acc.astype(jnp.float32) * c.a_scale[:, None]
  out = out * c.b_scale[None, :]
  if c.bias is not None:
    out = out + c.bias.astype(jnp.float32)[None, :]
  return out.astype(out_dtype)


def pallas_nt(c: Canonical, out_dtype, config=None, interpret=False) -> jax.Array:
  """The Pallas kernel on contraction-major operands (non-contraction-major 8-bit operands are
  transposed first by XLA, one byte per element, since Hopper's 8-bit MMA path wants that
  layout; the kernel itself also reads the other layouts in place)."""
  a, b = c.kmajor()
  return _kernel.scaled_matmul(
    a,
    b,
    c.a_scale,
    c.b_scale,
    a_kmajor=True,
    b_kmajor=True,
    bias=c.bias,
    out_dtype=out_dtype,
    config=config,
    interpret=interpret,
  )


def mosaic_nt(c: Canonical, out_dtype) -> jax.Array:
  """The Mosaic GPU kernel (no bias, GPU only, CTA-tile multiples; ``NotImplementedError``
  otherwise), on contraction-major operands."""
  if c.bias is not None or not on_gpu():
    raise NotImplementedError("the Mosaic GPU GEMM takes no bias and runs on a GPU only")
  a, b = c.kmajor()
  return _hopper.scaled_matmul_nt(a, b, c.a_scale, c.b_scale, out_dtype)


def _validate(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}.")
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
  except (TypeError, ValueError):
    raise ValueError(
      f"dimension_numbers={dimension_numbers!r} must be ((lhs_contract, rhs_contract), "
      "(lhs_batch, rhs_batch))."
    ) from None
  (lc, rc), (lb, rb) = dims
  for name, x, axes in (("lhs_q", lhs_q, lc + lb), ("rhs_q", rhs_q, rc + rb)):
    if any(a < 0 or a >= x.ndim for a in axes) or len(set(axes)) != len(axes):
      raise ValueError(f"dimension_numbers={dims} name invalid axes of {name} (rank {x.ndim}).")
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"dimension_numbers={dims}: lhs and rhs need as many contract and batch axes.")
  for a, b in zip(lc + lb, rc + rb):
    if lhs_q.shape[a] != rhs_q.shape[b]:
      raise ValueError(f"lhs_q axis {a} ({lhs_q.shape[a]}) and rhs_q axis {b} ({rhs_q.shape[b]}) differ.")
  for name, s in (("lhs_scale", lhs_scale), ("rhs_scale", rhs_scale)):
    if not hasattr(s, "ndim"):
      raise ValueError(f"{name} must be an array, got {type(s).__name__}.")
  return dims


def _auto(kind, lhs_q, dims) -> str:
  """The implementation ``impl='auto'`` runs on this GPU (see the module docstring)."""
  if kind is None:
    return "reference"
  arch = gpu_arch()
  if arch is None:  # a GPU whose compute capability JAX does not report: XLA's dot runs anywhere
    return "xla"
  k = math.prod(lhs_q.shape[a] for a in dims[0][0])
  tested = arch_kernels(arch).tested
  for impl in gemm_impls(arch, kind, k):
    # XLA's dot and the reference compile anywhere; a Pallas kernel no test ran here is tried
    if impl in ("xla", "reference") or impl in tested:
      return impl
    if compiles(f"{impl} {kind} GEMM", arch, lambda impl=impl: _probe(impl, kind)):
      return impl
  return "reference"


def _probe(impl: str, kind: str):
  """Lowers and compiles ``impl`` on a tiny ``kind`` product (on its tile grid, K = 256)."""
  dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
  operand = jax.ShapeDtypeStruct((256, 256), dtype)
  scale = jax.ShapeDtypeStruct((256, 1), jnp.float32)
  dims = (((1,), (1,)), ((), ()))
  fn = jax.jit(lambda a, b, sa, sb: scaled_dot_general(a, b, sa, sb.T, dims, jnp.bfloat16, impl=impl))
  return fn.lower(operand, operand, scale, scale).compile()


def _kind(dtype) -> str | None:
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:
    return "int8"
  if dtype in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
    return "fp8"
  return None


def scaled_dot_general(
  lhs_q,
  rhs_q,
  lhs_scale,
  rhs_scale,
  dimension_numbers,
  out_dtype=jnp.float32,
  *,
  bias=None,
  impl: str = "auto",
  config: GemmConfig | None = None,
  interpret: bool = False,
):
  """See ``reference.scaled_dot_general_reference``; ``impl`` picks who computes it.

  Args:
    lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, out_dtype: as for the reference.
    bias: optional, shaped like the rhs free dims; added in float32 before the cast.
    impl: 'auto' (on a GPU the architecture's choice, ``pallas_kernels.arch``; the reference
      elsewhere), 'pallas', 'mosaic', 'xla' or 'reference'. A case an implementation cannot take falls back (pallas / mosaic → xla →
      reference).
    config: the Pallas kernel's block sizes (default: ``config.default_config``).
    interpret: run the Pallas kernel in interpret mode (CPU tests).
  """
  dims = _validate(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, impl)
  kind = _kind(lhs_q.dtype)
  if impl == "auto":
    impl = _override.current or (_auto(kind, lhs_q, dims) if on_gpu() else "reference")
  if impl == "reference" or kind is None or _kind(rhs_q.dtype) is None:
    return scaled_dot_general_reference(lhs_q, rhs_q, lhs_scale, rhs_scale, dims, out_dtype, bias)
  try:
    c = canonicalize(lhs_q, rhs_q, lhs_scale, rhs_scale, dims, bias)
  except NotImplementedError:
    return scaled_dot_general_reference(lhs_q, rhs_q, lhs_scale, rhs_scale, dims, out_dtype, bias)
  out = None
  try:
    if impl == "pallas":
      out = pallas_nt(c, out_dtype, config, interpret)
    elif impl == "mosaic":
      out = mosaic_nt(c, out_dtype)
  except NotImplementedError:
    out = None
  if out is None:
    out = xla_nt(c, out_dtype)
  return out.reshape(c.out_shape)
