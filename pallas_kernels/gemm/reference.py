"""Scaled low-precision ``dot_general``: the definition (pure jnp).

``scaled_dot_general_reference(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers)`` is
equivalent to::

    acc = lax.dot_general(lhs_q, rhs_q, dimension_numbers,
                          preferred_element_type=int32 if int8 else float32)
    out = acc.astype(float32) * lhs_scale_in_output_layout * rhs_scale_in_output_layout

i.e. ``dot_general(dequantize(lhs), dequantize(rhs))`` with the scales factored out of the
contraction (then ``+ bias``, if given, in float32, before the cast to ``out_dtype``).
Scales keep their operand's rank and must have size 1 along the contracting dims (per
tensor, or per channel over the non-contracting dims).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def free_axes(ndim: int, contract, batch) -> list[int]:
  """Axes of an operand that are neither contracted nor batch, in order."""
  used = set(contract) | set(batch)
  return [a for a in range(ndim) if a not in used]


def scale_in_output_layout(scale: jax.Array, contract, batch, side: str, n_other_free: int) -> jax.Array:
  """Re-lays an operand's keepdims scale so it broadcasts against the dot_general output.

  The output of ``dot_general`` is ``batch dims + lhs free dims + rhs free dims``.
  """
  ndim = scale.ndim
  for a in contract:
    if scale.shape[a] != 1:
      raise ValueError(
        f"scale of shape {scale.shape} varies along contracting axis {a}; scales must be "
        "per tensor or per channel over the non-contracting axes."
      )
  free = free_axes(ndim, contract, batch)
  s = jnp.transpose(scale, tuple(batch) + tuple(free) + tuple(contract))
  s = s.reshape(s.shape[: len(batch) + len(free)])
  if side == "lhs":
    return s.reshape(s.shape + (1,) * n_other_free)
  nb = len(batch)
  return s.reshape(s.shape[:nb] + (1,) * n_other_free + s.shape[nb:])


def accumulator_dtype(dtype) -> jnp.dtype:
  return jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32


def scaled_dot_general_reference(
  lhs_q: jax.Array,
  rhs_q: jax.Array,
  lhs_scale: jax.Array,
  rhs_scale: jax.Array,
  dimension_numbers: DimensionNumbers,
  out_dtype=jnp.float32,
  bias: jax.Array | None = None,
) -> jax.Array:
  """See the module docstring; ``bias`` (shaped like the rhs free dims) is added last."""
  (lc, rc), (lb, rb) = dimension_numbers
  acc = lax.dot_general(
    lhs_q, rhs_q, dimension_numbers, preferred_element_type=accumulator_dtype(lhs_q.dtype)
  )
  n_lhs_free = len(free_axes(lhs_q.ndim, lc, lb))
  n_rhs_free = len(free_axes(rhs_q.ndim, rc, rb))
  out = acc.astype(jnp.float32)
  out = out * scale_in_output_layout(lhs_scale, lc, lb, "lhs", n_rhs_free)
  out = out * scale_in_output_layout(rhs_scale, rc, rb, "rhs", n_lhs_free)
  if bias is not None:
    out = out + bias.astype(jnp.float32).reshape((1,) * (out.ndim - bias.ndim) + bias.shape)
  return out.astype(out_dtype)
