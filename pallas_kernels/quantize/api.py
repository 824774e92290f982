"""Picks the implementation of quantize: the jnp reference for now (CPU and fallback)."""

from __future__ import annotations

from pallas_kernels.quantize.reference import dequantize_reference, quantize_reference


def quantize(x, fmt, reduce_axes, rounding="nearest", key=None):
  """``(qvalue, scale)`` with ``x ≈ qvalue * scale``; see ``reference.quantize_reference``."""
  return quantize_reference(x, fmt, reduce_axes, rounding, key)


def dequantize(qvalue, scale, dtype=None):
  import jax.numpy as jnp

  return dequantize_reference(qvalue, scale, jnp.float32 if dtype is None else dtype)
