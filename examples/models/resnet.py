"""ResNet with BatchNorm (He et al., 2016), sized by its config.

The defaults are a tiny 3-stage network of basic blocks for 8×8 digits on a CPU; ResNet-18 is
``ResNet(stage_sizes=(2, 2, 2, 2), widths=(64, 128, 256, 512), imagenet_stem=True)`` and
ResNet-50 the same widths with ``stage_sizes=(3, 4, 6, 3), block="bottleneck"``.
Module paths read ``stem``, ``stage1_block0/conv1``, ``stage1_block0/proj``, ``head``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class BasicBlock(nn.Module):
  """Two 3×3 convs with BatchNorm and a residual (a 1×1 projection when the shape changes)."""

  features: int
  strides: int = 1
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda name, **kw: nn.BatchNorm(  # noqa: E731
      use_running_average=not train, momentum=0.9, dtype=self.dtype, name=name, **kw
    )
    y = nn.Conv(
      self.features, (3, 3), self.strides, padding="SAME", use_bias=False, dtype=self.dtype, name="conv1"
    )(x)
    y = nn.relu(norm("bn1")(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False, dtype=self.dtype, name="conv2")(y)
    y = norm("bn2", scale_init=nn.initializers.zeros)(y)
    if x.shape != y.shape:
      x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False, dtype=self.dtype, name="proj")(x)
      x = norm("proj_bn")(x)
    return nn.relu(x + y)


class BottleneckBlock(nn.Module):
  """1×1 reduce, 3×3 (strided), 1×1 expand to ``4 · features``, with BatchNorm and a residual
  (a 1×1 projection when the shape changes)."""

  features: int
  strides: int = 1
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda name, **kw: nn.BatchNorm(  # noqa: E731
      use_running_average=not train, momentum=0.9, dtype=self.dtype, name=name, **kw
    )
    conv = lambda features, kernel, strides, name: nn.Conv(  # noqa: E731
      features, kernel, strides, padding="SAME", use_bias=False, dtype=self.dtype, name=name
    )
    y = nn.relu(norm("bn1")(conv(self.features, (1, 1), 1, "conv1")(x)))
    y = nn.relu(norm("bn2")(conv(self.features, (3, 3), self.strides, "conv2")(y)))
    y = norm("bn3", scale_init=nn.initializers.zeros)(conv(4 * self.features, (1, 1), 1, "conv3")(y))
    if x.shape != y.shape:
      x = norm("proj_bn")(conv(4 * self.features, (1, 1), self.strides, "proj")(x))
    return nn.relu(x + y)


BLOCKS = {"basic": BasicBlock, "bottleneck": BottleneckBlock}


class ResNet(nn.Module):
  """Image classifier: NHWC float images → logits (float32)."""

  stage_sizes: tuple[int, ...] = (1, 1, 1)
  widths: tuple[int, ...] = (16, 32, 64)
  num_classes: int = 10
  imagenet_stem: bool = False  # 7×7/2 conv + 3×3/2 max-pool (for 224×224 inputs)
  block: str = "basic"  # "basic" (ResNet-18/34) or "bottleneck" (ResNet-50 and deeper)
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    if len(self.stage_sizes) != len(self.widths):
      raise ValueError(
        f"ResNet: stage_sizes={self.stage_sizes} and widths={self.widths} must have the same length. "
        "Fix: give one width per stage."
      )
    if self.block not in BLOCKS:
      raise ValueError(f"ResNet: block={self.block!r} is not one of {sorted(BLOCKS)}. Fix: use one of them.")
    stem_kernel, stem_stride = ((7, 7), 2) if self.imagenet_stem else ((3, 3), 1)
    x = nn.Conv(
      self.widths[0], stem_kernel, stem_stride, padding="SAME", use_bias=False, dtype=self.dtype, name="stem"
    )(x)
    x = nn.relu(
      nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype, name="stem_bn")(x)
    )
    if self.imagenet_stem:
      x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for i, (blocks, width) in enumerate(zip(self.stage_sizes, self.widths)):
      for j in range(blocks):
        strides = 2 if (i > 0 and j == 0) else 1
        x = BLOCKS[self.block](width, strides, self.dtype, name=f"stage{i + 1}_block{j}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)
