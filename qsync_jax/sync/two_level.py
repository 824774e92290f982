"""Two-level fp32 gradient sum: within each device group, then across groups, bucket by bucket.

Devices on the ``data`` axis belong to groups that take them in order (group ``g`` holds
``group_sizes[g]`` consecutive devices; its first device is its *leader*). With ``n_g`` the
size of group ``g``, ``n_max = max n_g``, ``G = len(group_sizes)`` and ``R = ceil(log2 n_max)``,
``two_level_allreduce(tree, group_sizes, bucket_bytes=...)`` packs the leaves (as fp32, in their
flattening order) into buckets of consecutive leaves of at most ``bucket_bytes`` bytes
(``qsync_jax.sync.allreduce.pack``, as the flat all-reduce packs its buckets; ``None``: one
bucket of every leaf), concatenates each bucket into one buffer of ``S`` bytes and runs on it,
with ``lax.ppermute`` over partial permutations only:

1. **tree reduce inside each group**, ``R`` rounds: in round ``r`` the member at position ``i``
   of its group with ``i % 2**(r+1) == 2**r`` sends its partial sum to position ``i - 2**r``,
   which adds it (one ``ppermute`` per round carries the pairs of every group). The leader
   ends with its group's sum.
2. **ring all-reduce among the leaders**, ``2 (G - 1)`` rounds: the buffer is zero padded to
   ``G`` equal chunks of ``ceil(S / G)`` bytes; leader ``k`` sends to leader ``(k + 1) % G``:
   ``G - 1`` reduce-scatter rounds (send chunk ``(k - s) % G``, the receiver adds it), then
   ``G - 1`` all-gather rounds (send chunk ``(k + 1 - s) % G``, the receiver stores it).
3. **tree broadcast inside each group**, the rounds of 1 in reverse (``r = R - 1 … 0``):
   position ``i`` with ``i % 2**(r+1) == 0`` sends the sum to ``i + 2**r``, which keeps it.

A bucket's rounds read only that bucket's leaves, so its sends can start as soon as they exist:
the trainer (``two_level_sync``, ``leaf_order = "backward"``) hands the gradient leaves in the
order the backward pass produces them (``qsync_jax.sync.order``), so the first buckets are the
last layers' and XLA may run their sends while the earlier layers' backward runs.

Rounds per bucket: ``2 R + 2 (G - 1)``. Bytes per link and bucket: each tree edge of a group
carries ``S`` once each way (phases 1 and 3; a device sends at most ``S`` in phase 1 and
receives ``S`` in phase 3, a leader receives up to ``R·S`` in phase 1); each ring link between
leaders carries ``2 (G - 1) · ceil(S / G)`` (≈ ``2 S (G - 1) / G``). A flat ring all-reduce over
all ``n`` devices carries ``2 S (n - 1) / n`` on every link, the links between groups included.

The result equals ``lax.psum(tree, axis_name)`` (leaves as fp32) up to fp32 summation order,
and is bit-for-bit the same on every device (phase 3 copies one buffer everywhere).

Typing: ``ppermute`` results are typed *varying* under ``shard_map(check_vma=True)``, and jax
has no communication-free cast from varying to invariant. So when a bucket is typed varying
over ``axis_name``, the result is typed invariant by ``all_gather_invariant`` of each device's
``1/n`` slice of the (already identical) bucket: one all-gather over every device per bucket,
the slow links included. The trainer's step avoids it: a two-level step runs under
``shard_map(check_vma=False)``, where nothing is typed and no collective is added.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qsync_jax.errors import QsyncError
from qsync_jax.ops.vma import vma
from qsync_jax.sync.allreduce import pack
from qsync_jax.sync.common import AXIS, all_gather_invariant, axis_size

BUCKET_BYTES = 30 * 2**20
"""The trainer's two-level bucket size (fp32 bytes): XLA:GPU's all-reduce combine threshold, the
size of the flat all-reduce's buckets (``planners.predictor.graph`` prices both)."""


