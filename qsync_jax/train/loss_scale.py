"""Dynamic loss scaling for plans with fp16 legs.

An fp16 backward leg casts the cotangent dY to fp16, whose smallest normal is 6e-5: small
gradients underflow to zero. Scaling the loss by ``scale`` scales every cotangent by it;
the trainer divides the gradients by ``scale`` again (in fp32) before the optimizer.
If any combined gradient is not finite the step is skipped (parameters, optimizer state
and model state keep their old values) and the scale is halved; after ``growth_interval``
finite steps in a row the scale doubles.

Examples:
  >>> ls = DynamicLossScale(init_scale=8.0, growth_interval=2)
  >>> s = ls.init()
  >>> s = ls.update(s, jnp.bool_(False)); float(s.scale)
  4.0
  >>> s = ls.update(ls.update(s, jnp.bool_(True)), jnp.bool_(True)); float(s.scale)
  8.0
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
  """``scale`` (fp32 scalar) and the number of finite steps since it last changed."""

  scale: jax.Array
  good_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Halve on overflow, double after ``growth_interval`` good steps; kept in [min_scale, max_scale]."""

  init_scale: float = 2.0**15
  growth_interval: int = 2000
  factor: float = 2.0
  min_scale: float = 1.0
  max_scale: float = 2.0**24

  enabled = True

  def init(self) -> LossScaleState:
    return LossScaleState(jnp.float32(self.init_scale), jnp.int32(0))

  def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
    grown = state.good_steps + 1 >= self.growth_interval
    up = jnp.minimum(state.scale * jnp.float32(self.factor), jnp.float32(self.max_scale))
    down = jnp.maximum(state.scale / jnp.float32(self.factor), jnp.float32(self.min_scale))
    scale = jnp.where(finite, jnp.where(grown, up, state.scale), down)
    good = jnp.where(finite & ~grown, state.good_steps + 1, jnp.int32(0))
    return LossScaleState(scale, good)


@dataclasses.dataclass(frozen=True)
class NoLossScale:
  """Scale 1, never skips: for plans without fp16 legs."""

  enabled = False

  def init(self) -> LossScaleState:
    return LossScaleState(jnp.float32(1.0), jnp.int32(0))

  def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
    del finite
    return state
