"""VGG with BatchNorm (Simonyan & Zisserman, 2015), sized by its config.

The defaults are a tiny 3-stage network for 8×8 digits on a CPU; VGG-16-BN is
``VGG(stages=((64, 64), (128, 128), (256,) * 3, (512,) * 3, (512,) * 3), hidden=4096)``
(dropout left out: the classifier is deterministic). Pools use SAME padding, so any depth
works on small images. Module paths read ``conv1_0``, ``bn1_0``, ``fc1``, ``fc2``, ``head``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class VGG(nn.Module):
  """Image classifier: NHWC float images → logits (float32)."""

  stages: tuple[tuple[int, ...], ...] = ((16, 16), (32, 32), (64, 64))
  hidden: int = 64
  num_classes: int = 10
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, stage in enumerate(self.stages):
      for j, features in enumerate(stage):
        x = nn.Conv(features, (3, 3), padding="SAME", dtype=self.dtype, name=f"conv{i + 1}_{j}")(x)
        x = nn.BatchNorm(
          use_running_average=not train, momentum=0.9, dtype=self.dtype, name=f"bn{i + 1}_{j}"
        )(x)
        x = nn.relu(x)
      x = nn.max_pool(x, (2, 2), (2, 2), padding="SAME")
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, name="fc1")(x))
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, name="fc2")(x))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)
