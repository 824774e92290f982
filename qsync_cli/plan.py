"""``qsync plan``: every group's per-device batch and per-op precisions (``planners.allocator.joint``).

With ``--measured RUN``, each group is costed from a profile calibrated to its compute measured
in a ``qsync train`` run (``planners.calibrate``), written next to ``--out`` as
``profile-GROUP.json`` so that ``qsync plan --profile profile-*.json`` plans the same offline.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
from collections import Counter

from planners.allocator import INT8_OPS
from qsync_cli.common import (
  CALIBRATED,
  add_model_argument,
  check_model,
  check_profiles_fit,
  check_write_target,
  cost_source_lines,
  load_json,
  load_profiles,
  progress,
)
from qsync_jax.devices import DEVICES, training_precision
from qsync_jax.errors import PlanError, QsyncError, QsyncWarning, UnsupportedPrecisionError
from qsync_jax.jsonio import read_json_lines, undecodable_warning
from qsync_jax.precision import PRESETS

HELP = "Plan every group's batch and per-op precisions: fastest within --slack, then least accuracy cost."


def add_arguments(parser) -> None:
  add_model_argument(parser)
  parser.add_argument(
    "--cluster", required=True, help="cluster spec JSON/YAML (its batches set the global batch)"
  )
  parser.add_argument("--indicator", required=True, help="sensitivity JSON from `qsync indicator`")
  parser.add_argument("--profile", required=True, nargs="+", help="profile JSON(s) from `qsync profile`")
  parser.add_argument(
    "--training-groups",
    help="comma-separated groups that keep --train-precision (default: fastest device type)",
  )
  parser.add_argument(
    "--train-precision",
    default=None,
    help="policy preset of the training groups (default: bf16 where their device type runs bf16, fp16 "
    "mixed precision where it runs fp16 but not bf16 — a V100, a T4 —, else fp32; with training groups "
    "of several types, the first of these that all of them run); auto: that default, with an 8-bit preset "
    "on each op whose measured 8-bit time in the group's profile is below its 16-bit time",
  )
  parser.add_argument(
    "--train-budget",
    type=float,
    default=None,
    help="with --train-precision auto: the share of the indicator's Ω of every paying op that the training "
    "groups' 8-bit ops may spend, least Ω per ms saved first (default 1.0: every paying op)",
  )
  parser.add_argument(
    "--batch",
    choices=("joint", "equal"),
    default="joint",
    help="joint: choose per-device batches too; equal: keep the spec's (e.g. for BatchNorm statistics)",
  )
  parser.add_argument(
    "--int8-op",
    choices=INT8_OPS,
    default=None,
    help="what an op planned at int8 runs: int8_fwd (QSync's op: int8 forward, fp16 backward; the default) or "
    "int8 on all legs",
  )
  parser.add_argument("--slack", type=float, default=0.02, help="throughput given up for accuracy (fraction)")
  parser.add_argument("--granularity", type=int, default=1, help="per-device batches are multiples of this")
  parser.add_argument(
    "--measured",
    metavar="RUN_DIR",
    help="the --out directory of a `qsync train --replan once|auto` run on this cluster: cost each group from "
    "--profile scaled to the group's compute measured there (its latest measurement, at the policy the run "
    "ran), and write that profile next to --out as profile-GROUP.json",
  )
  parser.add_argument("--out", required=True, help="output plan JSON")


def mix(counts: dict[str, int]) -> str:
  return ", ".join(f"{p}×{n}" for p, n in sorted(counts.items()))


def train_precision(cluster, training: tuple[str, ...], preset: str | None) -> str:
  """The policy preset the ``training`` groups of ``cluster`` run: ``preset`` (``--train-precision``)
  when given, after checking that it is a preset every training group's device type runs; else
  ``qsync_jax.devices.training_precision`` of their device types (bf16, else fp16, else fp32)."""
  types = sorted({cluster.group(name).device_type for name in training})
  if preset is None:
    return training_precision(types)
  if preset not in PRESETS:
    raise QsyncError(
      f"--train-precision {preset!r} is not a policy preset. Fix: use one of {list(PRESETS)}, or leave it "
      "out for the training devices' default (bf16, fp16 on a V100 or T4)."
    )
  for name in training:
    g = cluster.group(name)
    legs = PRESETS[preset]
    missing = sorted({legs.fwd, legs.dlhs, legs.drhs} - set(DEVICES[g.device_type].precisions))
    if missing:
      raise UnsupportedPrecisionError(
        f"--train-precision {preset!r}: training group {name!r} ({g.device_type}) cannot run {missing} (it "
        f"runs {list(DEVICES[g.device_type].precisions)}). Fix: pick a preset it runs, or leave "
        "--train-precision out for its default."
      )
  return preset


def training_policies(
  cluster, training: tuple[str, ...], profiles, preset: str, omega, budget: float
) -> dict[str, dict[str, str]]:
  """``{group: {op: 8-bit preset}}`` of ``--train-precision auto``: for each training group, the
  ops of the profile it is costed with (``profile_for``) whose measured 8-bit time is below
  their time at ``preset``, within ``budget`` of Ω (``planners.allocator.payoff.profile_paying_ops``).
  ``PlanError`` naming the group for a profile that is not measured or a device type without an
  8-bit kernel: auto refuses rather than fall back to ``preset`` unasked."""
  from planners.allocator.payoff import profile_paying_ops
  from planners.predictor.replay import profile_for

  chosen = {}
  for name in training:
    g = cluster.group(name)
    try:
      chosen[name] = profile_paying_ops(profile_for(profiles, g.device_type, name), preset, omega, budget)
    except PlanError as e:
      raise PlanError(f"--train-precision auto: training group {name!r} ({g.device_type}): {e}") from None
  return chosen


def training_precision_line(
  name: str, eight_bit: dict[str, str], preset: str, budget: float, n_ops: int, source: str
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


def check_indicator_model(indicator, path: str, task_name: str, model: str) -> None:
  """Raises ``PlanError`` when the indicator table at ``path`` says it was computed on another
  model than ``task_name`` (its ``metadata.task``; a hand-written table without one passes)."""
  metadata = indicator.get("metadata") if isinstance(indicator, dict) else None
  scored = metadata.get("task") if isinstance(metadata, dict) else None
  if scored is not None and scored != task_name:
    raise PlanError(
      f"--indicator {path!r} was computed on model {scored!r}, not on {task_name!r} (--model {model}); "
      "another model's sensitivities say nothing about this one's ops. Fix: run `qsync indicator "
      f"--model {model} --out FILE` and pass that FILE."
    )


def check_indicator_scores_8bit(indicator, args, cluster, training: tuple[str, ...]) -> None:
  """Raises ``PlanError`` when the plan asks for 8-bit ops — ``--int8-op`` given (of the inference
  groups), ``--train-precision auto`` (of the training groups) — and the ``--indicator`` scores
  no op at an 8-bit precision those groups' devices run: the planner could not plan one. Else
  warns (``planners.indicator.coverage.warn_unscored``) of inference groups left without 8 bits."""
  from planners.allocator import omega_table
  from planners.indicator.coverage import unscored_eight_bit, unscored_line, warn_unscored

  omega = omega_table(indicator)
  inference = [g for g in cluster.group_names if g not in training]
  for flag, groups in (
    (f"--int8-op {args.int8_op}", inference if args.int8_op else []),
    ("--train-precision auto", list(training) if args.train_precision == "auto" else []),
  ):
    unscored = unscored_eight_bit(omega, cluster, groups)
    if unscored:
      raise PlanError(
        f"{flag} asks for 8-bit ops, but --indicator {args.indicator!r}: {unscored_line(unscored, omega)}"
      )
  warn_unscored(omega, cluster, inference)


GROUP_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""Group names a ``profile-GROUP.json`` file can carry."""


