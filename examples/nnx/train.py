"""An nnx model trained by qsync's hybrid trainer: a small CNN on scikit-learn's digits.

``DigitsCNN`` is plain ``flax.nnx`` (Conv, BatchNorm, Dropout, Linear): a ``Task`` takes the
module itself, and the trainer, ``qsync_jax.quantize``, the profiler and the indicator run it
through ``qsync_jax.models.nnx_model.NnxModel``. Also usable from the command line::

  qsync train --model nnx_digits --steps 100 --out runs/nnx    # or examples.nnx.train:make_task

Examples:
  >>> from examples.nnx.train import Config, train_and_evaluate
  >>> result = train_and_evaluate(Config(steps=1), log=None)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import jax
import optax
from flax import nnx

from examples.data import batches, digits
from examples.tasks.config import make_config
from examples.tasks.vision import classification_loss, image_inputs
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.train.task import Task


class DigitsCNN(nnx.Module):
  """Two conv + BatchNorm stages, a dropout-regularised hidden layer, a linear classifier."""

  def __init__(self, *, width: int = 16, hidden: int = 64, dropout: float = 0.1, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
    self.norm1 = nnx.BatchNorm(width, rngs=rngs)
    self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=(2, 2), rngs=rngs)
    self.norm2 = nnx.BatchNorm(2 * width, rngs=rngs)
    self.hidden = nnx.Linear(4 * 4 * 2 * width, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(hidden, digits.NUM_CLASSES, rngs=rngs)

  def __call__(self, x, train: bool):
    x = nnx.relu(self.norm1(self.conv1(x), use_running_average=not train))
    x = nnx.relu(self.norm2(self.conv2(x), use_running_average=not train))
    x = nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))
    return self.head(self.dropout(x, deterministic=not train))


@dataclasses.dataclass(frozen=True)
class NnxDigitsConfig:
  """The model's sizes and the seed of its ``nnx.Rngs`` (parameters and dropout)."""

  seed: int = 0
  width: int = 16
  hidden: int = 64
  dropout: float = 0.1


def make_task(**overrides) -> Task:
  """The digits task with a ``DigitsCNN`` (overrides: the fields of ``NnxDigitsConfig``)."""
  cfg = make_config(NnxDigitsConfig, overrides, "nnx_digits")
  train, test = digits.load()
  rngs = nnx.Rngs(params=cfg.seed, dropout=cfg.seed + 1)
  return Task(
    name="nnx_digits",
    model=DigitsCNN(width=cfg.width, hidden=cfg.hidden, dropout=cfg.dropout, rngs=rngs),
    inputs=image_inputs,
    loss=classification_loss,
    train_batches=functools.partial(batches.train_batches, train),
    eval_batches=functools.partial(batches.eval_batches, test),
    train_kwargs={"train": True},
    eval_kwargs={"train": False},
    mutable=("batch_stats",),
    rng_streams=("dropout",),  # the trainer seeds the model's dropout stream afresh every step
  )


@dataclasses.dataclass(frozen=True)
class Config:
  """Defaults train on digits on a CPU in under a minute (held-out results: examples/README.md)."""

  steps: int = 200
  batch_per_device: int = 16
  devices: int | None = None  # default: every local device, one group
  learning_rate: float = 3e-3
  seed: int = 0
  policy: str | None = None  # a preset ("int8", "bf16"…) or a policy JSON file, for every device
  out: str | None = None  # run directory (metrics.jsonl, checkpoints/) or None
  log_every: int = 50


def train_and_evaluate(config: Config, log=print) -> dict[str, Any]:
  """Trains ``make_task(config.seed)`` with ``qsync_jax.Trainer``; returns metrics and params."""
  from examples.train_loop import load_policy
  from qsync_jax.train.trainer import Trainer

  task = make_task(seed=config.seed)
  devices = jax.devices()[: config.devices]
  device_type = "cpu" if jax.default_backend() == "cpu" else "H100"  # as qsync train without --cluster
  cluster = ClusterSpec.uniform(device_type, len(devices), config.batch_per_device)
  policy = load_policy(config.policy)
  plan = Plan(policies={"all": policy}) if policy is not None else Plan()
  trainer = Trainer(
    task,
    cluster,
    plan,
    optax.adam(config.learning_rate),
    seed=config.seed,
    devices=devices,
    out_dir=config.out,
    log_every=config.log_every,
    progress=sys.stderr if log is not None else None,
  )
  try:
    last = trainer.run(config.steps)
    held_out = trainer.evaluate()
  finally:
    trainer.close()
  if log is not None:
    log(f"held-out  loss {held_out['loss']:.4f}  accuracy {held_out['accuracy']:.4f}")
  return {"train": last, "eval": held_out, "params": trainer.params, "step": trainer.step}
