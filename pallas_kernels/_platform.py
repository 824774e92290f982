"""Where kernels may run: the GPU check shared by every op's ``api``."""

from __future__ import annotations

import functools

import jax


@functools.cache
def on_gpu() -> bool:
  """True when JAX's default backend is a CUDA GPU (where the Pallas kernels compile)."""
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:  # no backend initialised at all
    return False


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def largest_pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two that divides ``n`` and is at most ``cap`` (1 if ``n`` is odd)."""
  d = 1
  while d * 2 <= cap and n % (d * 2) == 0:
    d *= 2
  return d
