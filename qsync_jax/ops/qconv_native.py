"""Quantized convolution as XLA's own convolution on int8 / fp8 operands (no im2col).

``native_quantized_conv(x, w, window_strides, padding, op_policy, key, out_dtype)``: ``x``
``[N, spatial..., C]``, ``w`` ``[spatial..., C, O]``, ungrouped, no dilation. Each of the
three convolutions of the training step runs ``lax.conv_general_dilated`` on operands
quantized at its leg's precision (int8 with an int32 accumulator, fp8 with a float32 one),
then multiplies by the scales; float legs run the convolution in their type. Scales can only
vary along axes a convolution does not sum over, so ``per_channel`` here means:

=========================  ===========================  ===========================
leg                        left operand scale           right operand scale
=========================  ===========================  ===========================
forward  Y = X ⋆ W         X per sample (N)             W per output channel (O)
dlhs     dX = dY ⋆ᵀ W      dY per sample (N)            W per input channel (C)
drhs     dW = X ⋆ dY       X per input channel (C)      dY per output channel (O)
=========================  ===========================  ===========================

(``per_tensor``: one scale each.) A gradient leg at fp8 pairs an e5m2 gradient with an e4m3
operand; XLA has no mixed fp8 convolution, so both are widened (exactly) to bf16 for it.
These are not the im2col path's scales (one per patch
row), so the two paths' int8 results differ by rounding; ``reference_quantized_conv``
defines this one in float32 (the dequantized operands through ``lax.conv_general_dilated``
and JAX's own gradients) and the tests hold the two to each other.

An int8 / fp8 forward saves the quantized operands; the backward re-quantizes them along
its own axes (``in_scale``) or dequantizes them for a float leg.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gemm.reference import accumulator_dtype
from pallas_kernels.quantize import dequantize, quantize
from pallas_kernels.quantize.noise import stream_keys
from qsync_jax.ops.keys import check_backward_key, check_forward_key
from qsync_jax.ops.qdot import FLOAT_DTYPES, LAX_PRECISION, qformat
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy

_SPATIAL = "DHW"


def _specs(n: int):
  """Dimension-number strings for ``n`` spatial dims: forward (x, w, y), the input gradient
  and the weight gradient convolutions (JAX's transposes of the forward)."""
  sp = _SPATIAL[-n:]
  fwd = (f"N{sp}C", f"{sp}IO", f"N{sp}C")
  dlhs = (f"N{sp}C", f"{sp}OI", f"N{sp}C")  # dY ⋆ flip(W) with W's O read as input features
  drhs = (f"C{sp}N", f"I{sp}O", f"{sp}NC")  # X's samples contracted with dY's: out [sp, C, O]
  return fwd, dlhs, drhs


def _pads(padding, in_shape, kernel, strides):
  if isinstance(padding, str):
    return lax.padtype_to_pads(in_shape, kernel, strides, padding)
  return [tuple(p) for p in padding]


def conv_fwd(x, w, strides, pads, acc=None, precision=None):
  """``lax.conv_general_dilated(x, w)``, NHWC / HWIO."""
  fwd, _, _ = _specs(x.ndim - 2)
  dn = lax.conv_dimension_numbers(x.shape, w.shape, fwd)
  return lax.conv_general_dilated(
    x, w, strides, pads, dimension_numbers=dn, precision=precision, preferred_element_type=acc
  )


def conv_dlhs(g, w, x_shape, strides, pads, acc=None, precision=None):
  """The gradient of ``conv_fwd`` to its input: ``g`` ``[N, out..., O]`` ⋆ᵀ ``w``."""
  n = g.ndim - 2
  _, dlhs, _ = _specs(n)
  kernel = w.shape[:n]
  before = [k - lo - 1 for k, (lo, _) in zip(kernel, pads)]
  after = [
    size + k - 1 - ((o - 1) * s + 1) - b
    for size, k, o, s, b in zip(x_shape[1:-1], kernel, g.shape[1:-1], strides, before)
  ]
  w_flipped = lax.rev(w, tuple(range(n)))
  dn = lax.conv_dimension_numbers(g.shape, w_flipped.shape, dlhs)
  return lax.conv_general_dilated(
    g,
    w_flipped,
    (1,) * n,
    list(zip(before, after)),
    lhs_dilation=tuple(strides),
    dimension_numbers=dn,
    precision=precision,
    preferred_element_type=acc,
  )


def conv_drhs(x, g, w_shape, strides, pads, acc=None, precision=None):
  """The gradient of ``conv_fwd`` to its weight: ``x`` ⋆ ``g`` summed over samples."""
  n = x.ndim - 2
  _, _, drhs = _specs(n)
  kernel = w_shape[:n]
  out_dilated = [(o - 1) * s + 1 for o, s in zip(g.shape[1:-1], strides)]
  hi = [od - size + k - lo - 1 for od, size, k, (lo, _) in zip(out_dilated, x.shape[1:-1], kernel, pads)]
  dn = lax.conv_dimension_numbers(x.shape, g.shape, drhs)
  return lax.conv_general_dilated(
    x,
    g,
    (1,) * n,
    [(lo, h) for (lo, _), h in zip(pads, hi)],
    rhs_dilation=tuple(strides),
    dimension_numbers=dn,
    precision=precision,
    preferred_element_type=acc,
  )


def _reduce_all_but(ndim: int, keep: int, granularity: str) -> tuple[int, ...]:
  return tuple(a for a in range(ndim) if granularity == "per_tensor" or a != keep)


def _quantized(x, keep, precision, granularity, rounding, is_grad, key):
  """``(qvalue, scale)``: a float array or a quantized residual quantized with scales along
  axis ``keep`` only."""
  value, in_scale = x if isinstance(x, tuple) else (x, None)
  axes = _reduce_all_but(value.ndim, keep % value.ndim, granularity)
  return quantize(value, qformat(precision, is_grad), axes, rounding, key, in_scale=in_scale)


def _as_float(x, dtype):
  return dequantize(*x, dtype) if isinstance(x, tuple) else x.astype(dtype)


def _scale_along(scale, axis, ndim):
  """A scale that varies along one axis (or none) as a shape broadcasting along ``axis``."""
  shape = [1] * ndim
  shape[axis] = -1
  return scale.reshape(shape) if scale.size > 1 else scale.reshape((1,) * ndim)


def _leg(conv, precision, granularity, lhs, rhs, keep, out_keep, is_grad, rounding, keys):
  """One convolution at ``precision``: the operands quantized with scales along their axes
  ``keep`` (which the result holds on its axes ``out_keep``) and the scale epilogue, or the
  float convolution; ``(result, quantized operands or None)``."""
  if precision in QUANTIZED_PRECISIONS:
    lq = _quantized(lhs, keep[0], precision, granularity, rounding[0], is_grad[0], keys[0])
    rq = _quantized(rhs, keep[1], precision, granularity, rounding[1], is_grad[1], keys[1])
    a, b = lq[0], rq[0]
    if a.dtype != b.dtype:  # e5m2 × e4m3: no mixed fp8 convolution; both widen to bf16 exactly
      a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    acc = conv(a, b, accumulator_dtype(lq[0].dtype), None)
    nd = acc.ndim
    out = (
      acc.astype(jnp.float32) * _scale_along(lq[1], out_keep[0], nd) * _scale_along(rq[1], out_keep[1], nd)
    )
    return out, (lq, rq)
  dtype = FLOAT_DTYPES.get(precision, jnp.float32)
  return conv(_as_float(lhs, dtype), _as_float(rhs, dtype), None, LAX_PRECISION.get(precision)), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 6))
