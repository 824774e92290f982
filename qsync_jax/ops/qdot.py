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
in its own dtype (bf16/fp16 copies for a 16-bit forward). Where an operand's gradient leg
runs at the forward's own 8-bit format and the product has no batch axes, one quantization
writes the operand in both layouts (``quantize_both``): the forward GEMM reads the
contraction-last copy and the residual is the one the gradient leg contracts, so the
backward transposes no 8-bit operand.

Gradient legs of an 8-bit forward (Y = X·W, X: M×K with scale s_x, W: K×N with scale s_w)
-------------------------------------------------------------------------------------------
A gradient leg at the forward's own 8-bit format reads the saved values ``q`` as they are
(no second rounding) and only the gradient dY is quantized (``grad_rounding``):

=============  ============================  ============================================
granularity    dX = dY·Wᵀ (contracts N)      dW = Xᵀ·dY (contracts M)
=============  ============================  ============================================
per_tensor     s_w stays on q_w: the GEMM     s_x stays on q_x: the GEMM epilogue
               epilogue multiplies the        multiplies the output; dY quantized per
               output; dY quantized per       tensor.
               tensor.
per_channel    s_w (per column n) lies on     s_x (per row m) lies on the contraction:
               the contraction: folded into   folded into dY, ``dW = q_xᵀ·Q(s_x ⊙ dY)``,
               dY, ``dX = Q(dY ⊙ s_w)·q_wᵀ``, Q per column n of dY (absmax over M).
               Q per row m of dY (absmax
               over N).
=============  ============================  ============================================

``Q`` takes its scale from the folded tensor (absmax of ``s ⊙ dY``), so stochastic rounding
stays unbiased and never saturates. The same holds for every ``dot_general``: a per-channel
scale of a saved operand varies over its forward free and batch axes, which are the leg's
contraction and batch axes and all axes of dY, so it always folds into dY (the fold is
fused into dY's quantization, ``quantize(..., in_scale=)``); this covers DenseGeneral,
einsums and the attention products, where both operands are activations, and the im2col
convolution. Where both legs fold and the product has no batch axes (Dense layers, the
im2col convolution), dY is quantized for both in one ``quantize_pair`` (the same values with
nearest rounding; stochastic rounding draws both legs' numbers from one hash per element,
``noise.pair_noise``). Where the two formats differ (an int8 forward with an fp8 gradient leg, or
fp8 with int8) the saved operand is dequantized and quantized again in the leg's format
along the new contraction, the one case that rounds it twice. A 16-bit leg (QSync's
``int8_fwd``: int8 forward, fp16/bf16 backward) dequantizes the saved operand straight
into its own dtype inside the leg's program and multiplies 16-bit operands (float32
accumulation), as for a float residual.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gemm import scaled_dot_general
from pallas_kernels.gemm.reference import free_axes
from pallas_kernels.quantize import dequantize, quantize, quantize_both, quantize_pair
from pallas_kernels.quantize.noise import stream_keys
from pallas_kernels.quantize.reference import QFORMATS
from qsync_jax.ops.keys import check_backward_key, check_forward_key
from qsync_jax.ops.vma import match_vma
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


def _contract_last(ndim: int, contract) -> tuple[int, ...]:
  """The permutation that moves ``contract`` last (in that order), the rest kept in order."""
  return tuple(a for a in range(ndim) if a not in contract) + tuple(contract)


def _is_quantized(x) -> bool:
  return isinstance(x, tuple)


def _logical(x, axes, dtype=jnp.float32):
  """A float operand in its logical layout, from an array or a quantized residual
  (dequantized into ``dtype``).

  ``axes[i]`` is the logical axis that physical axis ``i`` of ``x`` holds (None: the same).
  """
  if _is_quantized(x):
    x = dequantize(*x, dtype)
  if axes is None or tuple(axes) == tuple(range(x.ndim)):
    return x
  return jnp.transpose(x, tuple(sorted(range(x.ndim), key=lambda i: axes[i])))