def calibrated_profile_paths(cluster, out: str) -> dict[str, str]:
  """``{group: DIR/profile-GROUP.json}``, ``DIR`` the directory of the plan ``out``;
  ``PlanError`` for a group name that cannot be part of a file name."""
  paths = {}
  for name in cluster.group_names:
    if not GROUP_FILE_NAME.fullmatch(name):
      raise PlanError(
        f"--measured: group {name!r}'s calibrated profile would be written to profile-{name}.json, which is no "
        "plain file name. Fix: name the group with letters, digits, '.', '_' and '-' only (in the cluster spec "
        "and the run)."
      )
    paths[name] = os.path.join(os.path.dirname(out), f"profile-{name}.json")
  return paths


def read_run(run: str):
  """``(each group's latest measurement, the plan the run ran, its checkpoint's meta)`` of the
  ``qsync train`` directory ``run``: the measurements from its ``metrics.jsonl``
  (``planners.calibrate.latest_measurements``; lines that are not JSON, such as one a kill cut
  short, are skipped as the trainer skips them, and lines that are not UTF-8 with a
  ``QsyncWarning`` naming them), the plan and the groups from its latest
  checkpoint (re-planning changes only batches, so that plan's policies are the ones measured).
  ``PlanError`` naming what is missing, before any model is built."""
  from planners.calibrate import latest_measurements
  from qsync_jax.plan import Plan
  from qsync_jax.train.checkpoint import CheckpointStore

  fix = "Fix: pass the --out directory of a `qsync train --replan once` (or auto) run."
  if not os.path.isdir(run):
    raise PlanError(f"--measured {run!r} is not a directory. {fix}")
  metrics = os.path.join(run, "metrics.jsonl")
  if not os.path.isfile(metrics):
    raise PlanError(f"--measured {run!r} has no metrics.jsonl, so no measurements. {fix}")
  lines, undecodable = read_json_lines(metrics)
  if undecodable:
    warnings.warn(undecodable_warning(metrics, undecodable, "skipped"), QsyncWarning, stacklevel=2)
  measured = latest_measurements([line.value for line in lines if line.value is not None], metrics)
  if not measured:
    raise PlanError(
      f"--measured {run!r}: {metrics} has no measurement of the groups' speeds (no `replan` line with "
      "`measured_ms`). Fix: train with `qsync train --replan once` (the default on GPUs) or `--replan auto`, "
      "and pass that run."
    )
  store = CheckpointStore(os.path.join(run, "checkpoints"))
  try:
    if store.latest_step() is None:
      raise PlanError(
        f"--measured {run!r} holds no checkpoint, so the plan it ran (each group's policy, at which the "
        "groups were measured) is unknown. Fix: let the run checkpoint (it does at its end and every "
        "--checkpoint-every steps; `qsync train ... --resume` with more --steps continues it), then pass it."
      )
    _, meta = store.read_meta()
  finally:
    store.close()
  return measured, Plan.from_json(meta["plan"]), meta


