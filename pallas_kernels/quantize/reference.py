"""Symmetric absmax quantization to int8 and fp8: the definition (pure jnp).

``quantize_reference(x, fmt, reduce_axes, rounding, key)`` returns ``(qvalue, scale)`` with
``x ≈ qvalue.astype(f32) * scale``; ``scale`` keeps ``x``'s rank (size 1 along
``reduce_axes``), so per-tensor (reduce every axis), per-row and per-column scales are one
function. The scale is ``max|x| / qmax`` over ``reduce_axes``, or 1 where that quotient is 0
(``max|x|`` is 0, or so small that the quotient is below float32's smallest normal number and
XLA flushes it to 0): such a slice quantizes to zeros instead of dividing by 0.

Rounding:
  * ``nearest``: round half to even (int8) / the format's own round-to-nearest (fp8).
  * ``stochastic``: round up with probability equal to the distance from the lower
    representable value, so ``E[dequantize(quantize(x))] == x`` (unbiased). Needs ``key``.

``in_scale`` (optional) makes ``x`` a quantized value: the tensor quantized is then
``dequantize_reference(x, in_scale)``. That is how a quantized residual is re-quantized
along other axes without a float copy in memory (the kernels read ``x`` and ``in_scale``).

This module is the CPU path, the fallback and the test oracle for the Pallas kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.quantize.noise import uniform_noise

QFORMATS = {
  # name: (storage dtype, largest representable magnitude, mantissa bits, min normal exponent)
  "int8": (jnp.int8, 127.0, None, None),
  "e4m3": (jnp.float8_e4m3fn, 448.0, 3, -6),
  "e5m2": (jnp.float8_e5m2, 57344.0, 2, -14),
}


def _check(fmt: str, rounding: str, key) -> None:
  if fmt not in QFORMATS:
    raise ValueError(f"fmt={fmt!r} is not one of {sorted(QFORMATS)}.")
  if rounding not in ("nearest", "stochastic"):
    raise ValueError(f"rounding={rounding!r} must be 'nearest' or 'stochastic'.")
  if rounding == "stochastic" and key is None:
    raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...).")


def absmax_scale(x: jax.Array, fmt: str, reduce_axes: Sequence[int]) -> jax.Array:
  """``max|x| / qmax`` over ``reduce_axes`` (kept as size-1 dims), in float32; 1 where 0."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=tuple(reduce_axes), keepdims=True)
  return scale_from_absmax(amax, QFORMATS[fmt][1])


def scale_from_absmax(amax: jax.Array, qmax: float) -> jax.Array:
  """``amax / qmax``, or 1 where that is 0 (``amax`` is 0 or the quotient flushes to 0).

  A float32 quotient below the smallest normal (``amax < qmax * 1.18e-38``: 6.7e-34 for e5m2)
  is flushed to 0 by XLA on the CPU and the GPU; dividing by it would give inf and, for the
  slice's zeros, NaN. With scale 1 such a slice quantizes to zeros.
  """
  scale = amax / qmax
  return jnp.where(scale > 0, scale, jnp.ones_like(scale))


def round_to_format(y: jax.Array, fmt: str, rounding: str, key=None, noise=None) -> jax.Array:
  """Rounds float32 ``y`` (already scaled into the format's range) and casts to storage.

  Stochastic rounding draws its uniform [0, 1) numbers from ``key``
  (``noise.uniform_noise``: the kernels' stream), or takes them as ``noise`` (an array
  shaped like ``y``).
  """
  dtype, qmax, mantissa_bits, min_exp = QFORMATS[fmt]
  y = y.astype(jnp.float32)
  if rounding == "stochastic" and noise is None:
    noise = uniform_noise(key, y.shape)
  if fmt == "int8":
    if rounding == "stochastic":
      y = jnp.floor(y + noise)
    else:
      y = jnp.round(y)
    return jnp.clip(y, -qmax, qmax).astype(dtype)
  if rounding == "stochastic":
    # Spacing of representable values at |y|: 2^(e - mantissa_bits), e = exponent of |y|
    # (never below the smallest normal exponent: subnormals share its spacing). frexp is
    # exact, where floor(log2(.)) can round up just below a power of two.
    _, e = jnp.frexp(jnp.maximum(jnp.abs(y), 2.0**min_exp))
    ulp = jnp.ldexp(jnp.ones_like(y), e - 1 - mantissa_bits)
    lower = jnp.floor(y / ulp) * ulp
    up = noise < (y - lower) / ulp
    y = jnp.where(up, lower + ulp, lower)
  return jnp.clip(y, -qmax, qmax).astype(dtype)


def quantize_reference(
  x: jax.Array,
  fmt: str,
  reduce_axes: Sequence[int],
  rounding: str = "nearest",
  key: jax.Array | None = None,
  in_scale: jax.Array | None = None,
  noise: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(qvalue, scale)``: ``qvalue = round(x / scale)`` in ``fmt``; see the module doc."""
  _check(fmt, rounding, key if noise is None else noise)
  if in_scale is not None:
    x = dequantize_reference(x, in_scale)
  scale = absmax_scale(x, fmt, reduce_axes)
  qvalue = round_to_format(x.astype(jnp.float32) / scale, fmt, rounding, key, noise)
  return qvalue, scale


def quantize_at_scale(
  x: jax.Array,
  fmt: str,
  scale: jax.Array,
  rounding: str = "nearest",
  key: jax.Array | None = None,
  in_scale: jax.Array | None = None,
  noise: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(qvalue, absmax)`` at a given ``scale`` (broadcasting against ``x``, e.g. a delayed scale
  from earlier steps' amaxes): ``qvalue = round(x / scale)`` in ``fmt``, saturated at the format's
  largest magnitude where ``|x| / scale`` exceeds it, and ``absmax = max|x|`` (a float32 scalar:
  the amax a delayed scale is made from). ``in_scale``, ``rounding``, ``key`` and ``noise`` as for
  ``quantize_reference``; with ``scale = absmax_scale(x, fmt, reduce_axes)`` the codes are its."""
  _check(fmt, rounding, key if noise is None else noise)
  if in_scale is not None:
    x = dequantize_reference(x, in_scale)
  x = x.astype(jnp.float32)
  qvalue = round_to_format(x / scale.astype(jnp.float32), fmt, rounding, key, noise)
  return qvalue, jnp.max(jnp.abs(x))


def dequantize_reference(qvalue: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``qvalue * scale`` in ``dtype``."""
  return (qvalue.astype(jnp.float32) * scale).astype(dtype)
