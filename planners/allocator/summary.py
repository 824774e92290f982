"""A plan's predicted throughput against the best baseline and the pool's bound, and what limits it.

``summarize(chosen, candidates, search, prediction)`` gives a ``Summary``: the plan's predicted
samples/s; the best baseline (``bound.best_baseline``: the faster of dynamic batching and the
training groups alone) and ``gain`` = plan / best baseline; the pool's bound (``bound.pool_bound``)
and the share of the headroom the plan captures, ``(plan − best) / (bound − best)`` when the
bound is above the best baseline; and what limits the step (``planners.predictor.limits``, read
from the plan's ``Prediction``, as ``qsync predict`` reads it). Every figure
is modeled (the replay's prediction); ``lines()`` says so on each line.
"""

from __future__ import annotations

import dataclasses

from planners.allocator.bound import best_baseline, pool_bound
from planners.predictor.limits import Limits, limits
from planners.predictor.step_error import StepError


@dataclasses.dataclass(frozen=True)
class Summary:
  """See the module docstring. ``baseline`` is None where the search had no baseline candidate
  (``--batch equal``); ``headroom_captured`` None where the bound is not above the baseline."""

  samples_per_s: float
  baseline: str | None
  baseline_samples_per_s: float | None
  gain: float | None
  bound_samples_per_s: float
  headroom_captured: float | None
  limits: Limits

  def to_json(self) -> dict:
    """The keys ``qsync plan`` writes under the plan's ``predictions``."""
    return {
      "figures": "modeled",
      "best_baseline": None
      if self.baseline is None
      else {"name": self.baseline, "samples_per_s": self.baseline_samples_per_s},
      "gain_vs_best_baseline": self.gain,
      "bound_samples_per_s": self.bound_samples_per_s,
      "headroom_captured": self.headroom_captured,
      "limited_by": self.limits.to_json(),
    }

  def lines(self, error: StepError | None = None) -> list[str]:
    """Three lines, each figure labelled modeled; with ``error`` (a multi-device pool:
    ``planners.predictor.step_error``), the plan's and the baseline's throughput with their range
    at that error, and a fourth line where the plan's gain is inside it."""

    def rate(x: float) -> str:
      return error.samples_text(x) if error is not None else f"{x:.1f} samples/s"

    if self.baseline is None:
      first = f"modeled: {rate(self.samples_per_s)}; no baseline (dynamic batching, training groups only) was planned"
    else:
      first = (
        f"modeled: {rate(self.samples_per_s)}, {self.gain:.2f}× the best baseline ({self.baseline}, "
        f"{rate(self.baseline_samples_per_s)})"
      )
    second = (
      f"modeled: pool bound {self.bound_samples_per_s:.1f} samples/s (every device at its fastest precision, "
      "batch split by speed, no communication)"
    )
    if self.headroom_captured is not None:
      second += (
        f"; the plan captures {100 * self.headroom_captured:.0f} % of the headroom above the best baseline"
      )
    elif self.baseline is not None:
      second += "; the best baseline is at the bound"
    lines = [first, second, f"modeled: {self.limits.line()}"]
    if error is not None and self.gain is not None and self.gain > 1 and error.covers_gain(self.gain):
      lines.append(
        f"modeled: the gain {self.gain:.2f}× is inside the error of the modeled multi-device step ({error.note()}): "
        "not a speed-up until measured"
      )
    return lines


def baseline_label(base, chosen) -> str:
  """The best baseline's name, with its gradient sync where it is not the plan's, and marked a
  reference where the plan's own search did not contain it (``Candidate.reference``): what the
  user would switch on to get it."""
  label = base.name if base.sync == chosen.sync else f"{base.name}, {base.sync} gradient sync"
  return f"{label} (reference: not in this plan's search)" if base.reference else label


def summarize(chosen, candidates, search, prediction) -> Summary:
  """The ``Summary`` of ``chosen`` among ``candidates`` (``joint_plan``'s), ``prediction`` its
  ``planners.predictor.replay.predict``."""
  base = best_baseline(candidates)
  bound = pool_bound(search).samples_per_s
  plan = chosen.samples_per_s
  headroom = None
  if base is not None and bound > base.samples_per_s * (1 + 1e-9):
    headroom = (plan - base.samples_per_s) / (bound - base.samples_per_s)
  return Summary(
    samples_per_s=plan,
    baseline=None if base is None else baseline_label(base, chosen),
    baseline_samples_per_s=None if base is None else base.samples_per_s,
    gain=None if base is None else plan / base.samples_per_s,
    bound_samples_per_s=bound,
    headroom_captured=headroom,
    limits=limits(prediction),
  )
