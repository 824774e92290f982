"""Quantized ``conv_general_dilated``.

* All three legs at one float precision (fp32 / tf32 / bf16 / fp16): the native convolution
  on operands cast to that precision (its output, too, is rounded to that precision, as
  cuDNN does); autodiff gives both gradients at the same precision.
* Otherwise (any int8 / fp8 leg, or legs that differ): the convolution is lowered to a GEMM
  (``im2col``: strided slices of the padded input, then ``quantized_dot_general`` over the
  flattened ``C·kh·kw`` contraction), so every leg runs at its own precision through the
  same code as Dense layers. The patch extraction is exact (it moves data), and so is its
  transpose (pads and adds back into the input gradient, in the input's dtype).

With ``impl="native"`` the quantized legs instead run XLA's own convolution on int8 / fp8
operands (``qsync_jax.ops.qconv_native``: scales per sample / per channel along the axes a
convolution does not sum over; ungrouped, undilated convolutions only).

Residual memory of the im2col path: the int8 *patches* are saved, i.e. ``prod(kernel)``
times the input's element count at one byte per element (2.25× the fp32 input for a 3×3
kernel). Grouped convolutions run quantized legs only at float precisions.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax import lax

from qsync_jax.ops.qconv_native import native_quantized_conv
from qsync_jax.ops.qdot import FLOAT_DTYPES, LAX_PRECISION, quantized_dot_general
from qsync_jax.precision import FLOAT_PRECISIONS, OpPolicy

IMPLS = ("im2col", "native")

_SPATIAL = "DHW"


def _nd_specs(n_spatial: int) -> tuple[str, str, str]:
  spatial = _SPATIAL[-n_spatial:] if n_spatial <= 3 else None
  if spatial is None:
    raise NotImplementedError(f"im2col supports 1-3 spatial dims, got {n_spatial}.")
  return f"N{spatial}C", f"{spatial}IO", f"N{spatial}C"


def library_patches(x: jax.Array, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation):
  """The patches of ``x`` (N, spatial..., C) by ``lax.conv_general_dilated_patches``: what
  ``im2col`` equals, and what it falls back to under input dilation."""
  return lax.conv_general_dilated_patches(
    x,
    filter_shape,
    window_strides,
    padding,
    lhs_dilation,
    rhs_dilation,
    _nd_specs(x.ndim - 2),
    precision=lax.Precision.HIGHEST,
  )


def im2col(x: jax.Array, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation) -> jax.Array:
  """The patches of ``x`` (N, spatial..., C) under a filter of ``filter_shape``: (N,
  spatial'..., C·prod(filter_shape)), flattened C-major. Equivalent to ``library_patches``
  (``lax.conv_general_dilated_patches``), which XLA runs as a convolution with a one-hot
  kernel, C·prod(filter) multiply-adds per patch element: for a 65536 × 1152 patch matrix,
  87 G multiply-adds in full fp32.
  Here the patches are strided slices of the padded input, stacked: data movement only, and
  the transpose (the input's gradient) is pads and adds. Input dilation (transposed
  convolutions) keeps the library call."""
  if any(d != 1 for d in lhs_dilation):
    return library_patches(x, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation)
  strides = tuple(window_strides)
  dilated = [(k - 1) * d + 1 for k, d in zip(filter_shape, rhs_dilation)]
  pads = (
    lax.padtype_to_pads(x.shape[1:-1], dilated, strides, padding) if isinstance(padding, str) else padding
  )
  x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0), *[(lo, hi, 0) for lo, hi in pads], (0, 0, 0)])
  out = [(size - k) // s + 1 for size, k, s in zip(x.shape[1:-1], dilated, strides)]
  slices = []
  for offset in itertools.product(*(range(k) for k in filter_shape)):
    start = [o * d for o, d in zip(offset, rhs_dilation)]
    limit = [st + (n - 1) * s + 1 for st, n, s in zip(start, out, strides)]
    slices.append(lax.slice(x, (0, *start, 0), (x.shape[0], *limit, x.shape[-1]), (1, *strides, 1)))
  patches = jnp.stack(slices, axis=-1)  # N, spatial'..., C, prod(filter): C-major once flattened
  return patches.reshape(*patches.shape[:-2], -1)


def is_native(op_policy: OpPolicy) -> bool:
  """Whether the op runs as a native convolution (uniform float legs)."""
  p = op_policy.fwd
  return p in FLOAT_PRECISIONS and op_policy.dlhs == p and op_policy.drhs == p


def quantized_conv_general_dilated(
  lhs: jax.Array,
  rhs: jax.Array,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count: int = 1,
  *,
  op_policy: OpPolicy,
  key: jax.Array | None = None,
  out_dtype=None,
  impl: str = "im2col",
) -> jax.Array:
  """``lax.conv_general_dilated`` with per-leg precisions; see the module docstring.

  ``impl``: how int8 / fp8 and mixed legs run — ``"im2col"`` (a quantized GEMM over the
  patches) or ``"native"`` (XLA's convolution on the quantized operands).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}. Fix: pass one of them.")
  if out_dtype is None:
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  n_spatial = lhs.ndim - 2
  lhs_dilation = lhs_dilation or (1,) * n_spatial
  rhs_dilation = rhs_dilation or (1,) * n_spatial
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  if is_native(op_policy):
    dtype = FLOAT_DTYPES.get(op_policy.fwd, jnp.float32)
    out = lax.conv_general_dilated(
      lhs.astype(dtype),
      rhs.astype(dtype),
      window_strides,
      padding,
      lhs_dilation,
      rhs_dilation,
      dn,
      feature_group_count,
      precision=LAX_PRECISION.get(op_policy.fwd),
    )
    return out.astype(out_dtype)
  if feature_group_count != 1:
    raise ValueError(
      f"grouped convolution (feature_group_count={feature_group_count}) cannot run op policy "
      f"{op_policy}: int8/fp8 and mixed legs use im2col, which needs ungrouped convolutions. "
      "Fix: give this op a uniform float policy (e.g. 'bf16') with a rule."
    )
  lhs_spec, rhs_spec, out_spec = dn
  x = jnp.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))  # N, spatial..., C
  if impl == "native":
    if any(d != 1 for d in (*lhs_dilation, *rhs_dilation)):
      raise ValueError(
        "impl='native' takes undilated convolutions only. Fix: use impl='im2col' for dilated ones."
      )
    w = jnp.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))  # spatial..., I, O
    y = native_quantized_conv(x, w, window_strides, padding, op_policy, key, out_dtype)
    return _to_out_spec(y, out_spec)
  w = jnp.transpose(rhs, (rhs_spec[1], *rhs_spec[2:], rhs_spec[0]))  # I, spatial..., O
  filter_shape = w.shape[1:-1]
  patches = im2col(x, filter_shape, window_strides, padding, lhs_dilation, rhs_dilation)
  # N, spatial'..., C·prod(filter) flattened C-major, the same order as w's leading dims
  w_mat = w.reshape(-1, w.shape[-1])
  y = quantized_dot_general(
    patches,
    w_mat,
    (((patches.ndim - 1,), (0,)), ((), ())),
    op_policy,
    key,
    out_dtype,
  )  # N, spatial'..., O
  return _to_out_spec(y, out_spec)


def _to_out_spec(y, out_spec):
  """``y`` (N, spatial'..., O) in the layout ``out_spec`` names."""
  current = (0, y.ndim - 1, *range(1, y.ndim - 1))  # the axis of each logical dim (N, O, spatial...)
  perm = [0] * y.ndim
  for logical, axis in enumerate(out_spec):
    perm[axis] = current[logical]
  return jnp.transpose(y, perm)
