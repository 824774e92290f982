"""A run's live throughput, as ``Trainer.run`` prints and logs it.

* **Rate** (``Throughput``): steps per second over the last ``window_steps`` steps of training,
  from the wall time between observed step completions (a step's metrics read one step late,
  while the next step runs). Pauses are left out: from a hook that stops training (re-planning's
  measurements, a checkpoint, an evaluation) until the next step's batch is ready, nothing counts;
  nor does a step that compiles its program (a run's first step, the first step of a re-planned
  split). samples/s = rate × global batch; tokens/s =
  samples/s × the task's ``tokens_per_example`` (when it has one); the ETA is the steps left over
  that rate.
* **TFLOP/s per device** (``step_flops``): the floating-point operations of the matrix products
  (``dot_general``) and convolutions in the step's jaxpr — the model FLOPs of the step as traced,
  whatever the backend: one device's share under ``shard_map``; of a hybrid step, its costliest
  branch, scaled to the mean per-device batch; a scan's body times its length — times the rate.
  Elementwise work counts nothing, nor does a product inside a Pallas kernel or a fused attention.
* **MFU**: that rate over the dense 16-bit peak (bf16, else fp16) of the devices' type in
  ``qsync_jax.devices.DEVICES`` (its ``cpu`` entry is an order of magnitude only).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

RATE_WINDOW_STEPS = 20


def _now() -> float:
  return time.perf_counter()


class Throughput:
  """Steps per second over the last ``window_steps`` steps of uninterrupted training.

  ``mark(step)``: ``step`` has finished, observed now, one step late (the next step dispatched).
  ``stop()``: a pause begins; nothing counts until training restarts. ``restart(step)``: training
  restarts after ``step``, which has finished, once the next step's batch is ready
  (``batch_ready()``, called by the loop before each step): the time before does not count."""

  def __init__(self, window_steps: int = RATE_WINDOW_STEPS, clock=None):
    self.window_steps, self.clock = window_steps, clock or _now
    self._intervals: collections.deque[tuple[int, float]] = collections.deque()  # (steps, seconds)
    self._at: tuple[int, float] | None = None  # (step, time) the running segment reached
    self._restart: int | None = None

  def restart(self, step: int) -> None:
    self._at, self._restart = None, step

  def batch_ready(self) -> None:
    if self._restart is not None:
      self._at, self._restart = (self._restart, self.clock()), None

  def stop(self) -> None:
    self._at, self._restart = None, None

  def mark(self, step: int) -> None:
    if self._at is None or step <= self._at[0]:
      return
    now = self.clock()
    self._intervals.append((step - self._at[0], now - self._at[1]))
    self._at = (step, now)
    total = sum(n for n, _ in self._intervals)
    while len(self._intervals) > 1 and total - self._intervals[0][0] >= self.window_steps:
      total -= self._intervals.popleft()[0]

  def steps_per_s(self) -> float | None:
    """None until a step after a (re)start has been marked."""
    seconds = sum(s for _, s in self._intervals)
    return sum(n for n, _ in self._intervals) / seconds if seconds > 0 else None


def step_flops(program, state, batch) -> float | None:
  """FLOPs of one step of ``program`` per device, as the module docstring says; None where the
  step has no matrix product. Traces the step on the arguments' shapes (nothing runs or compiles;
  donated buffers may be gone)."""
  import jax

  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
  flops = jaxpr_flops(program.step.trace(*shapes).jaxpr.jaxpr)
  if flops <= 0:
    return None
  cluster = program.cluster
  return float(flops) * cluster.global_batch / cluster.num_devices / cluster.max_batch_per_device


def jaxpr_flops(jaxpr) -> float:
  """``2·M·N·K`` summed over the ``dot_general`` and ``conv_general_dilated`` equations of ``jaxpr``
  and the jaxprs inside its equations: a ``cond``'s costliest branch, a ``scan``'s body times its
  length, any other inner jaxpr once; a ``pallas_call``'s kernel is not entered (its body is one
  block's)."""
  import numpy as np

  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lc, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in lc])
    elif name == "conv_general_dilated":
      rhs, out_features = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec[0]
      total += 2.0 * np.prod(eqn.outvars[0].aval.shape) * np.prod(rhs) / rhs[out_features]
    elif name == "cond":
      total += max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
    elif name == "scan":
      total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
    elif name != "pallas_call":
      for inner in _inner_jaxprs(eqn.params.values()):
        total += jaxpr_flops(inner)
  return total