def quantize_operand(x, axes, precision: str, granularity: str, operand: Operand, contract, key=None):
  """``(qvalue, scale, axes)``: one GEMM operand quantized, contraction axes moved last.

  ``x`` is a float array or a pair ``(value, in_scale)`` standing for ``value * in_scale``
  (a quantized residual re-quantized without a float copy, or a gradient with a saved
  operand's scale folded in, ``reuse_saved``); ``axes[i]`` is the logical axis its
  physical axis ``i`` holds, ``contract`` the logical contraction axes. The result's
  contraction axes come last (the layout the 8-bit GEMM kernels read fastest), ``axes``
  updated to match. Same values as quantizing the logical float operand.
  """
  value, in_scale = x if _is_quantized(x) else (x, None)
  axes = tuple(range(value.ndim)) if axes is None else tuple(axes)
  phys = tuple(axes.index(a) for a in contract)
  qvalue, scale = quantize(
    value,
    qformat(precision, operand.is_grad),
    _reduce_axes(value.ndim, phys, granularity),
    operand.rounding,
    key,
    in_scale=in_scale,
    contract_axes=phys,
  )
  return qvalue, scale, tuple(axes[p] for p in _contract_last(value.ndim, phys))


def _scale_onto(scale, own_axes, other_axes, other_ndim: int):
  """``scale`` (keepdims, size 1 off ``own_axes``) laid out for the other operand of a
  product, whose axis ``other_axes[i]`` is paired (contracted or batched) with
  ``own_axes[i]``; broadcasts against the other operand."""
  order = sorted(range(len(own_axes)), key=lambda i: other_axes[i])
  rest = [a for a in range(scale.ndim) if a not in own_axes]
  shape = [1] * other_ndim
  for i in order:
    shape[other_axes[i]] = scale.shape[own_axes[i]]
  return jnp.transpose(scale, [own_axes[i] for i in order] + rest).reshape(shape)


def reuse_saved(
  saved, saved_axes, own_pairs, other, other_axes, other_pairs, precision: str, operand: Operand
):
  """``(saved operand for the GEMM as (qvalue, scale, axes), other operand)`` or None.

  ``saved`` is an 8-bit residual ``(qvalue, scale)`` whose physical axis ``i`` holds logical
  axis ``saved_axes[i]``; ``own_pairs`` / ``other_pairs`` are the logical axes of it and of
  the float ``other`` operand that the leg contracts or batches together (in matching order).
  None where the residual is not in the leg's format (``precision``, ``operand``), its scale
  varies along an axis the leg does not pair with ``other`` (an output axis) or ``other``
  is not a float array: the caller quantizes both afresh. Otherwise the values are reused
  as they are; a per-tensor scale stays on them (the GEMM epilogue applies it to the
  output), any other is folded into ``other``, returned as ``(other, scale laid out for
  it)`` for ``quantize_operand`` to quantize the product.
  """
  if not _is_quantized(saved) or _is_quantized(other):
    return None
  qvalue, scale = saved
  if qvalue.dtype != QFORMATS[qformat(precision, operand.is_grad)][0]:
    return None
  saved_axes = tuple(range(qvalue.ndim)) if saved_axes is None else tuple(saved_axes)
  other_axes = tuple(range(other.ndim)) if other_axes is None else tuple(other_axes)
  own = [saved_axes.index(a) for a in own_pairs]
  varying = {a for a in range(scale.ndim) if scale.shape[a] != 1}
  if not varying:  # per tensor: stays on the values
    return (qvalue, scale, saved_axes), other
  if not varying <= set(own):  # varies along an output axis too: not separable
    return None
  onto = _scale_onto(scale, own, [other_axes.index(a) for a in other_pairs], other.ndim)
  ones = jnp.ones((1,) * qvalue.ndim, jnp.float32)
  return (qvalue, ones, saved_axes), (other, onto)


