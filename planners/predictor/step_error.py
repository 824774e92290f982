"""The measured error of the modeled multi-device step, shown beside every multi-device figure.

No multi-GPU machine was at hand to calibrate the replay's step against the step the trainer
runs on several devices, so the planner shows the error measured where both were recorded: the
``modes`` rows of ``benchmarks/multigpu.py`` (``benchmarks/results/multigpu.jsonl``), each a
measured step (``value``) beside the replay's modeled step of the same run's profile and link
(``modeled_step_ms``), on two and four devices. ``MULTI_DEVICE_STEP_ERROR`` is
``step_error_of(rows)`` of the committed rows (``tests/planners/test_step_error.py`` checks it is).
Left out: the one-device rows (one device has no collectives: its step is the profile's), and the
micro-step rows whose modeled step is the single pass's (``modeled_ratio`` 1.0: recorded before
the replay priced micro-steps).

A one-device pool's step is the profile's, calibrated on the device: it carries no band.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class StepError:
  """The measured multi-device step over the modeled one, ``low``–``high`` over ``rows`` rows on
  ``devices``. A modeled step ``s`` measured somewhere in ``[low·s, high·s]``; a modeled
  throughput ``x`` in ``[x/high, x/low]``."""

  low: float
  high: float
  rows: int
  devices: str

  def step_range(self, step_ms: float) -> tuple[float, float]:
    return step_ms * self.low, step_ms * self.high

  def samples_range(self, samples_per_s: float) -> tuple[float, float]:
    return samples_per_s / self.high, samples_per_s / self.low

  def note(self) -> str:
    """``measured 0.87–2.12× the modeled multi-device step (15 runs on 2–4 × NVIDIA H200)``."""
    return f"measured {self.low:.2f}–{self.high:.2f}× the modeled multi-device step ({self.rows} runs on {self.devices})"

  def step_text(self, step_ms: float) -> str:
    """``6.870 ms (5.998–14.571 at the measured error)``."""
    lo, hi = self.step_range(step_ms)
    return f"{step_ms:.3f} ms ({lo:.3f}–{hi:.3f} at the measured error)"

  def samples_text(self, samples_per_s: float) -> str:
    """``1234.5 samples/s (582.0–1414.1 at the measured error)``."""
    lo, hi = self.samples_range(samples_per_s)
    return f"{samples_per_s:.1f} samples/s ({lo:.1f}–{hi:.1f} at the measured error)"

  def covers_gain(self, gain: float) -> bool:
    """Whether a modeled gain of one multi-device plan over another is inside the error: below
    ``high / low``, the spread of the measured-over-modeled ratio between the rows (of two
    plans modeled ``gain`` apart, the faster may run as slow as ``high×`` its model while the
    other runs at ``low×`` its own)."""
    return gain < self.high / self.low


def step_error_of(rows: Iterable[Mapping]) -> StepError:
  """The ``StepError`` of benchmark rows (module docstring: which rows count)."""
  ratios, devices, counts = [], set(), set()
  for r in rows:
    if r.get("benchmark") != "multigpu" or not str(r.get("case", "")).startswith("modes/"):
      continue
    if r.get("metric") != "step_ms" or sum(r.get("groups", ())) < 2:
      continue
    if "/micro" in r["case"] and r.get("modeled_ratio") == 1.0:
      continue
    ratios.append(r["value"] / r["modeled_step_ms"])
    name, _, n = r["device"].rpartition(" x")
    devices.add(name)
    counts.add(int(n))
  if not ratios:
    raise ValueError("no multigpu modes rows with a measured and a modeled multi-device step")
  n = "–".join(str(c) for c in sorted(counts))
  return StepError(
    round(min(ratios), 3), round(max(ratios), 3), len(ratios), f"{n} × {', '.join(sorted(devices))}"
  )


MULTI_DEVICE_STEP_ERROR = StepError(low=0.873, high=2.121, rows=15, devices="2–4 × NVIDIA H200")
"""``step_error_of`` the committed ``benchmarks/results/multigpu.jsonl`` (module docstring)."""


def step_error_for(devices: int) -> StepError | None:
  """The error shown beside a pool's modeled step: ``MULTI_DEVICE_STEP_ERROR`` for two devices or
  more, None for one."""
  return MULTI_DEVICE_STEP_ERROR if devices >= 2 else None
