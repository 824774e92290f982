"""Small helpers the sync strategies share: VMA casts, keys, batch shares.

Every strategy runs inside ``shard_map`` over one mesh axis (``"data"`` by default) with
``check_vma`` on, so values are typed *varying* (differ per device) or *invariant* (the
same everywhere); these helpers move between the two without changing any value.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qsync_jax.errors import QsyncError
from qsync_jax.ops.vma import pvary, vma

AXIS = "data"

STEP_COMPILER_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}
"""XLA options a data-parallel training step is compiled with (``jax.jit(...,
compiler_options=...)``): up to 4 asynchronous collectives in flight at once. With XLA's default
of one, its scheduler overlaps a single gradient all-reduce with the backward pass and queues the
other buckets' all-reduces after the backward's last kernel, exposed."""


def to_varying(tree, axis_name: str = AXIS):
  """Marks every leaf varying over ``axis_name`` (a no-op on leaves that already are)."""
  return jax.tree.map(lambda x: pvary(x, (axis_name,)), tree)


def all_gather_invariant(x, axis_name: str = AXIS, *, tiled: bool = True):
  """``all_gather`` whose result is typed invariant (it is the same on every device).

  Where ``lax.all_gather`` has no ``to="invarying"`` (other jax versions), falls back to a
  ``psum`` of zero buffers each holding one device's block: the same values, typed invariant,
  at twice an all-gather's traffic. Where ``x`` is not typed varying over ``axis_name`` (under
  ``jax.vmap(..., axis_name=...)``, or ``shard_map`` with ``check_vma`` off) there is no typing
  to keep: a plain ``all_gather``.
  """
  if axis_name not in vma(x):
    return lax.all_gather(x, axis_name, tiled=tiled)
  try:
    return lax.all_gather(x, axis_name, tiled=tiled, to="invarying")
  except (TypeError, ValueError):
    n = axis_size(axis_name)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[lax.axis_index(axis_name)].set(x)
    out = lax.psum(blocks, axis_name)
    return out.reshape((n * x.shape[0], *x.shape[1:])) if tiled else out


def axis_size(axis_name: str = AXIS) -> int:
  """Number of devices along ``axis_name`` (a Python int, known at trace time)."""
  return lax.axis_size(axis_name) if hasattr(lax, "axis_size") else lax.psum(1, axis_name)


def device_key(key: jax.Array, axis_name: str = AXIS) -> jax.Array:
  """A PRNG key distinct on every device: ``key`` folded with the device's axis index."""
  return jax.random.fold_in(key, lax.axis_index(axis_name))


def leaf_keys(key: jax.Array, tree) -> list:
  """One key per leaf of ``tree`` (in ``jax.tree.leaves`` order)."""
  n = len(jax.tree.leaves(tree))
  return list(jax.random.split(key, n)) if n else []


def is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def optimizer_init(optimizer, params):
  """``optimizer.init(params)`` under standard dtype promotion (optax mixes Python floats and ints)."""
  with jax.numpy_dtype_promotion("standard"):
    return optimizer.init(params)


def batch_shares(n: int, shares: Sequence[float] | None) -> np.ndarray:
  """Per-device shares of the global batch as float32 ``(n,)`` (default: equal), validated."""
  if shares is None:
    return np.full((n,), 1.0 / n, np.float32)
  s = np.asarray(shares, np.float32)
  if s.shape != (n,) or np.any(s < 0) or not np.isclose(s.sum(), 1.0, atol=1e-5):
    raise QsyncError(f"shares={list(shares)!r} must be {n} non-negative batch shares summing to 1.")
  return s