def _physical_dims(dims, lhs_axes, rhs_axes):
  """``dims`` (over logical axes) over operands whose axis ``i`` holds logical ``*_axes[i]``."""
  (lc, rc), (lb, rb) = dims
  return (
    (tuple(lhs_axes.index(a) for a in lc), tuple(rhs_axes.index(a) for a in rc)),
    (tuple(lhs_axes.index(a) for a in lb), tuple(rhs_axes.index(a) for a in rb)),
  )


def _free_axes_in_logical_order(out, dims, lhs_axes, rhs_axes):
  """dot_general puts each operand's free axes in its physical order: restore the logical
  order (a residual's free axes may have been moved; a no-op for 2-D operands)."""
  (lc, rc), (lb, rb) = dims
  lf = [a for a in lhs_axes if a not in lc and a not in lb]
  rf = [a for a in rhs_axes if a not in rc and a not in rb]
  nb = len(lb)
  perm = list(range(nb))
  perm += [nb + lf.index(a) for a in sorted(lf)]
  perm += [nb + len(lf) + rf.index(a) for a in sorted(rf)]
  return out if perm == list(range(out.ndim)) else jnp.transpose(out, perm)


def gemm_8bit(lhs_q, rhs_q, dims, out_dtype) -> jax.Array:
  """``dot_general`` of two quantized GEMM operands ``(qvalue, scale, axes)`` (as
  ``quantize_operand`` returns them) over the logical ``dims``, free axes in logical order."""
  (lq, ls, la), (rq, rs, ra) = lhs_q, rhs_q
  out = scaled_dot_general(lq, rq, ls, rs, _physical_dims(dims, la, ra), out_dtype)
  return _free_axes_in_logical_order(out, dims, la, ra)


def leg_dot(
  precision: str,
  granularity: str,
  lhs,
  rhs,
  dims,
  lhs_operand: Operand,
  rhs_operand: Operand,
  lhs_key=None,
  rhs_key=None,
  *,
  lhs_axes=None,
  rhs_axes=None,
  out_dtype=jnp.float32,
) -> jax.Array:
  """One GEMM ``dot_general(lhs, rhs, dims)`` at ``precision``; ``out_dtype`` result.

  ``lhs`` / ``rhs`` are float arrays or quantized residuals ``(qvalue, scale)``, whose
  physical axis ``i`` holds logical axis ``*_axes[i]`` (None: the logical layout). At int8 /
  fp8 a residual in the leg's own format is reused with its scale folded into the other,
  float operand (``reuse_saved``, the module docstring's table); any other operand is
  quantized along the contraction (a residual in another format: again, from its values).
  """
  (lc, rc), (lb, rb) = dims
  if precision in QUANTIZED_PRECISIONS:
    lhs_q = rhs_q = None
    reused = reuse_saved(lhs, lhs_axes, lc + lb, rhs, rhs_axes, rc + rb, precision, lhs_operand)
    if reused is not None:
      lhs_q, rhs = reused
    else:
      reused = reuse_saved(rhs, rhs_axes, rc + rb, lhs, lhs_axes, lc + lb, precision, rhs_operand)
      if reused is not None:
        rhs_q, lhs = reused
    if lhs_q is None:
      lhs_q = quantize_operand(lhs, lhs_axes, precision, granularity, lhs_operand, lc, lhs_key)
    if rhs_q is None:
      rhs_q = quantize_operand(rhs, rhs_axes, precision, granularity, rhs_operand, rc, rhs_key)
    return gemm_8bit(lhs_q, rhs_q, dims, out_dtype)
  dtype = FLOAT_DTYPES.get(precision, jnp.float32)
  lhs, rhs = _logical(lhs, lhs_axes, dtype), _logical(rhs, rhs_axes, dtype)
  if precision in FLOAT_DTYPES:
    # float32 accumulation either way; a 16-bit result of the leg's own dtype comes straight
    # out of the GEMM (one rounding, as the cast of the float32 result) instead of a float32
    # copy in memory and a second pass to cast it.
    acc = dtype if jnp.dtype(out_dtype) == jnp.dtype(dtype) else jnp.float32
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    if jax.default_backend() == "cpu" and acc == jnp.float32:
      # XLA's CPU runtime cannot run some 16-bit products with a float32 result ("DotThunk:
      # BF16 x BF16 = F32" once it folds a transpose into the dot). The CPU therefore runs the
      # product of the 16-bit-rounded values in float32: the same numbers (16-bit products
      # are exact in float32, accumulation is float32), at the CPU's float32 speed.
      lhs, rhs, precision_ = lhs.astype(jnp.float32), rhs.astype(jnp.float32), lax.Precision.HIGHEST
    else:
      precision_ = None
    out = lax.dot_general(lhs, rhs, dims, precision=precision_, preferred_element_type=acc)
    return out.astype(out_dtype)
  return lax.dot_general(
    lhs.astype(jnp.float32),
    rhs.astype(jnp.float32),
    dims,
    precision=LAX_PRECISION[precision],
    preferred_element_type=jnp.float32,
  ).astype(out_dtype)


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
#
# An int8 / fp8 forward saves its quantized operands as residuals ``(qvalue, scale)``. Where
# the operand's gradient leg reads it at the forward's own precision and the product has no
# batch axes (``_keeps_other_layout``), the forward's quantization writes the codes in both
# layouts in one pass (``quantize_both``): the GEMM reads the contraction-last copy and the
# residual is the other, its free axes last, the layout the gradient leg contracts — no
# transpose in the backward. Otherwise the residual is the forward GEMM's own copy, contraction
# axes last. ``_residual_axes`` gives the logical axis each physical axis holds. The backward
# legs reuse the residuals with their scales folded into dY (8-bit legs of the same format;
# ``leg_dot``), quantize them again (8-bit legs of the other format) or dequantize them (float
# legs).


