"""What ``qsync plan`` and ``qsync predict`` print: plain-text lines, every figure labelled as what
it is (``modeled``; ``modeled, calibrated to measured``; where each group's costs come from)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from planners.allocator import precision_counts
from planners.planning import CALIBRATED, PlanResult
from planners.predictor import base_profile
from planners.profile import Profile, profile_key
from planners.report import estimated_costs, table


def mix(counts: Mapping[str, int]) -> str:
  """``"bf16×2, int8×1"``: how many ops run at each precision."""
  return ", ".join(f"{p}×{n}" for p, n in sorted(counts.items()))


def training_precision_line(
  name: str, eight_bit: Mapping[str, str], preset: str, budget: float, n_ops: int, source: str
) -> str:
  """What ``--train-precision auto`` chose for training group ``name``, and from which times:
  ``measured`` for a measured profile, ``measured, scaled by calibration`` for one calibrated from a
  measured profile (``Prediction.sources[name]``: the profile the group is costed with)."""
  times = "measured" if source.startswith("measured") else "measured, scaled by calibration"
  which = f" ({mix(Counter(eight_bit.values()))}: {', '.join(sorted(eight_bit))})" if eight_bit else ""
  return (
    f"training group {name}: {len(eight_bit)} of {n_ops} ops 8-bit{which}, the rest {preset}; an op runs "
    f"8-bit where the profile's {times} 8-bit time is below its {preset} time, within --train-budget "
    f"{budget:g} of their Ω"
  )


def calibration_note(prof: Profile) -> str:
  """`` (×SCALE the costs of BASE, fit to N points measured at step S of RUN, RMS error E %)``
  from a calibrated profile's ``meta["calibration"]``; "" without one."""
  cal = prof.meta.get("calibration")
  if not isinstance(cal, dict):
    return ""
  return (
    f" (×{cal['scale']:.3g} the {cal['base']['source']} costs of {cal['base']['file']}, fit to "
    f"{len(cal['points'])} points measured at step {cal['step']} of {cal['run']}, RMS error "
    f"{100 * cal['rel_rms_error']:.0f} %)"
  )


def cost_source_lines(cluster, profiles: Mapping[str, Profile], files: Mapping[str, str]) -> list[str]:
  """Where each group's costs come from, one line a group: for a profile of the group alone
  (``Profile.group``) ``modeled, calibrated to measured: FILE`` with its scale, fit and run;
  else for the ``--profile`` file of its device type ``measured: FILE`` / ``traced: FILE`` /
  ``modeled from the catalog: FILE`` (by that profile's source); else ``modeled from the
  catalog (based on FILE)`` with the file ``planners.predictor.base_profile`` (the first
  measured one given). Then one line per file that no group used: of a device type no group
  has, and not that base. ``profiles`` are those given (``files``: key → path)."""
  base = base_profile(profiles).key if profiles else None
  used = set()
  lines = []
  for g in cluster.groups:
    own = profiles.get(profile_key(g.device_type, g.name))
    prof = profiles.get(g.device_type)
    if own is not None:
      used.add(own.key)
      where = f"{CALIBRATED}: {files[own.key]}{calibration_note(own)}"
    elif prof is None:
      used.add(base)
      where = f"modeled from the catalog (based on {files[base]})"
    else:
      used.add(g.device_type)
      label = "modeled from the catalog" if prof.source == "modeled" else prof.source
      where = f"{label}: {files[g.device_type]}"
    lines.append(f"  {g.name} ({g.device_type}): {where}")
  types = sorted({g.device_type for g in cluster.groups})
  for key, path in files.items():
    t = profiles[key].device_type
    if key not in used and t not in types and profiles[key].group is None:
      lines.append(
        f"  profile {path} (device type {t}) was not used: no group of the cluster is of type {t}. Fix: "
        f"profile on a host of one of the cluster's device types {types} and pass that file, or drop {path}."
      )
  return ["costs per group:", *lines]


def plan_report(result: PlanResult) -> list[str]:
  """The lines ``qsync plan`` prints for ``result``: the chosen plan per group, the training
  groups' 8-bit ops, the predicted step and what it is against (``Summary.lines``), the datasheet
  estimates it relies on, where each group's costs come from, and every alternative."""
  inputs, problem, chosen, pred = result.inputs, result.problem, result.chosen, result.prediction
  cluster, figures = inputs.cluster, result.plan.predictions["figures"]
  counts = precision_counts(problem, chosen)
  rows = []
  for g, b in zip(cluster.groups, chosen.batches):
    if b == 0:
      rows.append([g.name, g.device_type, g.count, 0, "(sits out)", "-", "-", g.memory_gb])
      continue
    step, memory = pred.group_step_ms[g.name], pred.memory_bytes[g.name] / 1e9
    rows.append([g.name, g.device_type, g.count, b, mix(counts[g.name]), step, memory, g.memory_gb])
  lines = [table(["group", "device", "count", "batch", "precisions", "step ms", "mem GB", "limit GB"], rows)]
  for name, ops in result.eight_bit.items():
    n_ops, source = len(problem.op_names), pred.sources[name]
    lines.append(training_precision_line(name, ops, inputs.preset, result.budget, n_ops, source))
  modeled = sorted({g for g, src in pred.sources.items() if src.startswith("modeled")})
  label = f" (modeled costs for {', '.join(modeled)})" if modeled else ""
  if figures != "modeled":
    label += f" ({figures})"
  # the cost counts the training groups' 8-bit ops (--train-precision auto) too: say how much
  of_training = ""
  if problem.train_ops:
    of_training = f" ({result.search.training_cost(chosen.batches):.4g} of it the training groups' 8-bit ops)"
  lines.append(
    f"chosen: {chosen.name}; predicted step {chosen.step_ms:.3f} ms, {chosen.samples_per_s:.1f} samples/s"
    f"{label}, accuracy cost {chosen.cost:.4g}{of_training}; {result.search.replays} replays in "
    f"{result.seconds:.2f} s"
  )
  # the summary labels each line "modeled: "; a calibrated plan's figures say so instead
  lines += [f"{figures}: {line.removeprefix('modeled: ')}" for line in result.summary.lines()]
  estimates = estimated_costs({g.name: g.device_type for g in cluster.groups}, pred.sources, counts)
  if estimates:
    lines.append("modeled costs this plan relies on:\n  " + "\n  ".join(estimates))
  lines += cost_source_lines(cluster, inputs.given | _own(inputs), inputs.files)
  source = "" if figures == "modeled" else f", {figures}"
  lines.append(f"\nalternatives (predicted{source}; batch per device in group order):")
  alt_rows = []
  for c in result.candidates:
    batches = "/".join(str(b) for b in c.batches)
    ratio = c.samples_per_s / chosen.samples_per_s
    fits = "" if c.fits else " (does not fit)"
    alt_rows.append([c.name + fits, batches, c.step_ms, c.samples_per_s, f"{ratio:.2f}×", f"{c.cost:.4g}"])
  lines.append(table(["plan", "batches", "step ms", "samples/s", "vs chosen", "accuracy cost"], alt_rows))
  return lines


def _own(inputs) -> dict[str, Profile]:
  """The calibrated profiles of single groups among ``inputs.profiles`` (``--measured``)."""
  return {k: p for k, p in inputs.profiles.items() if p.group is not None}
