"""The lines ``qsync train --plan auto`` prints for an ``auto_policy`` result (``AutoPolicy.summary``)."""

from __future__ import annotations

from planners.allocator.frontier import SPEED, budget_label, omega_cost


def summary_lines(r) -> list[str]:
  """The measured candidate steps and the winner; the accuracy budget, the Ω it spent and the speed
  it kept against the speed-only choice; then each candidate op's in-step times, its Ω per preset
  above the base's, its precision and, where it is not at its fastest preset, why; last, the
  search's seconds per phase and the candidate sets it did not time (``search_line``)."""
  where = f"{r.device_kind} (measured, {r.clock} clock, batch {r.batch_per_device} per device)"
  lines = (
    [f"auto policy loaded from {r.cache_path} (same model, batch, device and versions)"] if r.loaded else []
  )
  lines.append(
    f"auto policy on {where}: "
    + ", ".join(f"{name} ({len(r.candidates[name])} ops 8-bit) {ms:.3f} ms" for name, ms in r.step_ms.items())
    + f" -> {r.winner}, {r.speedup:.3f}x the all-{r.base} step"
  )
  lines.append(budget_line(r))
  cost = omega_cost(r.omega, r.base) if r.omega is not None else None
  why = r.frontier.left_out if r.frontier is not None else {}
  for p in r.payoffs:
    timed = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p.preset_ms.items()))
    omega = ""
    if cost is not None and p.op in r.omega:
      omega = f", Ω above {r.base} " + " ".join(f"{k} {cost(p.op, k):.3g}" for k in sorted(p.preset_ms))
    mark, best = r.chosen.get(p.op, r.base), p.best()
    reason = ""
    if best is not None and mark != best[0]:
      reason = f" ({why.get(p.op) or f'not in the {r.winner} candidate'})"
    elif best is None and p.op in why:
      reason = f" ({why[p.op]})"
    lines.append(f"  {p.op}: {r.base} {p.base_ms:.3f} ms, {timed} ms in step{omega} -> {mark}{reason}")
  return lines + [search_line(r)]


def search_line(r) -> str:
  """The last line of ``summary_lines``: the search's seconds, per phase, the training steps it
  compiled, and each candidate set it did not time with why."""
  phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in r.search_phases.items())
  line = f"search {r.search_s:.1f} s" + (f" ({phases} s)" if phases else "")
  line += f"; {r.compiled_steps} training steps compiled" if r.compiled_steps else ""
  if r.pruned:
    line += "; not timed: " + "; ".join(f"{name} ({why})" for name, why in r.pruned.items())
  return line


def budget_line(r) -> str:
  """The accuracy budget's line of ``summary_lines``."""
  spent = r.candidate_omega.get(r.winner)
  if r.budget == SPEED:
    return "accuracy budget: speed (the fastest candidate, Ω not weighed)" + (
      f"; Ω spent {spent:.3g}" if spent is not None else ""
    )
  if r.frontier is None:
    return f"accuracy budget {budget_label(r.budget)}: every op at {r.base}"
  fastest = r.speed_winner or r.winner
  line = (
    f"accuracy budget {budget_label(r.budget)} (Ω: {r.indicator}): Ω spent {spent or 0.0:.3g} of "
    f"{r.frontier.allowed:.3g} allowed; speed-only ({fastest}) spends {r.candidate_omega.get(fastest, 0.0):.3g}"
  )
  if r.speed_speedup <= 1.0:
    return line + ", nothing is faster than the base"
  kept = (1 - 1 / r.speedup) / (1 - 1 / r.speed_speedup)
  return line + f" for {r.speed_speedup:.3f}x; kept {r.speedup:.3f}x, {100 * kept:.0f} % of its time saved"
