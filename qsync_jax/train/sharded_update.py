"""The hybrid step's optimizer update sharded over the devices (ZeRO-1), and its global-norm clip.

With a plan's ``optimizer_update == "sharded"`` every param leaf is flattened and zero padded to
``N · m`` elements (N running devices, ``m = ⌈size / N⌉``: QSDP's ``even_layout``); device ``i``
owns elements ``[i·m, (i+1)·m)`` of every leaf. Per step (``ShardedUpdate``, inside ``shard_map``):
the weighted fp32 gradients are reduce-scattered (``lax.psum_scatter``, one per leaf) instead of
all-reduced, the device runs the optimizer on its elements of every leaf with its shard of the
optimizer state, and the updated shards are all-gathered into the replicated params. The result
equals the replicated update up to the fp32 summation order of the reduction, for an optimizer
whose update is elementwise (``check_sharded_optimizer`` refuses the others before anything
compiles); a global-norm clip is the step's own (``clip_by_global_norm``), whose norm is taken
over the whole gradient in both modes.

The optimizer state's sharded form is every leaf stacked on a leading axis of ``N``
(``shard_optimizer_state`` / ``gather_optimizer_state`` convert from and to the replicated form
that checkpoints hold).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from qsync_jax.sync.common import AXIS, all_gather_invariant, optimizer_init
from qsync_jax.sync.elementwise import check_elementwise_optimizer
from qsync_jax.sync.order import from_order, in_order
from qsync_jax.sync.qsdp import LeafLayout, even_layout


def _map_param_leaves(optimizer, f, opt_state, params, n: int, other):
  """``opt_state`` with ``f(leaf, layout)`` on every leaf that mirrors a param leaf (``mu``,
  ``nu``, momentum traces…: ``optax.tree_utils.tree_map_params``; ``layout``: that param's
  ``even_layout`` over ``n`` devices) and ``other(leaf)`` on the rest (step counts, injected
  hyperparameters)."""
  return optax.tree_utils.tree_map_params(
    functools.partial(optimizer_init, optimizer),
    f,
    opt_state,
    even_layout(params, n),
    transform_non_params=other,
  )


def shard_optimizer_state(optimizer: optax.GradientTransformation, opt_state, params, n: int):
  """The sharded form of ``optimizer``'s replicated state ``opt_state`` (of ``params``) over ``n``
  devices: every leaf stacked on a leading axis of ``n`` (row ``i``: device ``i``'s), equivalent to
  ``layout.padded(x, n).reshape(n, layout.shard)`` for a leaf that mirrors a param and
  ``jnp.broadcast_to(x, (n, *x.shape))`` for any other. ``gather_optimizer_state`` inverts it."""
  return _map_param_leaves(
    optimizer,
    lambda x, lay: lay.padded(x, n).reshape(n, lay.shard),
    opt_state,
    params,
    n,
    lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))),
  )


def gather_optimizer_state(optimizer: optax.GradientTransformation, sharded, params, n: int):
  """The replicated state from ``shard_optimizer_state``'s form: ``layout.unpadded(x.reshape(-1))``
  for a leaf that mirrors a param, row 0 for any other (every row holds the same)."""
  return _map_param_leaves(
    optimizer, lambda x, lay: lay.unpadded(x.reshape(-1)), sharded, params, n, lambda x: x[0]
  )


def check_sharded_optimizer(optimizer: optax.GradientTransformation, params, n: int) -> None:
  """``QsyncError`` unless ``optimizer``'s update on each device's flat shard of every leaf of
  ``params`` (``even_layout`` over ``n`` devices) equals its update on the whole tree
  (``qsync_jax.sync.elementwise``). Traces the update abstractly; runs nothing."""
  layouts = jax.tree.leaves(even_layout(params, n), is_leaf=lambda x: isinstance(x, LeafLayout))
  check_elementwise_optimizer(
    optimizer,
    params,
    [lay.shard for lay in layouts],
    where="optimizer_update='sharded'",
    fix="set the plan's optimizer_update to 'replicated'",
    step_clips=True,
  )


def clip_by_global_norm(grads, clip_norm: float, sharded: bool):
  """``(clipped grads, global norm)``: the global L2 norm of ``grads`` (with ``sharded``: of the
  whole gradient whose shards the devices hold, the ``psum`` of their sums of squares; padding is
  zero) and ``grads`` scaled by ``clip_norm / norm`` when the norm is not below ``clip_norm`` —
  ``optax.clip_by_global_norm(clip_norm)``'s arithmetic, on the whole gradient in both forms."""
  sum_of_squares = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
  if sharded:
    sum_of_squares = lax.psum(sum_of_squares, AXIS)
  norm = jnp.sqrt(sum_of_squares)
  below = norm < clip_norm
  return jax.tree.map(lambda g: jnp.where(below, g, (g / norm.astype(g.dtype)) * clip_norm), grads), norm


@dataclasses.dataclass(frozen=True)
class ShardedUpdate:
  """The sharded update's per-step pieces, inside ``shard_map`` over ``"data"``. ``layout``: the
  params' ``even_layout`` over ``n`` devices; ``order``: the backward order of the gradient leaves
  (the reduce-scatters are issued in it, as the all-reduce's buckets are), or None for tree order."""

  layout: Any
  n: int
  order: Sequence[int] | None = None

  def gradients(self, grads, sync_state, key):
    """``(this device's shard of the sum over "data" of every leaf of grads, sync_state)``: one
    ``psum_scatter`` per padded leaf."""
    del key

    def one(g, lay):
      return lax.psum_scatter(lay.padded(g, self.n), AXIS, tiled=True)

    if self.order is None:
      return jax.tree.map(one, grads, self.layout), sync_state
    pairs = zip(in_order(grads, self.order), in_order(self.layout, self.order))
    return from_order([one(g, lay) for g, lay in pairs], grads, self.order), sync_state

  def local(self, params, opt_state):
    """``(this device's shard of every param leaf, its row of the sharded optimizer state)``."""
    index = lax.axis_index(AXIS)
    shards = jax.tree.map(
      lambda p, lay: lax.dynamic_slice_in_dim(lay.padded(p, self.n), index * lay.shard, lay.shard),
      params,
      self.layout,
    )
    return shards, jax.tree.map(lambda x: x[0], opt_state)

  def whole(self, params, opt_state):
    """``(replicated params from every device's updated shards, the state's row stacked)``."""
    return self.whole_grads(params), jax.tree.map(lambda x: x[None], opt_state)

  def whole_grads(self, shards):
    """The replicated tree from every device's shards (an all-gather per leaf, unpadded)."""
    return jax.tree.map(lambda x, lay: lay.unpadded(all_gather_invariant(x, AXIS)), shards, self.layout)