def _keeps_other_layout(op_policy: OpPolicy, side: int, dims) -> bool:
  """Whether operand ``side`` (0: lhs, 1: rhs) of an 8-bit forward is kept laid out for its
  gradient leg (lhs: ``drhs``, rhs: ``dlhs``): that leg at the forward's precision, no batch axes."""
  (_, _), (lb, rb) = dims
  leg = op_policy.drhs if side == 0 else op_policy.dlhs
  return op_policy.fwd in QUANTIZED_PRECISIONS and leg == op_policy.fwd and not lb and not rb


def _residual_axes(op_policy: OpPolicy, side: int, dims, ndim: int) -> tuple[int, ...]:
  """The logical axes of an 8-bit forward's residual of operand ``side``, physical order."""
  contract = dims[0][side]
  if _keeps_other_layout(op_policy, side, dims):
    return _contract_last(ndim, tuple(a for a in range(ndim) if a not in contract))
  return _contract_last(ndim, contract)


def _quantize_forward(x, op_policy: OpPolicy, side: int, dims, key):
  """``(GEMM operand (qvalue, scale, axes), residual (qvalue, scale))`` of an 8-bit forward."""
  p, contract = op_policy.fwd, dims[0][side]
  value = Operand(op_policy.rounding, False)
  if not _keeps_other_layout(op_policy, side, dims):
    q = quantize_operand(x, None, p, op_policy.granularity, value, contract, key)
    return q, q[:2]
  (q, scale), residual = quantize_both(
    x,
    qformat(p, False),
    _reduce_axes(x.ndim, contract, op_policy.granularity),
    op_policy.rounding,
    key,
    contract_axes=contract,
  )
  return (q, scale, _contract_last(x.ndim, contract)), residual


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 5))
def _qdot(lhs, rhs, dims, op_policy, key, out_dtype):
  return _qdot_fwd(lhs, rhs, dims, op_policy, key, out_dtype)[0]


