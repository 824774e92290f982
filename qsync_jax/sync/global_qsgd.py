"""Global-QSGD all-reduce (standard dithering; Xin et al., arXiv 2305.18627).

One global scale per bucket, agreed by a single ``pmax`` over the vector of every bucket's
max|g| (one collective for all leaves). Each of the n workers maps its values to integers in
[-L, L] with ``L = floor(qmax / n)`` by unbiased stochastic rounding, so the n-way integer sum
stays within the payload's range and the ``psum`` runs on integers (int8 while n <= 127).
The sum is multiplied back by the scale: ``E[result] = sum_i g_i`` exactly. No error feedback.

With share-weighted inputs (``share_i * g_i``) the result is the weighted mean gradient.
Buckets: ``bucket_size=None`` uses one scale per leaf; an int splits every flattened leaf into
buckets of that many values (tighter scales, ``4 * numel / bucket_size`` more bytes in the
pmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quantize.noise import uniform_noise
from pallas_kernels.quantize.reference import scale_from_absmax
from qsync_jax.errors import QsyncError
from qsync_jax.sync.common import AXIS, axis_size, device_key, is_float, leaf_keys

# payload name: (integer dtype, largest magnitude of the n-way sum)
INT_PAYLOADS = {"int8": (jnp.int8, 127), "int16": (jnp.int16, 32767), "int32": (jnp.int32, 2**31 - 1)}
# float32 has 24 mantissa bits: keep |y| + 1 exactly representable so floor(y + u) stays unbiased.
MAX_LEVELS = 2**22
ROUNDINGS = ("stochastic", "nearest")


def payload_for(n: int, payload: str = "auto") -> tuple[str, int]:
  """``(payload name, L)`` for n workers: the narrowest integer type with ``L >= 1`` for "auto"."""
  if payload == "auto":
    for name, (_, qmax) in INT_PAYLOADS.items():
      if qmax // n >= 1:
        return name, min(qmax // n, MAX_LEVELS)
  if payload not in INT_PAYLOADS:
    raise QsyncError(
      f"Global-QSGD payload={payload!r} is not one of {['auto', *INT_PAYLOADS]}; pick 'auto' or an integer type."
    )
  levels = INT_PAYLOADS[payload][1] // n
  if levels < 1:
    raise QsyncError(
      f"Global-QSGD payload={payload!r} cannot hold the sum of {n} workers (L = floor(qmax/n) = 0); "
      "use a wider payload or payload='auto'."
    )
  return payload, min(levels, MAX_LEVELS)


def dither(x: jax.Array, scale: jax.Array, levels: int, key, dtype, rounding: str = "stochastic"):
  """Integers ``q`` in [-levels, levels] with ``E[q * scale] = x`` (stochastic rounding).

  ``scale`` broadcasts against ``x`` and must satisfy ``|x| <= levels * scale``.
  ``rounding="nearest"`` is the biased variant (for tests and ablations only).
  """
  y = x.astype(jnp.float32) / scale
  if rounding == "stochastic":
    y = jnp.floor(y + uniform_noise(key, y.shape))  # the quantize kernels' stream
  else:
    y = jnp.round(y)
  return jnp.clip(y, -levels, levels).astype(dtype)


def _buckets(x: jax.Array, bucket_size: int | None) -> jax.Array:
  """``x`` flattened into rows of ``bucket_size`` (zero padded); one row if None."""
  flat = x.reshape(-1)
  if bucket_size is None:
    return flat.reshape(1, -1)
  rows = -(-flat.shape[0] // bucket_size)
  return jnp.pad(flat, (0, rows * bucket_size - flat.shape[0])).reshape(rows, bucket_size)


def global_qsgd_allreduce(
  tree,
  axis_name: str = AXIS,
  key: jax.Array | None = None,
  *,
  payload: str = "auto",
  bucket_size: int | None = None,
  rounding: str = "stochastic",
):
  """Unbiased integer all-reduce of every float leaf of ``tree``; see the module doc."""
  if key is None and rounding == "stochastic":
    raise QsyncError("Global-QSGD needs a PRNG key for stochastic rounding: pass key=jax.random.key(...).")
  if rounding not in ROUNDINGS:
    raise QsyncError(f"Global-QSGD rounding={rounding!r} must be one of {ROUNDINGS}.")
  if bucket_size is not None and bucket_size < 1:
    raise QsyncError(f"Global-QSGD bucket_size={bucket_size!r} must be a positive int or None.")
  leaves, treedef = jax.tree.flatten(tree)
  floats = [i for i, x in enumerate(leaves) if is_float(x)]
  if not floats:
    return tree
  name, levels = payload_for(axis_size(axis_name), payload)
  int_dtype = INT_PAYLOADS[name][0]
  rows = [_buckets(leaves[i], bucket_size) for i in floats]
  local_max = jnp.concatenate([jnp.max(jnp.abs(r.astype(jnp.float32)), axis=1) for r in rows])
  global_max = lax.pmax(local_max, axis_name)  # the one float collective: a vector of maxima
  scales = scale_from_absmax(global_max, levels)  # a bucket too small to scale sends zeros
  keys = leaf_keys(device_key(key, axis_name), rows) if rounding == "stochastic" else [None] * len(rows)
  qs, offsets, start = [], [], 0
  for i, r, k in zip(floats, rows, keys):
    scale = scales[start : start + r.shape[0]][:, None]
    offsets.append((start, r.shape[0]))
    start += r.shape[0]
    # Only the values travel: the bucket padding is dropped before the psum.
    qs.append(dither(r, scale, levels, k, int_dtype, rounding).reshape(-1)[: leaves[i].size])
  summed = lax.psum(qs, axis_name)  # integer all-reduce
  out = list(leaves)
  for i, s, r, (start, count) in zip(floats, summed, rows, offsets):
    x = leaves[i]
    s = jnp.pad(s, (0, r.size - x.size)).reshape(r.shape)
    value = s.astype(jnp.float32) * scales[start : start + count][:, None]
    out[i] = value.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype)
  return jax.tree.unflatten(treedef, out)
