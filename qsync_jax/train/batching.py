"""Dynamic batch sizing: cut a global batch into per-device shards of unequal size.

Device ``i`` of the job processes ``sizes[i]`` examples; the global batch is cut in device
order. Shards travel as one array of ``len(sizes) * max(sizes)`` rows sharded over the
``data`` axis, each device's rows padded to ``max(sizes)`` with zeros. The trainer's branch
for a device's group knows its batch size statically and slices the padding away before the
model sees it, so padding never enters a loss, a gradient or BatchNorm statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qsync_jax.errors import BatchError


def batch_size(batch: Any) -> int:
  """The common leading dimension of a batch's leaves."""
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
  if len(sizes) != 1:
    raise ValueError(f"batch leaves have different leading sizes {sorted(sizes)}; they must share one.")
  return sizes.pop()


def check_batch(batch: Any, sizes: Sequence[int], source: str = "the task") -> None:
  """Raises ``BatchError`` unless ``batch`` has ``sum(sizes)`` examples (``sizes``: per device)."""
  got = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
  if len(got) != 1:
    raise BatchError(
      f"{source} gave a batch whose leaves have different leading sizes {sorted(got)}. "
      "Fix: make every leaf of a batch share its leading (example) axis."
    )
  if got != {sum(sizes)}:
    raise BatchError(
      f"{source} gave a batch of {got.pop()} examples but the cluster's global batch is {sum(sizes)} "
      f"({list(sizes)} per device over its {len(sizes)} devices). Fix: make train_batches(global_batch, seed) yield "
      "exactly global_batch examples, or set the cluster's batch_per_device so they add up to its batches."
    )


def pad_shards(batch: Any, sizes: Sequence[int]) -> Any:
  """Host-side: the global batch (sum(sizes) rows) → (len(sizes) * max(sizes)) rows, padded per device."""
  width = max(sizes)
  check_batch(batch, sizes)
  if len(set(sizes)) == 1:  # equal shards: the batch already has the padded layout
    return batch
  offsets = np.cumsum([0, *sizes])

  def pad(x):
    x = np.asarray(x)
    out = np.zeros((len(sizes) * width, *x.shape[1:]), x.dtype)
    for i, b in enumerate(sizes):
      out[i * width : i * width + b] = x[offsets[i] : offsets[i] + b]
    return out

  return jax.tree.map(pad, batch)


def unpad_shards(padded: Any, sizes: Sequence[int]) -> Any:
  """Inverse of ``pad_shards`` (host-side; for tests and debugging)."""
  width = max(sizes)
  return jax.tree.map(
    lambda x: np.concatenate([np.asarray(x)[i * width : i * width + b] for i, b in enumerate(sizes)]), padded
  )


def put_sharded(padded: Any, mesh: Mesh, axis_name: str = "data") -> Any:
  """Global arrays sharded over ``axis_name`` from a host batch every process holds in full.

  Works across processes: each one places only the shards of its own devices.
  """
  sharding = NamedSharding(mesh, PartitionSpec(axis_name))

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(put, padded)


def put_replicated(tree: Any, mesh: Mesh) -> Any:
  """Global arrays replicated over ``mesh`` from host values every process holds."""
  sharding = NamedSharding(mesh, PartitionSpec())

  def put(x):
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(put, tree)