def _qdot_fwd(lhs, rhs, dims, op_policy, key, out_dtype):
  k = stream_keys(key, 6)
  value = Operand(op_policy.rounding, False)
  p = op_policy.fwd
  if p in QUANTIZED_PRECISIONS:
    lhs_q, lres = _quantize_forward(lhs, op_policy, 0, dims, k[0])
    rhs_q, rres = _quantize_forward(rhs, op_policy, 1, dims, k[1])
    out = gemm_8bit(lhs_q, rhs_q, dims, out_dtype)
  else:
    out = leg_dot(p, op_policy.granularity, lhs, rhs, dims, value, value, out_dtype=out_dtype)
    fwd_dtype = FLOAT_DTYPES.get(p)
    lres = lhs if fwd_dtype is None else lhs.astype(fwd_dtype)
    rres = rhs if fwd_dtype is None else rhs.astype(fwd_dtype)
  residuals = (lres, rres, k[2:], jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
  return out.astype(out_dtype), residuals


def _qdot_bwd(dims, op_policy, out_dtype, residuals, g):
  lres, rres, k, lhs_proto, rhs_proto = residuals
  check_backward_key(op_policy, k[0])
  nl = (lres[0] if _is_quantized(lres) else lres).ndim
  nr = (rres[0] if _is_quantized(rres) else rres).ndim
  la = _residual_axes(op_policy, 0, dims, nl) if _is_quantized(lres) else None
  ra = _residual_axes(op_policy, 1, dims, nr) if _is_quantized(rres) else None
  value = Operand(op_policy.rounding, False)
  grad = Operand(op_policy.grad_rounding, True)
  gran = op_policy.granularity
  dl_dims, dl_perm = dlhs_dims(nl, nr, dims)
  dr_dims, dr_perm = drhs_dims(nl, nr, dims)
  pair = _grad_pair(op_policy, g, (lres, la, dr_dims), (rres, ra, dl_dims), k[0])
  if pair is not None:
    (g_dl, rhs_q), (lhs_q, g_dr) = pair
    dlhs = gemm_8bit(g_dl, rhs_q, dl_dims, lhs_proto.dtype)
    drhs = gemm_8bit(lhs_q, g_dr, dr_dims, rhs_proto.dtype)
  else:
    dlhs = leg_dot(
      op_policy.dlhs, gran, g, rres, dl_dims, grad, value, k[0], k[1], rhs_axes=ra, out_dtype=lhs_proto.dtype
    )
    drhs = leg_dot(
      op_policy.drhs, gran, lres, g, dr_dims, value, grad, k[2], k[3], lhs_axes=la, out_dtype=rhs_proto.dtype
    )
  return jnp.transpose(dlhs, dl_perm), jnp.transpose(drhs, dr_perm), None


def _grad_pair(op_policy: OpPolicy, g, lhs_side, rhs_side, key):
  """Both gradient legs' operands, with dY quantized for both in one ``quantize_pair``, or None.

  Applies where both legs are 8-bit in the forward's format with per-channel scales and the
  product has no batch axes: then dX = dY·Wᵀ contracts dY's trailing (W's free) axes, with
  W's saved scale folded into dY along them, and dW = Xᵀ·dY contracts dY's leading (X's free)
  axes, with X's saved scale folded in along those (``reuse_saved``). ``lhs_side`` /
  ``rhs_side`` are ``(residual, its axes, the leg's dims)`` of X's leg (dW) and W's leg (dX).
  Returns ``((dY for dX, W), (X, dY for dW))`` as ``gemm_8bit`` operands: the values
  ``leg_dot`` would quantize (with nearest rounding; stochastic rounding draws from
  ``quantize_pair``'s own stream), in two passes over dY instead of four on a GPU.
  """
  p = op_policy.dlhs
  if p not in QUANTIZED_PRECISIONS or op_policy.drhs != p or op_policy.granularity != "per_channel":
    return None
  (lres, la, dr_dims), (rres, ra, dl_dims) = lhs_side, rhs_side
  ((g_dl_contract, w_contract), (g_batch, w_batch)) = dl_dims
  ((x_contract, g_dr_contract), (x_batch, _)) = dr_dims
  if g_batch or not g_dl_contract or not g_dr_contract:
    return None
  value = Operand(op_policy.rounding, False)
  w = reuse_saved(rres, ra, w_contract + w_batch, g, None, g_dl_contract, p, value)
  x = reuse_saved(lres, la, x_contract + x_batch, g, None, g_dr_contract, p, value)
  if w is None or x is None or not (_is_quantized(w[1]) and _is_quantized(x[1])):
    return None  # a scale that stays on its values (per tensor) has nothing to fold into dY
  (w_q, (_, onto_w)), (x_q, (_, onto_x)) = w, x
  split = len(g_dr_contract)
  (q_dl, s_dl), (q_dr, s_dr) = quantize_pair(
    g, qformat(p, True), split, op_policy.grad_rounding, key, in_scales=(onto_w, onto_x)
  )
  head, tail = tuple(range(split)), tuple(range(split, g.ndim))
  return ((q_dl, s_dl, head + tail), w_q), (x_q, (q_dr, s_dr, tail + head))


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
    key: PRNG key, required when ``op_policy`` rounds stochastically: by the forward where it
      rounds its operands so, else by the gradient (``qsync_jax.ops.keys``).
    out_dtype: output dtype; defaults to ``jnp.result_type(lhs, rhs)``.
  """
  check_forward_key(op_policy, key)
  if out_dtype is None:
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  if not op_policy.needs_rng:
    key = None
  if _runs_native(op_policy):
    # every leg at one full-precision float: lax.dot_general and JAX's own gradients compute
    # exactly that, and leave XLA free to lay out and fuse the step as for the plain model
    # (a custom_vjp would hide the product from XLA's layout and fusion passes)
    value = Operand(op_policy.rounding, False)
    dims = _canonical_dims(dimension_numbers)
    return leg_dot(op_policy.fwd, op_policy.granularity, lhs, rhs, dims, value, value, out_dtype=out_dtype)
  if _is_plain_16bit(op_policy, lhs.dtype, rhs.dtype, out_dtype):
    # every leg at the 16-bit type the operands and the result already have: the plain
    # model's own product (float32 accumulation, one rounding; JAX's gradients compute the
    # same legs), so a uniform bf16 policy on a bf16 model compiles to the plain program
    return lax.dot_general(lhs, rhs, dimension_numbers)
  lhs, rhs = match_vma(lhs, rhs)  # under shard_map: cotangents must be typed like the inputs
  return _qdot(lhs, rhs, _canonical_dims(dimension_numbers), op_policy, key, jnp.dtype(out_dtype))


def _runs_native(op_policy: OpPolicy) -> bool:
  """Whether every leg of ``op_policy`` is fp32 (or every one tf32): ``leg_dot``'s float32
  product, differentiated by JAX (its transposes keep the precision)."""
  p = op_policy.fwd
  return p in LAX_PRECISION and op_policy.dlhs == p and op_policy.drhs == p


def _is_plain_16bit(op_policy: OpPolicy, lhs_dtype, rhs_dtype, out_dtype) -> bool:
  """Whether every leg of ``op_policy`` is one 16-bit float type that the operands and the
  result already have: then each leg is the plain ``lax.dot_general`` of those operands."""
  p = op_policy.fwd
  if p not in FLOAT_DTYPES or op_policy.dlhs != p or op_policy.drhs != p:
    return False
  dtype = jnp.dtype(FLOAT_DTYPES[p])
  return jnp.dtype(lhs_dtype) == dtype and jnp.dtype(rhs_dtype) == dtype and jnp.dtype(out_dtype) == dtype


def quantized_einsum(subscripts: str, lhs, rhs, op_policy: OpPolicy, key=None, out_dtype=None):
  """``jnp.einsum(subscripts, lhs, rhs)`` with its contraction as a quantized dot_general."""

  def dot_general(a, b, dimension_numbers, precision=None, preferred_element_type=None):
    if _is_plain_16bit(op_policy, a.dtype, b.dtype, out_dtype or jnp.result_type(a.dtype, b.dtype)):
      # jnp.einsum's own call (the plain model's program, to the jaxpr)
      return lax.dot_general(
        a, b, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
      )
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
