"""The task's training loss under a precision policy.

One definition of "run the task's model under a policy and take the loss", used by the hybrid
trainer (``qsync_jax.train.train_step``), SelSync and QSDP (``params_only=True``), the
profiler's single-device step (``planners.profiler.timing``) and the sensitivity probes
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

from qsync_jax.errors import QsyncError
from qsync_jax.models.flax_quant import quantize
from qsync_jax.ops.quant_ops import RNG_COLLECTION, Tap
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train.task import Task

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict, dict]]
"""``(variables, batch, key) -> (mean loss, metrics, updated mutable collections)``."""


def training_rngs(task: Task, key: jax.Array) -> dict[str, jax.Array]:
  """The RNG streams of one training step from one key: ``key`` split into the ``"qsync"``
  stream (stochastic rounding) and the task's ``rng_streams`` (dropout…), in that order."""
  names = (RNG_COLLECTION, *task.rng_streams)
  return dict(zip(names, jax.random.split(key, len(names))))


def task_loss(
  task: Task, policy: PrecisionPolicy | None = None, tap: Tap | None = None, *, params_only: bool = False
) -> LossFn | Callable[[Any, Any, jax.Array], jax.Array]:
  """``loss_fn(variables, batch, key)`` of ``task`` under ``policy`` (and ``tap``, which needs a
  policy); see the module docstring. ``params_only=True``: ``loss_fn(params, batch, key) -> loss``,
  the same loss of ``{"params": params}`` (a task with mutable collections is refused: SelSync and
  QSDP, which take this form, do not carry them)."""
  if params_only and task.mutable:
    raise QsyncError(
      f"task {task.name!r} updates the collections {list(task.mutable)} in training (e.g. BatchNorm), "
      "which SelSync and QSDP do not carry. Fix: use a model without them (e.g. GroupNorm/LayerNorm), "
      "or a gradient-hook strategy (fp32, bf16, fp16, global_qsgd)."
    )
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

  if params_only:
    return lambda params, batch, key: loss_fn({"params": params}, batch, key)[0]
  return loss_fn
