"""A ``Task`` as the ``loss_fn(params, batch, key) -> scalar`` that SelSync and QSDP train.

SelSync and QSDP build their own steps (they store parameters per device or sharded), so they
take a plain loss function of the parameters: the task's loss under a precision policy
(``qsync_jax.task_step.task_loss``). Tasks with mutable collections (BatchNorm statistics) are
not supported by these two strategies.
"""

from __future__ import annotations

from qsync_jax.errors import QsyncError
from qsync_jax.task import Task
from qsync_jax.task_step import task_loss


def task_loss_fn(task: Task, policy=None):
  """``loss_fn(params, batch, key)``: ``task.loss`` of the model's training-mode output under
  ``policy`` (None: the unmodified model)."""
  if task.mutable:
    raise QsyncError(
      f"task {task.name!r} updates the collections {list(task.mutable)} in training (e.g. BatchNorm), "
      "which SelSync and QSDP do not carry. Fix: use a model without them (e.g. GroupNorm/LayerNorm), "
      "or a gradient-hook strategy (fp32, bf16, fp16, global_qsgd)."
    )
  loss = task_loss(task, policy)

  def loss_fn(params, batch, key):
    return loss({"params": params}, batch, key)[0]

  return loss_fn
