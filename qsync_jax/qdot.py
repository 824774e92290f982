"""Quantized ``dot_general`` whose three training GEMMs each run at their own precision.

``quantized_dot_general(lhs, rhs, dimension_numbers, op_policy, key)`` computes
``lax.dot_general(lhs, rhs, dimension_numbers)`` with

* the forward product at ``op_policy.fwd``,
* the gradient to ``lhs`` (dY·Wᵀ) at ``op_policy.dlhs``,
* the gradient to ``rhs`` (Xᵀ·dY) at ``op_policy.drhs``,

through a ``jax.custom_vjp``. Per leg precision:

=========  =====================================================================
fp32       float32 operands, ``Precision.HIGHEST``
tf32       float32 operands, ``Precision.DEFAULT`` (tf32 tensor cores on GPUs)
bf16/fp16  operands cast, float32 accumulation
int8       symmetric absmax int8 (per tensor / per channel), int32 accumulation
fp8        e4m3 values, e5m2 gradients, per-tensor/per-channel scales, fp32 accumulation
=========  =====================================================================

When the forward leg is int8 / fp8 the op saves its *quantized* operands (plus scales) as
residuals for the backward pass, not float copies; a float forward leg saves the operands
in its own dtype (bf16/fp16 copies for a 16-bit forward).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gemm import scaled_dot_general
from pallas_kernels.gemm.reference import free_axes
from pallas_kernels.quantize import dequantize, quantize
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy

FLOAT_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
LAX_PRECISION = {"fp32": lax.Precision.HIGHEST, "tf32": lax.Precision.DEFAULT}


class Operand(NamedTuple):
  """How one GEMM operand is quantized: role 'value' (X, W) or 'grad' (dY)."""

  rounding: str
  is_grad: bool


def qformat(precision: str, is_grad: bool) -> str:
  """Storage format of an int8 / fp8 operand: gradients use e5m2 (wider range)."""
  if precision == "int8":
    return "int8"
  return "e5m2" if is_grad else "e4m3"


def _reduce_axes(ndim: int, contract, granularity: str) -> tuple[int, ...]:
  return tuple(range(ndim)) if granularity == "per_tensor" else tuple(contract)


def leg_dot(
  precision: str,
  granularity: str,
  lhs: jax.Array,
  rhs: jax.Array,
  dims,
  lhs_operand: Operand,
  rhs_operand: Operand,
  lhs_key=None,
  rhs_key=None,
) -> jax.Array:
  """One GEMM ``dot_general(lhs, rhs, dims)`` at ``precision``; float32 result."""
  (lc, rc), _ = dims
  if precision in QUANTIZED_PRECISIONS:
    lq, ls = quantize(
      lhs,
      qformat(precision, lhs_operand.is_grad),
      _reduce_axes(lhs.ndim, lc, granularity),
      lhs_operand.rounding,
      lhs_key,
    )
    rq, rs = quantize(
      rhs,
      qformat(precision, rhs_operand.is_grad),
      _reduce_axes(rhs.ndim, rc, granularity),
      rhs_operand.rounding,
      rhs_key,
    )
    return scaled_dot_general(lq, rq, ls, rs, dims, jnp.float32)
  if precision in FLOAT_DTYPES:
    dtype = FLOAT_DTYPES[precision]
    return lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dims, preferred_element_type=jnp.float32)
  return lax.dot_general(
    lhs.astype(jnp.float32),
    rhs.astype(jnp.float32),
    dims,
    precision=LAX_PRECISION[precision],
    preferred_element_type=jnp.float32,
  )


# -- dimension bookkeeping for the two gradient GEMMs -------------------------------------


def dlhs_dims(lhs_ndim: int, rhs_ndim: int, dims):
  """``(g_dims, perm)``: dlhs = transpose(dot_general(g, rhs, g_dims), perm)."""
  (lc, rc), (lb, rb) = dims
  lf, rf = free_axes(lhs_ndim, lc, lb), free_axes(rhs_ndim, rc, rb)
  nb = len(lb)
  g_batch = tuple(range(nb))
  g_rhs_free = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
  g_dims = ((g_rhs_free, tuple(rf)), (g_batch, tuple(rb)))
  # result = [batch, lhs free, rhs contract axes in sorted rhs order]
  pos = {}
  for i, a in enumerate(lb):
    pos[a] = i
  for j, a in enumerate(lf):
    pos[a] = nb + j
  sorted_rc = sorted(rc)
  for a_l, a_r in zip(lc, rc):
    pos[a_l] = nb + len(lf) + sorted_rc.index(a_r)
  return g_dims, tuple(pos[a] for a in range(lhs_ndim))


def drhs_dims(lhs_ndim: int, rhs_ndim: int, dims):
  """``(g_dims, perm)``: drhs = transpose(dot_general(lhs, g, g_dims), perm)."""
  (lc, rc), (lb, rb) = dims
  lf, rf = free_axes(lhs_ndim, lc, lb), free_axes(rhs_ndim, rc, rb)
  nb = len(lb)
  g_batch = tuple(range(nb))
  g_lhs_free = tuple(range(nb, nb + len(lf)))
  g_dims = ((tuple(lf), g_lhs_free), (tuple(lb), g_batch))
  # result = [batch, lhs contract axes in sorted lhs order, rhs free]
  pos = {}
  for i, a in enumerate(rb):
    pos[a] = i
  sorted_lc = sorted(lc)
  for a_l, a_r in zip(lc, rc):
    pos[a_r] = nb + sorted_lc.index(a_l)
  for j, a in enumerate(rf):
    pos[a] = nb + len(lc) + j
  return g_dims, tuple(pos[a] for a in range(rhs_ndim))


# -- residuals ----------------------------------------------------------------------------


def _save(x, fmt_precision: str, op_policy: OpPolicy, contract, key, fwd_dtype):
  """Residual of one operand: (qvalue, scale) for int8/fp8 forward, else a cast copy."""
  if fmt_precision in QUANTIZED_PRECISIONS:
    return quantize(
      x,
      qformat(fmt_precision, False),
      _reduce_axes(x.ndim, contract, op_policy.granularity),
      op_policy.rounding,
      key,
    )
  return (x.astype(fwd_dtype), None)


def _restore(residual):
  value, scale = residual
  return value if scale is None else dequantize(value, scale)


def _keys(key, n):
  return [None] * n if key is None else list(jax.random.split(key, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 5))
def _qdot(lhs, rhs, dims, op_policy, key, out_dtype):
  return _qdot_fwd(lhs, rhs, dims, op_policy, key, out_dtype)[0]


def _qdot_fwd(lhs, rhs, dims, op_policy, key, out_dtype):
  (lc, rc), _ = dims
  k = _keys(key, 6)
  value = Operand(op_policy.rounding, False)
  p = op_policy.fwd
  if p in QUANTIZED_PRECISIONS:
    lres = _save(lhs, p, op_policy, lc, k[0], None)
    rres = _save(rhs, p, op_policy, rc, k[1], None)
    (lq, ls), (rq, rs) = lres, rres
    out = scaled_dot_general(lq, rq, ls, rs, dims, jnp.float32)
  else:
    out = leg_dot(p, op_policy.granularity, lhs, rhs, dims, value, value)
    fwd_dtype = FLOAT_DTYPES.get(p)
    lres = (lhs if fwd_dtype is None else lhs.astype(fwd_dtype), None)
    rres = (rhs if fwd_dtype is None else rhs.astype(fwd_dtype), None)
  residuals = (lres, rres, k[2:], jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
  return out.astype(out_dtype), residuals


def _qdot_bwd(dims, op_policy, out_dtype, residuals, g):
  lres, rres, k, lhs_proto, rhs_proto = residuals
  lhs, rhs = _restore(lres), _restore(rres)
  value = Operand(op_policy.rounding, False)
  grad = Operand(op_policy.grad_rounding, True)
  g_dims, perm = dlhs_dims(lhs.ndim, rhs.ndim, dims)
  dlhs = leg_dot(op_policy.dlhs, op_policy.granularity, g, rhs, g_dims, grad, value, k[0], k[1])
  dlhs = jnp.transpose(dlhs, perm).astype(lhs_proto.dtype)
  g_dims, perm = drhs_dims(lhs.ndim, rhs.ndim, dims)
  drhs = leg_dot(op_policy.drhs, op_policy.granularity, lhs, g, g_dims, value, grad, k[2], k[3])
  drhs = jnp.transpose(drhs, perm).astype(rhs_proto.dtype)
  return dlhs, drhs, None


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _canonical_dims(dimension_numbers):
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def quantized_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers,
  op_policy: OpPolicy,
  key: jax.Array | None = None,
  out_dtype=None,
) -> jax.Array:
  """``lax.dot_general`` with per-leg precisions; see the module docstring.

  Args:
    lhs, rhs, dimension_numbers: as for ``lax.dot_general``.
    op_policy: precision of each leg, rounding and scale granularity.
    key: PRNG key, required when ``op_policy`` rounds stochastically.
    out_dtype: output dtype; defaults to ``jnp.result_type(lhs, rhs)``.
  """
  if op_policy.needs_rng and key is None:
    raise ValueError(
      f"op policy {op_policy} rounds stochastically and needs a PRNG key. Fix: pass "
      "key=jax.random.key(...) (through Flax: rngs={'qsync': key})."
    )
  if out_dtype is None:
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  if not op_policy.needs_rng:
    key = None
  return _qdot(lhs, rhs, _canonical_dims(dimension_numbers), op_policy, key, jnp.dtype(out_dtype))


def quantized_einsum(subscripts: str, lhs, rhs, op_policy: OpPolicy, key=None, out_dtype=None):
  """``jnp.einsum(subscripts, lhs, rhs)`` with its contraction as a quantized dot_general."""

  def dot_general(a, b, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type  # the op policy decides precision
    return quantized_dot_general(a, b, dimension_numbers, op_policy, key, out_dtype)

  return jnp.einsum(subscripts, lhs, rhs, _dot_general=dot_general)


def residual_bytes(fn, *args) -> int:
  """Bytes ``jax.vjp(fn, *args)`` keeps for the backward pass (its residual arrays)."""
  _, vjp_fn = jax.vjp(fn, *args)
  return sum(
    leaf.size * leaf.dtype.itemsize
    for leaf in jax.tree_util.tree_leaves(vjp_fn)
    if hasattr(leaf, "dtype") and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
  )
