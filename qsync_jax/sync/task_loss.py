"""A ``Task`` as the ``loss_fn(params, batch, key) -> scalar`` that SelSync and QSDP train.

SelSync and QSDP build their own steps (they store parameters per device or sharded), so they
take a plain loss function of the parameters. ``task_loss_fn(task, policy)`` makes one from a
``Task``, optionally running the model under a precision policy (``qsync_jax.quantize``; the
step key feeds its ``"qsync"`` RNG stream and the task's other streams). Tasks with mutable
collections (BatchNorm statistics) are not supported by these two strategies.
"""

from __future__ import annotations

import jax

from qsync_jax.errors import QsyncError
from qsync_jax.flax_quant import quantize
from qsync_jax.task import Task


def task_loss_fn(task: Task, policy=None):
  """``loss_fn(params, batch, key)``: ``task.loss`` of the model's training-mode output."""
  if task.mutable:
    raise QsyncError(
      f"task {task.name!r} updates the collections {list(task.mutable)} in training (e.g. BatchNorm), "
      "which SelSync and QSDP do not carry. Fix: use a model without them (e.g. GroupNorm/LayerNorm), "
      "or a gradient-hook strategy (fp32, bf16, fp16, global_qsgd)."
    )
  model = quantize(task.model, policy) if policy is not None else task.model
  streams = ("qsync", *task.rng_streams)

  def loss_fn(params, batch, key):
    rngs = dict(zip(streams, jax.random.split(key, len(streams))))
    outputs = model.apply({"params": params}, *task.inputs(batch), **task.train_kwargs, rngs=rngs)
    return task.loss(outputs, batch)[0]

  return loss_fn
