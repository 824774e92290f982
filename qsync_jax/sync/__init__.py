"""Gradient-sync strategies: how data-parallel devices combine their work each step.

Two kinds, one registry (``STRATEGIES``, ``get_strategy(name)``):

* ``grad_sync`` strategies (fp32 / bf16 / fp16 all-reduce, Global-QSGD) plug into the
  trainer's ``GradSync`` hook: ``make_grad_sync(name, **options)`` returns
  ``GradSync(init, sync)`` with ``init(params) -> state`` and
  ``sync(weighted_local_grads, state, key) -> (combined_grads, state)``, called inside
  ``shard_map`` over the ``"data"`` axis with each device's gradient already multiplied by its
  share of the global batch (so fp32 is ``lax.psum``).
* ``train_step`` strategies (SelSync, QSDP) change what each device stores (per-device or
  sharded parameters and optimizer state), so they build their own step:
  ``make_selsync_step(loss_fn, optimizer, mesh, ...)``,
  ``make_qsdp_step(loss_fn, optimizer, params, mesh, ...)``.

Every strategy's state is a pytree of arrays (orbax checkpoints it as is).
``qsync_jax.sync.hlo`` counts the bytes each one really sends, in the compiled HLO.

Example::

  init, sync = make_grad_sync("global_qsgd", bucket_size=4096)
  state = init(params)
  # inside shard_map over "data":
  grads, state = sync(jax.tree.map(lambda g: share * g, local_grads), state, key)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from qsync_jax.errors import QsyncError
from qsync_jax.sync.allreduce import allreduce
from qsync_jax.sync.common import AXIS
from qsync_jax.sync.global_qsgd import global_qsgd_allreduce
from qsync_jax.sync.qsdp import QSDPTrainer, make_qsdp_step
from qsync_jax.sync.selsync import SelSyncConfig, SelSyncTrainer, make_selsync_step
from qsync_jax.sync.task_loss import task_loss_fn


class GradSync(NamedTuple):
  """``init(params) -> state`` and ``sync(weighted_local_grads, state, key) -> (grads, state)``."""

  init: Callable[[Any], Any]
  sync: Callable[[Any, Any, Any], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A registered strategy: ``kind`` is "grad_sync" or "train_step"; ``build`` makes it."""

  name: str
  kind: str
  description: str
  build: Callable[..., Any]


def _grad_sync_from(reduce_fn: Callable[..., Any]) -> Callable[..., GradSync]:
  def build(*, axis_name: str = AXIS, **options) -> GradSync:
    def init(params):
      del params
      return {"steps": jnp.zeros((), jnp.int32)}

    def sync(weighted_grads, state, key):
      combined = reduce_fn(weighted_grads, axis_name, key, **options)
      return combined, {"steps": state["steps"] + 1}

    return GradSync(init, sync)

  return build


def _allreduce(dtype: str):
  def reduce_fn(tree, axis_name, key, **options):
    del key
    return allreduce(tree, axis_name, dtype=dtype, **options)

  return reduce_fn


STRATEGIES: dict[str, Strategy] = {
  "fp32": Strategy("fp32", "grad_sync", "fp32 all-reduce (the default)", _grad_sync_from(_allreduce("fp32"))),
  "bf16": Strategy(
    "bf16", "grad_sync", "bf16 all-reduce (accumulate='payload'|'fp32')", _grad_sync_from(_allreduce("bf16"))
  ),
  "fp16": Strategy(
    "fp16", "grad_sync", "fp16 all-reduce (accumulate='payload'|'fp32')", _grad_sync_from(_allreduce("fp16"))
  ),
  "global_qsgd": Strategy(
    "global_qsgd",
    "grad_sync",
    "Global-QSGD: global pmax scale, unbiased integer all-reduce (payload, bucket_size)",
    _grad_sync_from(global_qsgd_allreduce),
  ),
  "selsync": Strategy(
    "selsync",
    "train_step",
    "SelSync: sync only when a gradient norm changes (delta, window)",
    make_selsync_step,
  ),
  "qsdp": Strategy(
    "qsdp", "train_step", "QSDP: sharded params, int8 all-gather and reduce-scatter", make_qsdp_step
  ),
}


def get_strategy(name: str) -> Strategy:
  """The registered strategy called ``name`` (``QsyncError`` listing the choices otherwise)."""
  if name not in STRATEGIES:
    raise QsyncError(f"sync strategy {name!r} is unknown; choose one of {sorted(STRATEGIES)}.")
  return STRATEGIES[name]


def make_grad_sync(name: str, **options) -> GradSync:
  """``GradSync`` for a ``grad_sync`` strategy; ``options`` go to its reduce function."""
  strategy = get_strategy(name)
  if strategy.kind != "grad_sync":
    hooks = [k for k, s in STRATEGIES.items() if s.kind == "grad_sync"]
    raise QsyncError(
      f"sync strategy {name!r} changes how parameters are stored, so it is not a gradient hook of the "
      f"hybrid trainer. Fix: pick one of {hooks}, or build its own step with "
      f"qsync_jax.sync.{strategy.build.__name__}(...)."
    )
  return strategy.build(**options)


__all__ = [
  "GradSync",
  "QSDPTrainer",
  "STRATEGIES",
  "SelSyncConfig",
  "SelSyncTrainer",
  "Strategy",
  "allreduce",
  "get_strategy",
  "global_qsgd_allreduce",
  "make_grad_sync",
  "make_qsdp_step",
  "make_selsync_step",
  "task_loss_fn",
]