def _native(x, w, strides, pads, op_policy, key, out_dtype):
  return _native_fwd(x, w, strides, pads, op_policy, key, out_dtype)[0]


def _native_fwd(x, w, strides, pads, op_policy, key, out_dtype):
  k = stream_keys(key, 6)
  p, r = op_policy.fwd, op_policy.rounding
  conv = functools.partial(_call_fwd, strides=strides, pads=pads)
  y, quantized = _leg(
    conv, p, op_policy.granularity, x, w, (0, -1), (0, x.ndim - 1), (False, False), (r, r), k[:2]
  )
  if quantized is not None:
    res = quantized
  else:
    dtype = FLOAT_DTYPES.get(p)
    res = (x, w) if dtype is None else (x.astype(dtype), w.astype(dtype))
  protos = (jnp.zeros((), x.dtype), jnp.zeros((), w.dtype), x.shape, w.shape)
  return y.astype(out_dtype), (res, k[2:], protos)


def _call_fwd(lhs, rhs, acc, precision, *, strides, pads):
  return conv_fwd(lhs, rhs, strides, pads, acc, precision)


def _native_bwd(strides, pads, op_policy, out_dtype, residuals, g):
  (x_res, w_res), k, (x_proto, w_proto, x_shape, w_shape) = residuals
  check_backward_key(op_policy, k[0])
  gran, r, gr = op_policy.granularity, op_policy.rounding, op_policy.grad_rounding
  n = g.ndim

  def dlhs_conv(lhs, rhs, acc, precision):
    return conv_dlhs(lhs, rhs, x_shape, strides, pads, acc, precision)

  def drhs_conv(lhs, rhs, acc, precision):
    return conv_drhs(lhs, rhs, w_shape, strides, pads, acc, precision)

  # dX [N, sp, C]: dY scaled per sample (axis 0), W per input channel (its axis n - 2)
  dx, _ = _leg(
    dlhs_conv, op_policy.dlhs, gran, g, w_res, (0, n - 2), (0, n - 1), (True, False), (gr, r), k[:2]
  )
  # dW [sp, C, O]: X per input channel (its last axis), dY per output channel (its last axis)
  dw, _ = _leg(
    drhs_conv, op_policy.drhs, gran, x_res, g, (n - 1, n - 1), (n - 2, n - 1), (False, True), (r, gr), k[2:]
  )
  return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), None