def check_group_sizes(group_sizes: Sequence[int]) -> tuple[int, ...]:
  """``group_sizes`` as a tuple of positive ints (``QsyncError`` naming the fix otherwise)."""
  sizes = tuple(group_sizes)
  if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
    raise QsyncError(
      f"two-level reduction group_sizes={list(sizes)!r} must be one or more positive device counts. "
      "Fix: pass the number of devices of each group, in device order (e.g. (4, 4))."
    )
  return sizes


def leaders(group_sizes: Sequence[int]) -> tuple[int, ...]:
  """Axis index of each group's first device (its leader)."""
  return tuple(int(x) for x in np.cumsum((0, *group_sizes[:-1])))


def tree_rounds(group_sizes: Sequence[int]) -> int:
  """``ceil(log2 n_max)``: rounds of each tree phase."""
  return math.ceil(math.log2(max(group_sizes)))


def tree_reduce_pairs(group_sizes: Sequence[int], r: int) -> tuple[tuple[int, int], ...]:
  """``(source, destination)`` axis indices of round ``r`` of the reduce tree, every group's."""
  step = 2**r
  return tuple(
    (first + i, first + i - step)
    for first, n in zip(leaders(group_sizes), group_sizes)
    for i in range(n)
    if i % (2 * step) == step
  )


def two_level_allreduce(
  tree, group_sizes: Sequence[int], axis_name: str = AXIS, *, bucket_bytes: int | None = None
):
  """Sum over ``axis_name`` of every leaf of ``tree`` (as fp32) in two levels, bucket by bucket;
  see module doc.

  Equivalent to ``jax.tree.map(lambda g: lax.psum(g.astype(jnp.float32), axis_name), tree)``
  up to fp32 summation order. ``bucket_bytes``: the most fp32 bytes of consecutive leaves (in
  flattening order) summed as one buffer (a larger leaf is a bucket of its own); ``None``: one
  buffer of every leaf. Must run inside ``shard_map`` over ``axis_name``, whose size must be
  ``sum(group_sizes)``."""
  sizes = check_group_sizes(group_sizes)
  check_bucket_bytes(bucket_bytes)
  n = axis_size(axis_name)
  if n != sum(sizes):
    raise QsyncError(
      f"two-level reduction group_sizes={list(sizes)} covers {sum(sizes)} devices but axis "
      f"{axis_name!r} has {n}. Fix: pass the running groups' device counts (the cluster after plan.place)."
    )
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  index = lax.axis_index(axis_name)
  runs = (
    [list(range(len(leaves)))] if bucket_bytes is None else pack([4 * x.size for x in leaves], bucket_bytes)
  )
  out = [None] * len(leaves)
  for run in runs:
    flat = jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1) for i in run])
    flat = _tree_reduce(flat, sizes, axis_name)
    flat = _leader_ring(flat, sizes, index, axis_name)
    flat = _tree_broadcast(flat, sizes, index, axis_name)
    if axis_name in vma(flat):
      flat = _typed_invariant(flat, n, index, axis_name)
    offset = 0
    for i in run:
      out[i] = flat[offset : offset + leaves[i].size].reshape(leaves[i].shape)
      offset += leaves[i].size
  return jax.tree.unflatten(treedef, out)


def check_bucket_bytes(bucket_bytes) -> None:
  """``QsyncError`` naming the fix unless ``bucket_bytes`` is None or a positive int."""
  if bucket_bytes is None:
    return
  if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
    raise QsyncError(
      f"two-level reduction bucket_bytes={bucket_bytes!r} is not a positive number of bytes. "
      f"Fix: pass an int, e.g. bucket_bytes={BUCKET_BYTES} (30 MiB), or None for one buffer."
    )


def _tree_reduce(flat, sizes, axis_name):
  """Phase 1: every group's sum on its leader (devices that receive nothing add ppermute's zeros)."""
  for r in range(tree_rounds(sizes)):
    flat = flat + lax.ppermute(flat, axis_name, tree_reduce_pairs(sizes, r))
  return flat