def figures_label(sources, groups) -> str:
  """How the plan's figures are labelled: ``modeled``, or ``CALIBRATED`` when every running
  group in ``groups`` is costed from a calibrated profile (``Prediction.sources``), or
  ``CALIBRATED for G, …`` when some are."""
  calibrated = [g for g in groups if sources[g].startswith("calibrated")]
  if not calibrated:
    return "modeled"
  return CALIBRATED if len(calibrated) == len(groups) else f"{CALIBRATED} for {', '.join(calibrated)}"


def run(args) -> int:
  from planners.allocator import joint_plan, make_problem, omega_table, plan_of, precision_counts
  from planners.allocator.greedy import default_training_groups
  from planners.allocator.summary import summarize
  from planners.calibrate import calibrated_profiles, check_run_groups
  from planners.indicator import check_values
  from planners.predictor import predict
  from planners.report import estimated_costs, table
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.train.outputs import check_file
  from qsync_jax.train.task import load_task

  # Arguments and input files first: a bad one is named before the model is built.
  if args.slack < 0:
    raise QsyncError(f"--slack {args.slack} must be 0 or more. Fix: pass e.g. --slack 0.02.")
  if args.granularity < 1:
    raise QsyncError(f"--granularity {args.granularity} must be at least 1. Fix: pass e.g. --granularity 1.")
  auto = args.train_precision == "auto"
  if args.train_budget is not None and not auto:
    raise QsyncError(
      "--train-budget applies to --train-precision auto alone. Fix: pass --train-precision auto, or leave "
      "--train-budget out."
    )
  budget = 1.0 if args.train_budget is None else args.train_budget
  if not 0.0 <= budget <= 1.0:
    raise QsyncError(f"--train-budget {budget} is outside [0, 1]. Fix: pass a fraction, e.g. 0.5.")
  cluster = ClusterSpec.load(args.cluster)
  training = (
    tuple(args.training_groups.split(",")) if args.training_groups else default_training_groups(cluster)
  )
  unknown = [name for name in training if name not in cluster.group_names]
  if unknown:
    raise PlanError(
      f"--training-groups names {unknown}, which cluster {cluster.name!r} ({args.cluster}) does not have. "
      f"Fix: use some of its groups {list(cluster.group_names)}, comma-separated."
    )
  preset = train_precision(cluster, training, None if auto else args.train_precision)
  if args.measured is not None:
    measured, ran, run_meta = read_run(args.measured)
    check_run_groups(cluster, measured, run_meta.get("cluster", []), args.measured, args.cluster)
    profile_paths = calibrated_profile_paths(cluster, args.out)
    for path in profile_paths.values():
      check_file("--out (its calibrated profiles)", path)
      check_write_target("--out (its calibrated profiles)", path, "file")
  profiles, files = load_profiles(args.profile, with_paths=True)
  check_profiles_fit(profiles, cluster)
  indicator = load_json(args.indicator, "indicator")
  check_values(indicator, args.indicator)
  check_indicator_scores_8bit(indicator, args, cluster, training)
  task = load_task(args.model)
  check_model(profiles, task.name)
  check_indicator_model(indicator, args.indicator, task.name, args.model)
  if args.measured is not None:
    if run_meta.get("task") != task.name:
      raise PlanError(
        f"--measured {args.measured!r} trained model {run_meta.get('task')!r}, not {task.name!r} (--model "
        f"{args.model}); its measurements say nothing of this model's costs. Fix: pass a run of --model "
        f"{args.model}."
      )
    check_profiles_fit(profiles, cluster, ran)
    calibrated = calibrated_profiles(cluster, profiles, ran, measured, os.path.abspath(args.measured), files)
    profiles = {**profiles, **calibrated}
    files = {**files, **{p.key: profile_paths[p.group] for p in calibrated.values()}}
  eight_bit = {}
  if auto:
    eight_bit = training_policies(cluster, training, profiles, preset, omega_table(indicator), budget)
  problem = make_problem(
    cluster, profiles, indicator, training, preset, int8_op=args.int8_op or "int8_fwd", train_ops=eight_bit
  )
  progress(
    f"{len(problem.op_names)} ops, {len(cluster.groups)} groups, global batch {cluster.global_batch}: "
    f"{args.batch} batch × precision search; training group(s) {', '.join(training)} at {preset}"
    + (" with 8 bits where measured to pay" if auto else "")
  )
  t0 = time.perf_counter()
  chosen, cands, search = joint_plan(problem, args.granularity, args.slack, args.batch)
  seconds = time.perf_counter() - t0
  alternatives = [c.to_json(problem) for c in cands]
  pred = predict(cluster, profiles, plan_of(problem, chosen))
  summary = summarize(chosen, cands, search, pred)
  plan = plan_of(
    problem,
    chosen,
    {
      **pred.to_json(),
      "chosen": chosen.name,
      "samples_per_s": chosen.samples_per_s,
      "accuracy_cost": chosen.cost,
      "alternatives": alternatives,
      **summary.to_json(),
      "replays": search.replays,
      "planning_s": seconds,
    },
  )
  running = [g.name for g, b in zip(cluster.groups, chosen.batches) if b > 0]
  figures = figures_label(pred.sources, running)
  plan = dataclasses.replace(plan, predictions={**plan.predictions, "figures": figures})
  plan.save(args.out)
  if args.measured is not None:
    for prof in calibrated.values():
      prof.save(profile_paths[prof.group])
  counts = precision_counts(problem, chosen)
  rows = []
  for g, b in zip(cluster.groups, chosen.batches):
    if b == 0:
      rows.append([g.name, g.device_type, g.count, 0, "(sits out)", "-", "-", g.memory_gb])
      continue
    rows.append(
      [
        g.name,
        g.device_type,
        g.count,
        b,
        mix(counts[g.name]),
        pred.group_step_ms[g.name],
        pred.memory_bytes[g.name] / 1e9,
        g.memory_gb,
      ]
    )
  print(table(["group", "device", "count", "batch", "precisions", "step ms", "mem GB", "limit GB"], rows))
  for name, ops in eight_bit.items():
    print(training_precision_line(name, ops, preset, budget, len(problem.op_names), pred.sources[name]))
  modeled = sorted({g for g, src in pred.sources.items() if src.startswith("modeled")})
  label = f" (modeled costs for {', '.join(modeled)})" if modeled else ""
  if figures != "modeled":
    label += f" ({figures})"
  # the cost counts the training groups' 8-bit ops (--train-precision auto) too: say how much
  of_training = ""
  if problem.train_ops:
    of_training = f" ({search.training_cost(chosen.batches):.4g} of it the training groups' 8-bit ops)"
  print(
    f"chosen: {chosen.name}; predicted step {chosen.step_ms:.3f} ms, {chosen.samples_per_s:.1f} samples/s"
    f"{label}, accuracy cost {chosen.cost:.4g}{of_training}; {search.replays} replays in {seconds:.2f} s"
  )
  # the summary labels each line "modeled: "; a calibrated plan's figures say so instead
  print("\n".join(f"{figures}: {line.removeprefix('modeled: ')}" for line in summary.lines()))
  alt_rows = []
  for c in cands:
    batches = "/".join(str(b) for b in c.batches)
    ratio = c.samples_per_s / chosen.samples_per_s
    fits = "" if c.fits else " (does not fit)"
    alt_rows.append([c.name + fits, batches, c.step_ms, c.samples_per_s, f"{ratio:.2f}×", f"{c.cost:.4g}"])
  estimates = estimated_costs({g.name: g.device_type for g in cluster.groups}, pred.sources, counts)
  if estimates:
    print("modeled costs this plan relies on:\n  " + "\n  ".join(estimates))
  print("\n".join(cost_source_lines(cluster, profiles, files)))
  source = "" if figures == "modeled" else f", {figures}"
  print(f"\nalternatives (predicted{source}; batch per device in group order):")
  print(table(["plan", "batches", "step ms", "samples/s", "vs chosen", "accuracy cost"], alt_rows))
  print(f"wrote {args.out}")
  return 0
