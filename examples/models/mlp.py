"""A multilayer perceptron on flattened images: the smallest example model."""

from __future__ import annotations

import flax.linen as nn


class MLP(nn.Module):
  """``Dense`` + ReLU per width of ``hidden`` (``fc1``, ``fc2``, …), then the ``head``."""

  hidden: tuple[int, ...] = (64,)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    for i, width in enumerate(self.hidden):
      x = nn.relu(nn.Dense(width, name=f"fc{i + 1}")(x))
    return nn.Dense(self.num_classes, name="head")(x)
