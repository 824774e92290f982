"""Stochastic rounding's uniform noise: a counter-based hash of (seed, element index).

One stream for the kernels and the jnp reference: ``uniform_noise(key, shape)`` is
``hash_uniform`` of the two seed words of ``key`` (``seed_words``) and each element's
row-major linear index. The kernels hash the same index of their ``[rows, cols]`` view of
the array (``element_index``), so both draw the same numbers for the same element,
whatever the tiling or the output layout. ``pair_noise(key, shape)`` is the stream of
``quantize_pair``, which rounds each element twice: two 16-bit numbers from one hash.

Why not ``jax.random.uniform``: threefry costs about 20 integer rounds per element and on
XLA:CPU runs as a while loop whose two 32-bit words per element are materialized ahead of
the backward pass; this hash is elementwise and fuses into the rounding. Indices are uint32:
a tensor of more than 2**32 elements repeats its noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def _mix32(h: jax.Array) -> jax.Array:
  """A 32-bit integer finaliser (lowbias32, C. Wellons): good avalanche, 2 multiplies."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def hash_uniform(seed0, seed1, index: jax.Array) -> jax.Array:
  """Uniform float32 in [0, 1) (24 random bits) from a uint32 element ``index``.

  Counter-based: two rounds of ``_mix32`` keyed by the two uint32 seed words. Runs inside
  kernels and in plain jnp.
  """
  h = _mix32(index * jnp.uint32(0x9E3779B9) ^ seed0)
  h = _mix32(h ^ seed1)
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def pair_uniforms(seed0, seed1, index: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two uniform float32 numbers in [0, 1) (16 random bits each) from one hash of a uint32
  element ``index``: the high half of ``_mix32((index ^ seed1) * 0x9E3779B9 ^ seed0)`` and
  its low half.

  ``quantize_pair`` rounds two copies of each element: one hash serves both, a third of the
  integer work of two ``hash_uniform`` calls (stochastic rounding of a large gradient is
  bound by that work, not by memory). 16 bits put a rounding probability within 2**-16 of
  the exact one, a bias far below the format's own grid step.
  """
  h = _mix32((index ^ seed1) * jnp.uint32(0x9E3779B9) ^ seed0)
  return _unit(h >> 16), _unit(h & jnp.uint32(0xFFFF))


def _unit(bits16: jax.Array) -> jax.Array:
  """``bits16 * 2**-16`` in float32 for 16-bit unsigned ``bits16``, without an integer-to-float
  conversion (a quarter-rate instruction on a GPU): the float ``1 + bits16 * 2**-16`` is written
  as bits (exponent of 1, ``bits16`` at the top of the mantissa), then 1 is subtracted (exact)."""
  one_plus = lax.bitcast_convert_type((bits16 << 7) | jnp.uint32(0x3F800000), jnp.float32)
  return one_plus - jnp.float32(1.0)


def seed_words(key: jax.Array) -> jax.Array:
  """Two uint32 words from a PRNG key (new-style or raw uint32 key data): a Threefry key's own
  two data words; for an implementation with longer keys, two words it draws.

  No draw from a Threefry key: one that reaches a quantization is a split or folded-in key
  already, and a draw (``jax.random.bits``) would put one more Threefry computation, a few
  hundred instructions, into the compiled step for every stochastically rounded tensor.
  """
  data = jax.random.key_data(key)
  if data.shape == (2,):
    return data.astype(jnp.uint32)
  return jax.random.bits(key, (2,), jnp.uint32)


def stream_keys(key: jax.Array | None, n: int) -> list:
  """``n`` keys for distinct noise streams from one key, with no Threefry computation (``n``
  Nones for ``key=None``): key ``i``'s two data words are ``_mix32`` of ``key``'s words salted
  with ``i + 1``, so ``seed_words`` of each is a fresh pair. An op's legs take one each.

  ``jax.random.split`` would put one Threefry computation (a few hundred instructions) into the
  compiled step for every stochastically rounded op; this is a handful of integer operations.
  Keys of an implementation with longer data are split with ``jax.random.split``.
  """
  if key is None:
    return [None] * n
  data = jax.random.key_data(key)
  if data.shape != (2,):
    return list(jax.random.split(key, n))
  words, impl = data.astype(jnp.uint32), jax.random.key_impl(key)
  keys = []
  for i in range(n):
    salt = jnp.uint32((0x9E3779B9 * (i + 1)) & 0xFFFFFFFF)
    mixed = jnp.stack([_mix32(words[0] ^ salt), _mix32(words[1] + salt)])
    keys.append(jax.random.wrap_key_data(mixed, impl=impl))
  return keys


def element_index(rows: jax.Array, cols: jax.Array, n_cols: int) -> jax.Array:
  """Row-major linear index of ``(rows, cols)`` in a ``[*, n_cols]`` view, as uint32."""
  return rows.astype(jnp.uint32) * jnp.uint32(n_cols) + cols.astype(jnp.uint32)


def uniform_noise(key: jax.Array, shape: Sequence[int]) -> jax.Array:
  """float32 uniform [0, 1) noise of ``shape``: element ``i`` (row-major) is
  ``hash_uniform(*seed_words(key), i)``."""
  index = lax.iota(jnp.uint32, math.prod(shape)).reshape(tuple(shape))
  seed = seed_words(key)
  return hash_uniform(seed[0], seed[1], index)


def pair_noise(key: jax.Array, shape: Sequence[int]) -> tuple[jax.Array, jax.Array]:
  """``quantize_pair``'s two float32 noise arrays of ``shape``: element ``i`` (row-major) of
  each is ``pair_uniforms(*seed_words(key), i)``."""
  index = lax.iota(jnp.uint32, math.prod(shape)).reshape(tuple(shape))
  seed = seed_words(key)
  return pair_uniforms(seed[0], seed[1], index)
