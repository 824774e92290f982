"""What ``qsync plan`` and ``qsync predict`` print: plain-text lines, every figure labelled as what
it is (``modeled``; ``modeled, calibrated to measured``; where each group's costs come from)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from planners.allocator import precision_counts
from planners.allocator.payloads import payload_lines
from planners.allocator.search import Candidate
from planners.planning import CALIBRATED, PlanResult
from planners.predictor import base_profile
from planners.predictor.graph import op_costs
from planners.predictor.step_error import StepError, step_error_for
from planners.profile import Profile, profile_key
from planners.report import estimated_costs, table
from qsync_jax.precision import QUANTIZED_PRECISIONS


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
  why = no_eight_bit_line(result)
  lines = [why] if why else []
  lines.append(
    table(["group", "device", "count", "batch", "precisions", "step ms", "mem GB", "limit GB"], rows)
  )
  lines.append(update_and_sync_line(result))
  for name, ops in result.eight_bit.items():
    n_ops, source = len(problem.op_names), pred.sources[name]
    lines.append(training_precision_line(name, ops, inputs.preset, result.request.budget, n_ops, source))
  modeled = sorted({g for g, src in pred.sources.items() if src.startswith("modeled")})
  label = f" (modeled costs for {', '.join(modeled)})" if modeled else ""
  if figures != "modeled":
    label += f" ({figures})"
  # the cost counts the training groups' 8-bit ops (--train-precision auto) too: say how much
  of_training = ""
  if problem.train_ops:
    of_training = f" ({result.search.training_cost(chosen.batches):.4g} of it the training groups' 8-bit ops)"
  if chosen.payload_cost:
    of_training += f" ({chosen.payload_cost:.3g} of it its {chosen.sync} payload's, measured)"
  elif chosen.payload_cost is None:
    of_training += f" (its {chosen.sync} payload's not measured)"
  error, chosen_lines = chosen_report(result, f"{label}, accuracy cost {chosen.cost:.4g}{of_training}")
  lines += chosen_lines
  if result.request.sync != "fp32":
    predictions = result.plan.predictions
    lines += payload_lines(predictions["payloads"], predictions["payload_accuracy"], problem.payload)
  # the summary labels each line "modeled: "; a calibrated plan's figures say so instead
  lines += [f"{figures}: {line.removeprefix('modeled: ')}" for line in result.summary.lines(error)]
  estimates = estimated_costs({g.name: g.device_type for g in cluster.groups}, pred.sources, counts)
  if estimates:
    lines.append("modeled costs this plan relies on:\n  " + "\n  ".join(estimates))
  lines += cost_source_lines(cluster, inputs.reported, inputs.files)
  source = "" if figures == "modeled" else f", {figures}"
  lines.append(f"\nalternatives (predicted{source}; batch per device in group order):")
  lines.append(alternatives_table(result))
  return lines


def alternatives_table(result: PlanResult) -> str:
  """One row per alternative (``best_per_name``): its mode, batches, step, samples/s with their
  range at the multi-device step error (``samples_range``), ratio to the chosen plan and accuracy
  cost; marked where it does not fit or is a reference."""
  chosen, cluster = result.chosen, result.inputs.cluster
  alt_rows = []
  for c in best_per_name(result.candidates, chosen):
    batches = "/".join(str(b) for b in c.batches)
    ratio = c.samples_per_s / chosen.samples_per_s
    fits = ("" if c.fits else " (does not fit)") + (" (reference)" if c.reference else "")
    cells = [c.step_ms, c.samples_per_s, samples_range(c, cluster), f"{ratio:.2f}×", f"{c.cost:.4g}"]
    alt_rows.append([c.name + fits, mode_label(c), batches, *cells])
  headers = ["plan", "mode (sync reduction, update)", "batches", "step ms", "samples/s", "at the error"]
  return table([*headers, "vs chosen", "accuracy cost"], alt_rows)


def chosen_report(result: PlanResult, tail: str) -> tuple[StepError | None, list[str]]:
  """The multi-device step error of the chosen plan (``planners.predictor.step_error``: None where
  one device runs it) and the lines naming the chosen plan: the error's line, where there is
  one, then its step and samples/s (with their range at the error), ``tail`` and the search's
  replays and seconds."""
  chosen = result.chosen
  error = step_error_for(running_devices(result.inputs.cluster, chosen))
  lines = []
  if error is not None:
    lines.append(f"multi-device step error: {error.note()}; each step and samples/s below shows its range")
  step = error.step_text(chosen.step_ms) if error else f"{chosen.step_ms:.3f} ms"
  rate = error.samples_text(chosen.samples_per_s) if error else f"{chosen.samples_per_s:.1f} samples/s"
  lines.append(
    f"chosen: {chosen.name}; predicted step {step}, {rate}{tail}; {result.search.replays} replays in "
    f"{result.seconds:.2f} s"
  )
  return error, lines


def running_devices(cluster, cand: Candidate) -> int:
  """The devices that run ``cand`` (its groups with a batch)."""
  return sum(g.count for g, b in zip(cluster.groups, cand.batches) if b > 0)


def samples_range(cand: Candidate, cluster) -> str:
  """``"582.0–1414.1"``: the candidate's samples/s at the measured multi-device step error
  (``planners.predictor.step_error``); ``"-"`` where one device runs it."""
  error = step_error_for(running_devices(cluster, cand))
  if error is None:
    return "-"
  lo, hi = error.samples_range(cand.samples_per_s)
  return f"{lo:.1f}–{hi:.1f}"


def mode_label(cand: Candidate) -> str:
  """``"fp32 flat, sharded"``: the candidate's sync, reduction and optimizer update."""
  reduction, update = cand.mode
  return f"{cand.sync} {reduction.replace('_', '-')}, {update}"