def _inner_jaxprs(values):
  """The jaxprs among an equation's parameters (open or closed, alone or in a tuple)."""
  for v in values:
    if isinstance(v, (tuple, list)):
      yield from _inner_jaxprs(v)
    elif hasattr(v, "eqns"):
      yield v
    elif hasattr(getattr(v, "jaxpr", None), "eqns"):
      yield v.jaxpr


def peak_tflops(devices: Sequence[Any]) -> tuple[str, float] | None:
  """``(device type, dense 16-bit peak TFLOP/s)`` of ``devices`` when they are all of one type
  the device table knows; else None."""
  from qsync_jax.devices import DEVICES, device_type_of
  from qsync_jax.errors import ClusterSpecError

  try:
    types = {device_type_of(d) for d in devices}
  except ClusterSpecError:
    return None
  if len(types) != 1:
    return None
  (name,) = types
  peaks = DEVICES[name].peak_tflops
  peak = peaks.get("bf16") or peaks.get("fp16")
  return (name, float(peak)) if peak else None


def rates(
  steps_per_s: float | None,
  global_batch: int,
  tokens_per_example: int | None,
  flops: float | None,
  peak: tuple[str, float] | None,
) -> dict[str, float]:
  """The throughput fields of a metrics record: ``steps_per_s`` and ``samples_per_s`` (0.0 while
  unknown), ``tokens_per_s``, ``tflops_per_device`` and ``mfu`` where known."""
  rate = steps_per_s or 0.0
  out = {"steps_per_s": rate, "samples_per_s": rate * global_batch}
  if not rate:
    return out
  if tokens_per_example:
    out["tokens_per_s"] = rate * global_batch * tokens_per_example
  if flops:
    out["tflops_per_device"] = rate * flops / 1e12
    if peak is not None:
      out["mfu"] = out["tflops_per_device"] / peak[1]
  return out


def progress_line(step: int, steps: int, values: dict[str, float], record: dict[str, float]) -> str:
  """``step 40/100  loss 2.3012  1234.5 samples/s  78.3k tokens/s  3.21 steps/s  41.2 TFLOP/s/device
  MFU 4.2%  ETA 19s``."""
  rate = record["steps_per_s"]
  parts = [f"step {step}/{steps}", f"loss {values['loss']:.4f}"]
  if "lr" in values:
    parts.append(f"lr {values['lr']:.3g}")
  parts.append(f"{record['samples_per_s']:.1f} samples/s")
  if "tokens_per_s" in record:
    parts.append(f"{_si(record['tokens_per_s'])} tokens/s")
  parts.append(f"{rate:.2f} steps/s")
  if "tflops_per_device" in record:
    parts.append(f"{record['tflops_per_device']:.3g} TFLOP/s/device")
  if "mfu" in record:
    parts.append(f"MFU {100 * record['mfu']:.1f}%")
  parts.append(f"ETA {(steps - step) / rate:.0f}s" if rate > 0 else "ETA after the next step")
  return "  ".join(parts)


def legend(flops: float | None, peak: tuple[str, float] | None) -> str:
  """The one line that says what the rates mean (printed with the first rate)."""
  text = (
    f"rates over the last {RATE_WINDOW_STEPS} steps, pauses (compiling, re-planning, checkpoints, eval) "
    "left out"
  )
  if flops:
    text += f"; TFLOP/s per device: the step's matrix products ({flops / 1e9:.3g} GFLOP per device)"
    if peak is not None:
      text += f"; MFU against the {peak[0]}'s dense 16-bit peak ({peak[1]:g} TFLOP/s)"
  return text


def _si(x: float) -> str:
  for unit, scale in (("M", 1e6), ("k", 1e3)):
    if x >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.1f}"