def _leader_ring(flat, sizes, index, axis_name):
  """Phase 2: ring all-reduce of the leaders' buffers in ``G`` chunks. Only the leaders' buffers
  are meaningful afterwards (phase 3 overwrites every other device's)."""
  g = len(sizes)
  if g == 1:
    return flat
  heads = leaders(sizes)
  ring = tuple((heads[k], heads[(k + 1) % g]) for k in range(g))
  rank_of_device = np.zeros(sum(sizes), np.int32)
  rank_of_device[list(heads)] = np.arange(g)
  rank = jnp.asarray(rank_of_device)[index]  # this device's place among the leaders
  size = flat.shape[0]
  chunk = -(-size // g)
  chunks = jnp.pad(flat, (0, g * chunk - size)).reshape(g, chunk)
  for s in range(g - 1):  # reduce-scatter: leader k ends holding chunk (k + 1) % g summed
    sent = lax.ppermute(lax.dynamic_index_in_dim(chunks, (rank - s) % g, keepdims=False), axis_name, ring)
    at = (rank - 1 - s) % g
    summed = lax.dynamic_index_in_dim(chunks, at, keepdims=False) + sent
    chunks = lax.dynamic_update_index_in_dim(chunks, summed, at, 0)
  for s in range(g - 1):  # all-gather
    sent = lax.ppermute(lax.dynamic_index_in_dim(chunks, (rank + 1 - s) % g, keepdims=False), axis_name, ring)
    chunks = lax.dynamic_update_index_in_dim(chunks, sent, (rank - s) % g, 0)
  return chunks.reshape(-1)[:size]


def _tree_broadcast(flat, sizes, index, axis_name):
  """Phase 3: the reduce tree's rounds in reverse, each receiver keeping the leader's buffer."""
  for r in reversed(range(tree_rounds(sizes))):
    pairs = tuple((dst, src) for src, dst in tree_reduce_pairs(sizes, r))
    receives = np.zeros(sum(sizes), bool)
    receives[[dst for _, dst in pairs]] = True
    flat = jnp.where(jnp.asarray(receives)[index], lax.ppermute(flat, axis_name, pairs), flat)
  return flat


def _typed_invariant(flat, n, index, axis_name):
  """``flat`` (the same on every device) typed invariant: an all-gather of each device's slice."""
  size = flat.shape[0]
  part = -(-size // n)
  mine = lax.dynamic_slice_in_dim(jnp.pad(flat, (0, n * part - size)), index * part, part)
  return all_gather_invariant(mine, axis_name, tiled=True)[:size]


def check_two_level_sync(reduction: str, grad_sync) -> None:
  """``QsyncError`` when a plan whose ``reduction`` is ``"two_level"`` is given a gradient sync of
  its own (``grad_sync``: a ``SyncFn``, a ``GradSync`` or a strategy name; None: the default):
  the two-level sum replaces the default fp32 all-reduce, not another strategy."""
  if reduction != "two_level" or grad_sync is None:
    return
  name = grad_sync if isinstance(grad_sync, str) else getattr(grad_sync, "__name__", type(grad_sync).__name__)
  raise QsyncError(
    f"plan: reduction='two_level' with sync {name!r}: the two-level fp32 sum runs in place of the "
    "default fp32 all-reduce and cannot run another strategy's reduction. Fix: set the plan's reduction "
    "to 'flat' to use that sync, or leave the sync unset (no grad_sync, no --sync) for the two-level sum."
  )


def two_level_sync(group_sizes: Sequence[int], axis_name: str = AXIS, bucket_bytes: int | None = None):
  """The trainer's ``SyncFn`` (``(weighted_local_grads, state, key) -> (grads, state)``) of
  ``two_level_allreduce`` over groups of ``group_sizes`` devices (in device order), in buckets of
  ``bucket_bytes`` (default ``BUCKET_BYTES``). Its ``leaf_order`` is ``"backward"``: the trainer
  hands it the gradient leaves as a list in the order the backward pass produces them, so each
  bucket holds leaves the backward completes together."""
  sizes = check_group_sizes(group_sizes)
  bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
  check_bucket_bytes(bucket_bytes)

  def sync(weighted_local_grads, sync_state, key):
    del key
    return two_level_allreduce(weighted_local_grads, sizes, axis_name, bucket_bytes=bucket_bytes), sync_state

  sync.leaf_order = "backward"
  return sync
