"""Which whole-step candidates ``auto_policy`` compiles and times: the 8-bit sets it considers, each
set's step predicted from the per-op traces, and the sets that prediction leaves out.

The sets (``candidate_sets``), in this order, an equal set kept once under its first name:
``base`` (every op at the base precision); per 8-bit preset, every op that pays at that preset
(``"paying_int8"``…); every paying op at its fastest preset (``"paying"``); only those saving at
least ``STRONG_GAIN`` of their base time (``"strong"``); the frontier's choice within the accuracy
budget (``"frontier"``).

A set's predicted step (``predicted_ms``) is the traced all-base step less what its ops save in
the per-op traces. Work a preset adds outside the ops' own kernels (a quantize fused into a
LayerNorm, a transpose fused into the optimizer) is in no op's time, so the prediction ranks the
sets but does not replace their measured steps: ``timed_sets`` keeps the base, the predicted
fastest set, the frontier's set, and at most one more — the set predicted closest to the fastest
timed set of a group it could win (every set; the sets within the accuracy budget), when within
``CLOSE`` of the predicted base step. Every other set is pruned (not compiled, not timed), with why.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

STRONG_GAIN = 0.10
"""The ``"strong"`` candidate keeps ops that save at least this fraction of their base time."""
CLOSE = 0.01
"""A prediction is trusted to order two sets that differ by more than this fraction of the
predicted base step. On one H200 at width 2048 (2 blocks, 8,192 tokens per step,
``accuracy_gpu.jsonl`` ``wide/*/search``): the Llama-style model's frontier set and every paying op
at fp8, predicted 0.15 ms (1.4 % of the step) apart, were measured 0.23 ms apart in that order; the
GPT's, predicted 0.03 ms (0.25 %) apart, were measured 0.004 ms apart the other way (a tie)."""


def candidate_sets(
  paying: Callable[[float, str | None], dict[str, str]],
  presets: Sequence[str],
  frontier_set: Mapping[str, str] | None,
) -> dict[str, dict]:
  """``{name: {op: preset}}`` of the module docstring's sets, equal sets once (the first name).
  ``paying(min_gain, preset)``: the ops saving more than ``min_gain`` × their base time, at
  ``preset`` alone or (None) at their fastest (``payoff.paying_ops`` of the per-op times);
  ``frontier_set``: the frontier's choice (None or empty: no frontier set; ``set_name`` finds the
  name it is kept under)."""
  sets: dict[str, dict[str, str]] = {"base": {}}
  tries = [(f"paying_{p}", 0.0, p) for p in presets] + [("paying", 0.0, None), ("strong", STRONG_GAIN, None)]
  for name, min_gain, only in tries:
    chosen = paying(min_gain, only)
    if chosen and chosen not in sets.values():
      sets[name] = chosen
  if frontier_set and dict(frontier_set) not in sets.values():
    sets["frontier"] = dict(frontier_set)
  return sets


def set_name(sets: Mapping[str, Mapping[str, str]], chosen: Mapping[str, str] | None) -> str | None:
  """The name ``chosen`` is kept under in ``sets`` (None where it is None, empty or not there)."""
  return next((name for name, c in sets.items() if chosen and dict(c) == dict(chosen)), None)


def predicted_ms(base_step_ms: float, payoffs, chosen: Mapping[str, str]) -> float:
  """The step of ``chosen`` predicted from the per-op traces. Equivalent to::

  base_step_ms - sum(p.base_ms - p.preset_ms[chosen[p.op]] for p in payoffs if p.op in chosen)
  """
  return base_step_ms - sum(p.base_ms - p.preset_ms[chosen[p.op]] for p in payoffs if p.op in chosen)


def timed_sets(
  predicted: Mapping[str, float], eligible: Collection[str] | None, frontier: str | None = None
) -> tuple[list[str], dict[str, str]]:
  """``(names to time, {pruned name: why})`` of the sets ``predicted`` ({name: predicted ms}, in
  the order of ``candidate_sets``, ``"base"`` first), per the module docstring. ``eligible``: the
  names within the accuracy budget (None: no budget, the speed alone); ``frontier``: the name of
  the frontier's set (``"frontier"``, or the earlier set it equals; None: no frontier set)."""
  names = list(predicted)
  if len(names) == 1:
    return names, {}
  others = names[1:]
  fastest = min(others, key=lambda n: (predicted[n], names.index(n)))
  timed = list(dict.fromkeys(["base", fastest] + ([frontier] if frontier else [])))
  groups = [names] + ([[n for n in names if n == "base" or n in eligible]] if eligible is not None else [])
  margin = CLOSE * predicted["base"]

  def gap(name: str) -> tuple[float, str]:
    """(ms slower than the fastest timed set of the group ``name`` is closest to win, that set)."""
    best = []
    for group in groups:
      if name in group:
        leader = min((n for n in group if n in timed), key=lambda n: (predicted[n], names.index(n)))
        best.append((predicted[name] - predicted[leader], leader))
    return min(best)

  rest = [n for n in others if n not in timed]
  if rest:
    closest = min(rest, key=lambda n: (gap(n)[0], names.index(n)))
    if gap(closest)[0] <= margin:
      timed.append(closest)
  pruned = {}
  for name in rest:
    if name in timed:
      continue
    ms, leader = gap(name)
    why = (
      f"predicted {predicted[name]:.3f} ms, {ms:.3f} ms ({100 * ms / predicted['base']:.1f} % of the base "
      f"step) slower than {leader}'s {predicted[leader]:.3f} ms"
    )
    pruned[name] = why + (
      f", more than the {100 * CLOSE:g} % a prediction may miss by"
      if ms > margin
      else ", and not the closest"
    )
  return timed, pruned
