"""Plain all-reduce of a gradient tree in fp32, bf16 or fp16.

``allreduce(tree, axis_name, dtype=...)`` returns the sum over ``axis_name`` of every float
leaf, in the leaf's own dtype. Low-precision payloads have two accumulation modes:

* ``accumulate="payload"``: one ``psum`` in the payload dtype (the sum itself is rounded to
  bf16/fp16 at every step of the collective's reduction tree);
* ``accumulate="fp32"`` (default): a reduce-scatter built from an ``all_to_all`` in the payload dtype,
  the n partial chunks summed locally in fp32, and an ``all_gather`` of the result in the
  payload dtype. The same bytes cross the wire as a ring all-reduce, but only the final
  value is rounded once to the payload dtype. The payload moves as uint16 bits, so the
  compiled program really sends 2 bytes per value on every backend (XLA:CPU widens a bf16
  ``psum`` to f32, so the "payload" mode sends fp32 bytes there).

Inputs are expected already weighted by each device's share of the global batch, so the sum
is the weighted mean gradient. Must run inside ``shard_map`` (or another named-axis context).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qsync_jax.errors import QsyncError
from qsync_jax.sync.common import AXIS, all_gather_invariant, axis_size, is_float

PAYLOAD_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
ACCUMULATE = ("payload", "fp32")


def check_options(dtype: str, accumulate: str = "fp32", bucket_bytes=None) -> None:
  """``QsyncError`` naming the fix for options ``allreduce`` cannot take."""
  if dtype not in PAYLOAD_DTYPES:
    raise QsyncError(f"all-reduce dtype={dtype!r} is not one of {sorted(PAYLOAD_DTYPES)}; pick one of them.")
  if accumulate not in ACCUMULATE:
    raise QsyncError(f"all-reduce accumulate={accumulate!r} must be one of {ACCUMULATE}.")
  if bucket_bytes is None:
    return
  if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
    raise QsyncError(
      f"all-reduce bucket_bytes={bucket_bytes!r} is not a positive number of bytes. "
      "Fix: pass an int, e.g. bucket_bytes=31457280 (30 MiB), or leave it unset."
    )
  if dtype != "fp32" and accumulate != "payload":
    raise QsyncError(
      f"all-reduce bucket_bytes with dtype={dtype!r}, accumulate={accumulate!r}: buckets apply to the "
      "psum paths. Fix: use dtype='fp32' or accumulate='payload', or leave bucket_bytes unset."
    )


def pack(sizes, bucket_bytes: int) -> list[list[int]]:
  """Indices of ``sizes`` (bytes) packed greedily, in order, into runs of at most
  ``bucket_bytes`` (an item larger than that is a run of its own)."""
  runs: list[list[int]] = []
  total = 0
  for i, size in enumerate(sizes):
    if runs and total + size <= bucket_bytes:
      runs[-1].append(i)
      total += size
    else:
      runs.append([i])
      total = size
  return runs


def allreduce(
  tree,
  axis_name: str = AXIS,
  *,
  dtype: str = "fp32",
  accumulate: str = "fp32",
  bucket_bytes: int | None = None,
):
  """Sum of every float leaf of ``tree`` over ``axis_name``, sent as ``dtype``; see module doc.

  ``bucket_bytes`` (``psum`` paths: fp32, or ``accumulate="payload"``): the leaves, in their
  flattening order, are concatenated into buckets of at most that many payload bytes and each
  bucket is one ``psum``, so each collective waits only for its own leaves. Left ``None``,
  every leaf is its own ``psum`` and XLA's all-reduce combiner packs them into collectives of
  up to 30 MiB (on GPUs) — in parameter-tree order whatever order they come in, so most of
  the all-reduce waits for the end of the backward pass. Given leaves in backward order (the
  trainer's ``sync_leaf_order="auto"``), buckets of about XLA's threshold complete as the
  backward produces them, and XLA cannot merge two of them (together they exceed its
  threshold). ``docs/results.md`` times them against the combiner."""
  check_options(dtype, accumulate, bucket_bytes)
  payload = PAYLOAD_DTYPES[dtype]
  leaves, treedef = jax.tree.flatten(tree)
  floats = [i for i, x in enumerate(leaves) if is_float(x)]
  if not floats:
    return tree
  out = list(leaves)
  psum_path = dtype == "fp32" or accumulate == "payload"
  if bucket_bytes is not None:
    width = jnp.dtype(payload).itemsize
    for run in pack([leaves[i].size * width for i in floats], bucket_bytes):
      members = [floats[j] for j in run]
      _split_into(out, lax.psum(_concat(leaves, members, payload), axis_name), leaves, members)
    return jax.tree.unflatten(treedef, out)
  if psum_path:
    summed = lax.psum([leaves[i].astype(payload) for i in floats], axis_name)
    for i, s in zip(floats, summed):
      out[i] = s.astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, out)
  # fp32 accumulation: one flat bucket, reduce-scatter by all_to_all, local fp32 sum, all_gather.
  # The moved values are bitcast to uint16, so no backend can widen the payload (XLA:CPU widens
  # bf16 collectives to f32); moving bits is exact.
  n = axis_size(axis_name)
  flat = _concat(leaves, floats, payload)
  size = flat.shape[0]
  chunk = -(-size // n)
  bits = lax.bitcast_convert_type(jnp.pad(flat, (0, n * chunk - size)), jnp.uint16).reshape(n, chunk)
  parts = lax.bitcast_convert_type(lax.all_to_all(bits, axis_name, 0, 0, tiled=True), payload)
  mine = jnp.sum(parts.astype(jnp.float32), axis=0).astype(payload)  # row j: device j's copy
  gathered = all_gather_invariant(lax.bitcast_convert_type(mine, jnp.uint16), axis_name, tiled=True)
  _split_into(out, lax.bitcast_convert_type(gathered, payload)[:size], leaves, floats)
  return jax.tree.unflatten(treedef, out)


def _concat(leaves, members, dtype):
  """``leaves[i]`` for ``i`` in ``members``, flattened, cast to ``dtype`` and concatenated."""
  return jnp.concatenate([leaves[i].astype(dtype).reshape(-1) for i in members])


def _split_into(out: list, flat, leaves, members) -> None:
  """Inverse of ``_concat``: ``out[i]`` becomes its slice of ``flat``, in the shape and dtype of ``leaves[i]``."""
  offset = 0
  for i in members:
    x = leaves[i]
    out[i] = flat[offset : offset + x.size].reshape(x.shape).astype(x.dtype)
    offset += x.size