def best_per_name(candidates: Sequence[Candidate], chosen: Candidate) -> list[Candidate]:
  """One candidate per name, in order of first appearance: ``chosen`` for its own name, else the
  fastest fitting one (the search plans each name once per mode and sync; the table shows each
  at its best), and apart from them the references of each name (``Candidate.reference``: the
  baselines outside the plan's own space)."""
  best: dict[tuple[str, bool], Candidate] = {}
  for c in candidates:
    kept = best.get((c.name, c.reference))
    if kept is None or (c.fits, c.samples_per_s, -c.cost) > (kept.fits, kept.samples_per_s, -kept.cost):
      best[c.name, c.reference] = c
  best[chosen.name, False] = chosen
  return list(best.values())


UPDATES = {
  "replicated": "replicated (every device updates every parameter and holds the whole optimizer state)",
  "sharded": "sharded (ZeRO-1: each of the {n} devices updates 1/{n} of the parameters and holds 1/{n} of the "
  "optimizer state; the updated parameters are all-gathered)",
}
SYNCS = {
  "fp32": "fp32 all-reduce (4 bytes a gradient element)",
  "bf16": "bf16 all-reduce (2 bytes a gradient element, summed in fp32)",
  "fp16": "fp16 all-reduce (2 bytes a gradient element, summed in fp32)",
  "global_qsgd": "Global-QSGD integer all-reduce (stochastic rounding to one shared scale)",
}


def update_and_sync_line(result: PlanResult) -> str:
  """The optimizer update, reduction and gradient sync the plan assumes (``qsync train --plan``
  runs them), and how they were chosen (``--optimizer-update``, ``--sync``)."""
  plan, request = result.plan, result.request
  running = sum(g.count for g, b in zip(result.inputs.cluster.groups, result.chosen.batches) if b > 0)
  update = UPDATES[plan.optimizer_update].format(n=running)
  how = f"{'searched, ' if request.optimizer_update == 'auto' else ''}--optimizer-update {request.optimizer_update}"
  sync = f"{'searched, ' if request.sync == 'auto' else ''}--sync {request.sync}"
  reduction = "two-level (inside each group, then across groups)" if plan.reduction == "two_level" else "flat"
  return (
    f"optimizer update: {update} ({how}); gradient sync: {SYNCS[plan.sync]}, {reduction} ({sync}); "
    "`qsync train --plan` runs both"
  )


def no_eight_bit_line(result: PlanResult) -> str | None:
  """Where no op of the chosen plan runs at 8 bits: one line saying why, per group that runs:
  a training group keeps its preset; an inference group has no 8-bit level (no kernel on its
  device type, or no 8-bit Ω in the indicator), or its ops cost more at 8 bits than at the
  precisions the plan runs them (the times, labelled by the source of its costs), or they would
  save time the plan does not need (within the slack; their Ω). None where some op runs 8-bit."""
  problem, chosen = result.problem, result.chosen
  counts = precision_counts(problem, chosen)
  if any(p in QUANTIZED_PRECISIONS for mixes in counts.values() for p in mixes):
    return None
  reasons = []
  for gi, (g, b) in enumerate(zip(problem.groups, chosen.batches)):
    if b == 0:
      continue
    device = problem.cluster.groups[gi].device_type
    if gi not in problem.inference:
      hint = "" if result.request.auto else " (--train-precision auto runs 8 bits where measured to pay)"
      reasons.append(f"{g.name} ({device}) is a training group at {result.inputs.preset}{hint}")
      continue
    reasons.append(_inference_reason(problem, gi, b, chosen.rows[gi], device))
  return "no op runs 8-bit: " + "; ".join(reasons) + "."


def _inference_reason(problem, gi: int, batch: int, row, device: str) -> str:
  """Why inference group ``gi`` at ``batch`` under ``row`` (ladder levels) runs no op at 8 bits."""
  j = problem.inference.index(gi)
  group = dataclasses.replace(problem.groups[gi], batch_per_device=batch)
  source = "measured" if group.profile.source == "measured" else group.profile.source
  now = eight = saving = omega = 0.0
  paying = with_level = 0
  for i in range(len(problem.op_names)):
    ladder = problem.ladders[j][i]
    levels = [lv for lv, (p, _) in enumerate(ladder) if p in QUANTIZED_PRECISIONS]
    if not levels:
      continue
    with_level += 1
    t_now = _op_ms(group, i, ladder[row[i]][1])
    t8, lv8 = min((_op_ms(group, i, ladder[lv][1]), lv) for lv in levels)
    now, eight = now + t_now, eight + t8
    if t8 < t_now:
      paying, saving, omega = paying + 1, saving + t_now - t8, omega + problem.omega[j][i][lv8]
  if not with_level:
    return f"{group.name} ({device}) has no 8-bit level (no 8-bit kernel on {device}, or no 8-bit Ω in the indicator)"
  if not paying:
    return (
      f"{group.name} ({device}, {source} costs): its {with_level} ops take {eight:.3f} ms a step at 8 bits against "
      f"{now:.3f} ms as planned — the quantization costs more than the faster products save"
    )
  return (
    f"{group.name} ({device}, {source} costs): 8 bits would save {saving:.3f} ms on {paying} of its ops, which the "
    f"plan does not need to keep pace (within --slack), at an accuracy cost of Ω {omega:.4g}"
  )


def _op_ms(group, op_index: int, policy) -> float:
  """ms of op ``op_index`` of ``group`` inside the step under ``policy`` (all its nodes)."""
  name = group.profile.ops[op_index].name
  costs = op_costs(dataclasses.replace(group, op_policies={name: policy}), op_index)
  return sum(ms for ms, _ in costs.values())
