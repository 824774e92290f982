"""Trains an image classifier (ResNet / VGG on digits, CIFAR-10), a task found by name (``qsync_jax.train.task``).

Examples:
  >>> from examples.vision.train import Config, train_and_evaluate
  >>> result = train_and_evaluate(Config(model="vgg", steps=1), log=None)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

from examples import train_loop
from qsync_jax.train.task import get_task


@dataclasses.dataclass(frozen=True)
class Config(train_loop.LoopConfig):
  """Defaults train on digits in 300 steps on a CPU (held-out results: examples/README.md)."""

  model: str = "resnet"  # "resnet" | "vgg" | "resnet_cifar10"
  data_dir: str | None = None  # CIFAR-10 python batches (resnet_cifar10 only)
  steps: int = 300
  batch_size: int = 64
  learning_rate: float = 3e-3


def train_and_evaluate(config: Config, log=print, **task_overrides) -> dict[str, Any]:
  if config.model == "resnet_cifar10":
    task_overrides = {"data_dir": config.data_dir, **task_overrides}
  task = get_task(config.model, **task_overrides)
  loop_fields = {f.name for f in dataclasses.fields(train_loop.LoopConfig)}
  loop_config = train_loop.LoopConfig(
    **{k: v for k, v in dataclasses.asdict(config).items() if k in loop_fields}
  )
  return train_loop.train_and_evaluate(task, loop_config, log)
