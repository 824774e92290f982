"""Picks the implementation of the scaled low-precision GEMM: the jnp reference for now."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.gemm.reference import scaled_dot_general_reference


def scaled_dot_general(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, out_dtype=jnp.float32):
  """See ``reference.scaled_dot_general_reference``."""
  return scaled_dot_general_reference(lhs_q, rhs_q, lhs_scale, rhs_scale, dimension_numbers, out_dtype)