_native.defvjp(_native_fwd, _native_bwd)


def native_quantized_conv(
  x: jax.Array,
  w: jax.Array,
  window_strides,
  padding,
  op_policy: OpPolicy,
  key: jax.Array | None = None,
  out_dtype=None,
) -> jax.Array:
  """``lax.conv_general_dilated(x, w, window_strides, padding)`` (``x`` NHWC, ``w`` HWIO) with
  each leg at ``op_policy``'s precision through XLA's convolution; see the module docstring."""
  check_forward_key(op_policy, key)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(x.dtype, w.dtype))
  n = x.ndim - 2
  strides = tuple(window_strides)
  pads = tuple(tuple(p) for p in _pads(padding, x.shape[1:-1], w.shape[:n], strides))
  return _native(x, w, strides, pads, op_policy, key if op_policy.needs_rng else None, out_dtype)


def reference_quantized_conv(x, w, window_strides, padding, op_policy: OpPolicy, key=None, out_dtype=None):
  """The definition of ``native_quantized_conv`` in float32: each leg's operands quantized
  and dequantized with the same scales and rounding (the same keys), then
  ``lax.conv_general_dilated`` at ``Precision.HIGHEST`` and JAX's own gradients of it."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(x.dtype, w.dtype))
  n = x.ndim - 2
  strides = tuple(window_strides)
  pads = _pads(padding, x.shape[1:-1], w.shape[:n], strides)
  k = stream_keys(key if op_policy.needs_rng else None, 6)
  gran, r, gr = op_policy.granularity, op_policy.rounding, op_policy.grad_rounding

  def rounded(v, keep, precision, rounding, is_grad, key_):
    if precision in QUANTIZED_PRECISIONS:
      return dequantize(*_quantized(v, keep, precision, gran, rounding, is_grad, key_))
    dtype = FLOAT_DTYPES.get(precision)
    return (v if dtype is None else v.astype(dtype)).astype(jnp.float32)

  def conv(a, b):
    return conv_fwd(a, b, strides, pads, precision=lax.Precision.HIGHEST)

  @jax.custom_vjp
  def f(x, w):
    return conv(rounded(x, 0, op_policy.fwd, r, False, k[0]), rounded(w, -1, op_policy.fwd, r, False, k[1]))

  def f_fwd(x, w):
    # the residuals: the forward's rounded operands (re-quantizing a quantized residual along
    # other axes gives the values of quantizing its dequantized copy: pallas_kernels.quantize)
    xs = rounded(x, 0, op_policy.fwd, r, False, k[0])
    ws = rounded(w, -1, op_policy.fwd, r, False, k[1])
    return conv(xs, ws), (xs, ws)

  def f_bwd(saved, g):
    xs, ws = saved
    g = g.astype(jnp.float32)
    g_d = rounded(g, 0, op_policy.dlhs, gr, True, k[2])
    w_d = rounded(ws, n, op_policy.dlhs, r, False, k[3])
    x_r = rounded(xs, n + 1, op_policy.drhs, r, False, k[4])
    g_r = rounded(g, n + 1, op_policy.drhs, gr, True, k[5])
    dx = jax.vjp(lambda a: conv(a, w_d), jnp.zeros(xs.shape, jnp.float32))[1](g_d)[0]
    dw = jax.vjp(lambda b: conv(x_r, b), jnp.zeros(ws.shape, jnp.float32))[1](g_r)[0]
    return dx, dw

  f.defvjp(f_fwd, f_bwd)
  return f(x.astype(jnp.float32), w.astype(jnp.float32)).astype(out_dtype)
