"""The speed/accuracy frontier of ``auto_policy``: which ops go 8-bit within an accuracy budget.

Each candidate op has its measured in-step time at the base precision and at every 8-bit preset
(``OpPayoff``) and, per preset, an accuracy cost: the op's Ω at the preset's forward precision
above its Ω at the base (``cost(op, preset)``; the sensitivity indicator's table). An op's options
are the base (0 ms saved, Ω 0) and each preset that saves time. The frontier grows the 8-bit set
in order of least Ω per ms saved, an op moving one option at a time along the lower convex hull of
its (ms saved, Ω) options — int8 first where it is cheap per ms, then fp8 where fp8's extra ms are
worth its extra Ω (the greedy of the multiple-choice knapsack). Its end is every op that pays at
its fastest preset: the speed-only choice, whose Ω is the *reference*.

An accuracy budget (``parse_budget``) is a fraction of that reference: ``choose`` walks the
frontier and takes each step whose Ω keeps the spent total within ``budget × reference``; a step
that does not fit ends that op's moves (the ops after it may still fit). ``0`` quantizes nothing;
``1`` is the frontier's end; ``"speed"`` (``SPEED``) is no accuracy limit at all (``auto_policy``
then keeps whichever measured candidate is fastest).

``DEFAULT_BUDGET`` is calibrated on the accuracy testbed, not chosen by hand: the fraction of the
speed-only Ω whose predicted held-out loss rise (taken as proportional to the Ω spent) stays within
one standard error of the testbed's paired difference, with fp8 on every Dense's measured rise at
the upper end of its interval (docs/results.md, "Choosing the default accuracy budget").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qsync_jax.errors import PlanError

SPEED = "speed"
"""The budget that weighs speed alone: the fastest measured candidate, whatever its Ω."""
DEFAULT_BUDGET = 0.2
"""The default accuracy budget: a fraction of the Ω of the speed-only choice (module docstring)."""


def parse_budget(value: Any, what: str = "accuracy budget") -> float | str:
  """``value`` as a budget: ``SPEED``, or a fraction in [0, 1] (a number or its text).
  ``PlanError`` naming ``what``, the value and the fix for anything else (negative, above 1, NaN,
  infinite, a bool, an unknown word)."""
  fix = (
    f"Fix: give a fraction of the speed-only choice's Ω in [0, 1] (0: nothing 8-bit; {DEFAULT_BUDGET:g}: the "
    f"default), or {SPEED!r} to weigh speed alone."
  )
  if isinstance(value, str):
    text = value.strip().lower()
    if text == SPEED:
      return SPEED
    try:
      number = float(text)
    except ValueError:
      raise PlanError(f"{what} {value!r} is neither a number nor {SPEED!r}. {fix}") from None
  elif isinstance(value, (int, float)) and not isinstance(value, bool):
    number = float(value)
  else:
    raise PlanError(f"{what} {value!r} is a {type(value).__name__}, not a number or {SPEED!r}. {fix}")
  if not math.isfinite(number):
    raise PlanError(f"{what} {value!r} is not a finite number. {fix}")
  if not 0.0 <= number <= 1.0:
    raise PlanError(f"{what} {value!r} is outside [0, 1]. {fix}")
  return number


def budget_label(budget: float | str) -> str:
  """How a budget reads in a summary: ``speed`` or ``0.2 of the speed-only Ω``."""
  return SPEED if budget == SPEED else f"{budget:g} of the speed-only Ω"


@dataclasses.dataclass(frozen=True)
class Step:
  """One move of the frontier: ``op`` from its previous option to ``preset``, adding ``omega`` of
  accuracy cost and saving ``ms`` more per step."""

  op: str
  preset: str
  omega: float
  ms: float

  @property
  def omega_per_ms(self) -> float:
    return self.omega / self.ms


def op_hull(options: Sequence[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
  """The options ``(preset, ms saved, Ω)`` (each saving > 0) on the lower convex hull of Ω over ms
  saved, from the base point (0, 0), in order of ms saved: each next one costs more Ω per extra ms
  than the one before. An option saving less for no less Ω, or above the hull, is never a move."""
  hull: list[tuple[str, float, float]] = [("", 0.0, 0.0)]
  for option in sorted(options, key=lambda o: (o[1], o[2], o[0])):
    while len(hull) > 1 and option[2] <= hull[-1][2]:  # saves more for no more Ω: replaces the last
      hull.pop()
    while len(hull) > 1:
      (_, s0, w0), (_, s1, w1) = hull[-2], hull[-1]
      # the last point lies on or above the segment from the one before it to this option
      if (w1 - w0) * (option[1] - s0) >= (option[2] - w0) * (s1 - s0):
        hull.pop()
      else:
        break
    if option[1] > hull[-1][1]:
      hull.append(option)
  return hull[1:]


def frontier(payoffs, cost: Callable[[str, str], float]) -> list[Step]:
  """Every op's moves (``op_hull`` of the presets at which it saves time), all ops' together in order
  of least Ω per ms saved (ties: the op's name). ``payoffs``: ``OpPayoff``s; ``cost(op, preset)``:
  the Ω that op adds at that preset."""
  steps = []
  for p in payoffs:
    options = [(preset, p.base_ms - ms, cost(p.op, preset)) for preset, ms in sorted(p.preset_ms.items())]
    prev_ms, prev_omega = 0.0, 0.0
    for preset, saved, omega in op_hull([o for o in options if o[1] > 0]):
      steps.append(Step(p.op, preset, omega - prev_omega, saved - prev_ms))
      prev_ms, prev_omega = saved, omega
  # the moves of one op have rising Ω per ms (a convex hull), so sorting keeps their order
  return sorted(steps, key=lambda s: (s.omega_per_ms, s.op, s.ms))


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` keeps: ``chosen`` ({op: preset}); ``spent`` of the ``allowed`` Ω; the speed-only
  choice's Ω (``reference``) and per-op ms saved (``reference_ms``) against this choice's
  (``saved_ms``); ``left_out`` ({op: why it is not at its fastest preset}: slower at every 8-bit
  preset, or over the budget)."""

  chosen: dict[str, str]
  spent: float
  allowed: float
  reference: float
  saved_ms: float
  reference_ms: float
  left_out: dict[str, str]

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def choose(payoffs, cost: Callable[[str, str], float], budget: float) -> Choice:
  """The frontier (``frontier``) walked within ``budget`` × the Ω of its end (module docstring).
  ``budget`` is a number from ``parse_budget``; 0 keeps nothing."""
  steps = frontier(payoffs, cost)
  reference = sum(s.omega for s in steps)
  allowed = budget * reference
  chosen: dict[str, str] = {}
  blocked: dict[str, Step] = {}
  spent = saved = 0.0
  for s in steps:
    if s.op in blocked:
      continue
    if budget > 0 and spent + s.omega <= allowed * (1 + 1e-12):  # the relative term absorbs rounding
      chosen[s.op] = s.preset
      spent += s.omega
      saved += s.ms
    else:
      blocked[s.op] = s
  left_out = {}
  for p in payoffs:
    if p.best() is None:
      left_out[p.op] = "no 8-bit preset is faster in the step"
    elif p.op in blocked:
      s = blocked[p.op]
      at = f"at {chosen[p.op]}, not {s.preset}: {s.preset}" if p.op in chosen else s.preset
      left_out[p.op] = (
        f"{at} would add Ω {s.omega:.3g} for {s.ms:.3f} ms ({s.omega_per_ms:.3g} per ms), over the budget"
      )
  return Choice(chosen, spent, allowed, reference, saved, sum(s.ms for s in steps), left_out)


def omega_cost(omega: Mapping[str, Mapping[str, float]], base: str) -> Callable[[str, str], float]:
  """``cost(op, preset)``: the op's Ω at the preset's forward precision above its Ω at ``base``
  (``planners.allocator.greedy.training_cost_per_share`` of that one op; ``PlanError`` where the
  table lacks the op at that precision)."""
  from planners.allocator.greedy import training_cost_per_share

  return lambda op, preset: training_cost_per_share(omega, base, {op: preset})
