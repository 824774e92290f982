"""The task's training loss under a precision policy.

One definition of "run the task's model under a policy and take the loss", used by the hybrid
trainer (``qsync_jax.train_step``), SelSync and QSDP (``qsync_jax.sync.task_loss_fn``), the
profiler's single-device step (``planners.timing``) and the sensitivity probes
(``planners.indicator.probes``). ``task_loss(task, policy, tap)`` returns
``loss_fn(variables, batch, key) -> (loss, metrics, updated)``, equivalent to::

  rngs = training_rngs(task, key)
  outputs, updated = quantize(task.model, policy, tap).apply(
      variables, *task.inputs(batch), **task.train_kwargs, mutable=list(task.mutable), rngs=rngs)
  loss, metrics = task.loss(outputs, batch)

``updated`` is ``{}`` for a task without mutable collections; ``policy=None`` runs the
unmodified model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from qsync_jax.flax_quant import quantize
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.quant_ops import RNG_COLLECTION, Tap
from qsync_jax.task import Task

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict, dict]]
"""``(variables, batch, key) -> (mean loss, metrics, updated mutable collections)``."""


def training_rngs(task: Task, key: jax.Array) -> dict[str, jax.Array]:
  """The RNG streams of one training step from one key: ``key`` split into the ``"qsync"``
  stream (stochastic rounding) and the task's ``rng_streams`` (dropout…), in that order."""
  names = (RNG_COLLECTION, *task.rng_streams)
  return dict(zip(names, jax.random.split(key, len(names))))


def task_loss(task: Task, policy: PrecisionPolicy | None = None, tap: Tap | None = None) -> LossFn:
  """``loss_fn(variables, batch, key)`` of ``task`` under ``policy`` (and ``tap``, which needs a
  policy); see the module docstring."""
  model = task.model if policy is None else quantize(task.model, policy, tap)
  mutable = list(task.mutable)

  def loss_fn(variables, batch, key):
    kwargs = dict(task.train_kwargs, rngs=training_rngs(task, key))
    if mutable:
      outputs, updated = model.apply(variables, *task.inputs(batch), mutable=mutable, **kwargs)
    else:
      outputs, updated = model.apply(variables, *task.inputs(batch), **kwargs), {}
    loss, metrics = task.loss(outputs, batch)
    return loss, metrics, updated

  return loss_fn
