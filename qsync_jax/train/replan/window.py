"""Timing the training step for re-planning: wall times between step completions
(``StepTimer``) gathered into windows whose median every process agrees on (``StepWindows``).

No host sync is added to the step: ``StepTimer.after(metrics)`` waits for the previous step's
metrics while the device has the step just dispatched queued.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np


class StepTimer:
  """Step times without a host sync of the step just dispatched: ``after(metrics)`` waits for
  the previous step's metrics (the device has this step queued meanwhile) and returns the
  wall time between the previous two completions (None until there are two)."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self._previous, self._done = None, None

  def after(self, metrics) -> float | None:
    if self._previous is None:
      self._previous = metrics
      return None
    jax.block_until_ready(self._previous)
    now = time.perf_counter()
    ms = None if self._done is None else 1e3 * (now - self._done)
    self._previous, self._done = metrics, now
    return ms


class StepWindows:
  """Step times in windows of ``size`` steps: ``add(ms)`` returns the window's median (process
  0's, on every process) when the step completes a window, else None. ``count``: windows
  completed, ``since_ms``: the time of the steps added, both since the last ``reset``."""

  def __init__(self, size: int):
    self.size = size
    self.reset()

  def reset(self) -> None:
    self._times: list[float] = []
    self.count, self.since_ms = 0, 0.0

  def add(self, ms: float) -> float | None:
    """Every process must call it at every timed step (a window's end is a collective)."""
    self._times.append(ms)
    self.since_ms += ms
    if len(self._times) < self.size:
      return None
    median, self._times = process_zero_value(statistics.median(self._times)), []
    self.count += 1
    return median


def process_zero_value(x: float) -> float:
  """``x`` as process 0 has it, on every process (every process must call it)."""
  if jax.process_count() == 1:
    return x
  from jax.experimental import multihost_utils

  return float(multihost_utils.broadcast_one_to_all(np.asarray([x], np.float32))[0])


def any_process(flag: bool) -> bool:
  """Whether ``flag`` is true on any process of the job (every process must call it)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))
