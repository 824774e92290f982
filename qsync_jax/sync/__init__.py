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
  ``make_qsdp_step(loss_fn, optimizer, params, mesh, ...)``, or by name
  ``make_step_strategy(name, loss_fn, optimizer, params, mesh, **options)``; each returns
  ``init(params) -> state``, ``step(state, batch, key) -> (state, metrics)`` and
  ``params_of(state)`` (the model's parameters). The trainer takes either kind by name
  (``Trainer(..., grad_sync="selsync")``, ``qsync train --sync selsync``).

A plan whose ``reduction`` is ``"two_level"`` makes the trainer sum the gradients with
``two_level_allreduce`` (inside each device group, then across groups, in buckets of leaves in
backward order) in place of the default fp32 all-reduce.

``Strategy.options`` lists the options a strategy takes by name (``--sync-option KEY=VALUE``);
their types are those its ``Strategy.declared`` function or dataclass annotates, and
``check_options`` refuses a value of another type (``delta="abc"``) before anything is built.

Every strategy's state is a pytree of arrays (orbax checkpoints it as is).
``planners.profiler.hlo`` counts the bytes each one really sends, in the compiled HLO.

Example::

  init, sync = make_grad_sync("global_qsgd", bucket_size=4096)
  state = init(params)
  # inside shard_map over "data":
  grads, state = sync(jax.tree.map(lambda g: share * g, local_grads), state, key)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from qsync_jax.errors import QsyncError
from qsync_jax.sync.allreduce import allreduce
from qsync_jax.sync.allreduce import check_options as check_allreduce
from qsync_jax.sync.common import AXIS
from qsync_jax.sync.global_qsgd import global_qsgd_allreduce
from qsync_jax.sync.options import check_option_types
from qsync_jax.sync.qsdp import QSDPTrainer, make_qsdp_step
from qsync_jax.sync.selsync import SelSyncConfig, SelSyncTrainer, make_selsync_step
from qsync_jax.sync.two_level import two_level_allreduce


class GradSync(NamedTuple):
  """``init(params) -> state`` and ``sync(weighted_local_grads, state, key) -> (grads, state)``.

  ``leaf_order`` (a class attribute, not a field): ``"tree"`` — ``sync`` takes the gradient
  tree; see ``LeafOrderFreeSync``."""

  init: Callable[[Any], Any]
  sync: Callable[[Any, Any, Any], tuple[Any, Any]]
  leaf_order = "tree"


class LeafOrderFreeSync(GradSync):
  """A ``GradSync`` whose ``sync`` treats the gradient as any pytree, so the trainer hands it the
  gradient leaves as a list in the order the backward pass produces them
  (``leaf_order = "backward"``, ``qsync_jax.sync.order``); every built-in one is."""

  __slots__ = ()
  leaf_order = "backward"


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A registered strategy: ``kind`` is "grad_sync" or "train_step"; ``build`` makes it.

  ``build(**options)`` for "grad_sync"; ``build(loss_fn, optimizer, params, mesh, **options)``
  for "train_step". ``options``: the option names it takes; ``declared``: the function whose
  keyword parameters, or the dataclass whose fields, they are (their annotations are the types
  ``check_options`` checks before building, their defaults the examples its errors give).
  """

  name: str
  kind: str
  description: str
  build: Callable[..., Any]
  options: tuple[str, ...] = ()
  declared: Callable[..., Any] | None = None


def _grad_sync_from(
  reduce_fn: Callable[..., Any], validate: Callable[..., None] | None = None
) -> Callable[..., GradSync]:
  """A builder of the ``GradSync`` of ``reduce_fn``; ``validate(**options)`` checks the options
  when it is built (before any step is traced)."""

  def build(*, axis_name: str = AXIS, **options) -> GradSync:
    if validate is not None:
      validate(**options)

    def init(params):
      del params
      return {"steps": jnp.zeros((), jnp.int32)}

    def sync(weighted_grads, state, key):
      combined = reduce_fn(weighted_grads, axis_name, key, **options)
      return combined, {"steps": state["steps"] + 1}

    return LeafOrderFreeSync(init, sync)

  return build


def _allreduce(dtype: str):
  def reduce_fn(tree, axis_name, key, **options):
    del key
    return allreduce(tree, axis_name, dtype=dtype, **options)

  return reduce_fn


def _selsync(loss_fn, optimizer, params, mesh, **options):
  """``make_selsync_step`` in the uniform train_step signature (SelSync needs no parameter layout)."""
  del params
  return make_selsync_step(loss_fn, optimizer, mesh, **options)


_ACCUMULATE = ("accumulate", "bucket_bytes")
STRATEGIES: dict[str, Strategy] = {
  "fp32": Strategy(
    "fp32",
    "grad_sync",
    "fp32 all-reduce (the default; bucket_bytes)",
    _grad_sync_from(_allreduce("fp32"), functools.partial(check_allreduce, "fp32")),
    ("bucket_bytes",),
    allreduce,
  ),
  "bf16": Strategy(
    "bf16",
    "grad_sync",
    "bf16 all-reduce (accumulate='payload'|'fp32', bucket_bytes)",
    _grad_sync_from(_allreduce("bf16"), functools.partial(check_allreduce, "bf16")),
    _ACCUMULATE,
    allreduce,
  ),
  "fp16": Strategy(
    "fp16",
    "grad_sync",
    "fp16 all-reduce (accumulate='payload'|'fp32', bucket_bytes)",
    _grad_sync_from(_allreduce("fp16"), functools.partial(check_allreduce, "fp16")),
    _ACCUMULATE,
    allreduce,
  ),
  "global_qsgd": Strategy(
    "global_qsgd",
    "grad_sync",
    "Global-QSGD: global pmax scale, unbiased integer all-reduce (payload, bucket_size)",
    _grad_sync_from(global_qsgd_allreduce),
    ("payload", "bucket_size", "rounding"),
    global_qsgd_allreduce,
  ),
  "selsync": Strategy(
    "selsync",
    "train_step",
    "SelSync: sync only when a gradient norm changes (delta, window, warmup, mode)",
    _selsync,
    tuple(f.name for f in dataclasses.fields(SelSyncConfig)),
    SelSyncConfig,
  ),
  "qsdp": Strategy(
    "qsdp",
    "train_step",
    "QSDP: sharded params, int8 all-gather and reduce-scatter (bucket_size, weight/grad_payload)",
    make_qsdp_step,
    ("bucket_size", "weight_payload", "grad_payload", "full_precision"),
    make_qsdp_step,
  ),
}


def get_strategy(name: str) -> Strategy:
  """The registered strategy called ``name`` (``QsyncError`` listing the choices otherwise)."""
  if name not in STRATEGIES:
    raise QsyncError(f"sync strategy {name!r} is unknown; choose one of {sorted(STRATEGIES)}.")
  return STRATEGIES[name]


def check_options(name: str, options) -> None:
  """``QsyncError`` naming any of ``options`` that strategy ``name`` does not take, or whose
  value is not of the type it declares (``Strategy.declared``): the option, the type and an
  example."""
  strategy = get_strategy(name)
  unknown = sorted(set(options) - set(strategy.options))
  if unknown:
    raise QsyncError(
      f"sync strategy {name!r} has no option {', '.join(map(repr, unknown))}; its options are "
      f"{list(strategy.options)}. Fix: drop it or use one of those (--sync-option KEY=VALUE)."
    )
  if strategy.declared is not None:
    check_option_types(name, strategy.declared, options)


def make_grad_sync(name: str, *, axis_name: str = AXIS, **options) -> GradSync:
  """``GradSync`` for a ``grad_sync`` strategy; ``options`` go to its reduce function."""
  strategy = get_strategy(name)
  if strategy.kind != "grad_sync":
    hooks = [k for k, s in STRATEGIES.items() if s.kind == "grad_sync"]
    raise QsyncError(
      f"sync strategy {name!r} changes how parameters are stored, so it is not a gradient hook of the "
      f"hybrid trainer. Fix: pick one of {hooks}, select it by name in the trainer "
      f"(Trainer(..., grad_sync={name!r}), qsync train --sync {name}), which builds its own step, or "
      f"build that step yourself with qsync_jax.sync.make_{name}_step(...)."
    )
  check_options(name, options)
  return strategy.build(axis_name=axis_name, **options)


def make_step_strategy(name: str, loss_fn, optimizer, params, mesh=None, **options):
  """The trainer (``init``, ``step``, ``params_of``) of the ``train_step`` strategy ``name``.

  ``params``: the parameters (or their shapes, e.g. from ``jax.eval_shape``); ``options``: the
  strategy's ``options`` plus ``shares`` (per-device batch shares) and ``axis_name``.
  """
  strategy = get_strategy(name)
  if strategy.kind != "train_step":
    raise QsyncError(
      f"sync strategy {name!r} is a gradient hook, not a step builder. Fix: use make_grad_sync({name!r})."
    )
  check_options(name, {k: v for k, v in options.items() if k not in ("shares", "axis_name")})
  return strategy.build(loss_fn, optimizer, params, mesh, **options)


__all__ = [
  "GradSync",
  "LeafOrderFreeSync",
  "QSDPTrainer",
  "STRATEGIES",
  "SelSyncConfig",
  "SelSyncTrainer",
  "Strategy",
  "allreduce",
  "check_options",
  "get_strategy",
  "global_qsgd_allreduce",
  "make_grad_sync",
  "make_qsdp_step",
  "make_selsync_step",
  "make_step_strategy",
  "two_level_allreduce",
]
