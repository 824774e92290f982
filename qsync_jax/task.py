"""A training task: the model, how to call it, its loss and its data.

The trainer, the planner and the examples all speak this one small interface, so a user's
own Flax model plugs in by writing one ``Task`` (``qsync train --model pkg.module:make_task``).

Batches are pytrees of numpy / jax arrays whose leaves share a leading batch axis.
The model is called as::

    outputs = model.apply(variables, *task.inputs(batch), **task.train_kwargs,
                          mutable=task.mutable, rngs=...)          # training
    outputs = model.apply(variables, *task.inputs(batch), **task.eval_kwargs)  # evaluation

and ``task.loss(outputs, batch)`` returns ``(scalar mean loss, {metric name: scalar})``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn

Batch = Any


@dataclasses.dataclass(frozen=True)
class Task:
  """Everything needed to train and evaluate one model.

  Attributes:
    name: short name (used in logs and checkpoints).
    model: the unmodified ``flax.linen`` model, or a ``flax.nnx`` module (held as an
      ``NnxModel``, which gives it the same ``init`` / ``apply``; see ``qsync_jax.nnx_model``).
    inputs: batch → positional arguments of ``model.apply`` after the variables.
    loss: (model outputs, batch) → (scalar mean loss over the batch, metrics dict).
    train_batches: (global batch size, seed) → iterator over training batches, forever.
    eval_batches: (batch size) → iterator over the held-out set (finite), or None.
    train_kwargs / eval_kwargs: extra keyword arguments of ``model.apply``
      (e.g. ``{"train": True}`` for BatchNorm / dropout).
    mutable: collections updated in training (e.g. ``("batch_stats",)``).
    rng_streams: RNG streams the model needs in training besides ``"qsync"`` (e.g. dropout).
  """

  name: str
  model: nn.Module
  inputs: Callable[[Batch], tuple]
  loss: Callable[[Any, Batch], tuple[Any, Mapping[str, Any]]]
  train_batches: Callable[[int, int], Iterator[Batch]]
  eval_batches: Callable[[int], Iterator[Batch]] | None = None
  train_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  mutable: tuple[str, ...] = ()
  rng_streams: tuple[str, ...] = ()

  def __post_init__(self):
    from qsync_jax.nnx_model import as_functional  # flax.nnx loads on first use

    object.__setattr__(self, "model", as_functional(self.model))
