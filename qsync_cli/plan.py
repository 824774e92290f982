"""``qsync plan``: every group's per-device batch and per-op precisions (``planners.allocator.joint``)."""

from __future__ import annotations

import time

from planners.allocator import INT8_OPS
from qsync_cli.common import (
  add_model_argument,
  check_model,
  check_profiles_fit,
  cost_source_lines,
  load_json,
  load_profiles,
  progress,
)
from qsync_jax.devices import DEVICES
from qsync_jax.errors import PlanError, QsyncError, UnsupportedPrecisionError
from qsync_jax.precision import PRESETS

# The default --train-precision of a training group's device type: the first of these it runs
# (bf16 mixed precision on Ampere and newer; fp16 mixed precision, with loss scaling, on a V100
# or a T4, whose tensor cores have no bf16; else fp32).
TRAIN_PRECISION_ORDER = ("bf16", "fp16", "fp32")

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
    "of several types, the first of these that all of them run)",
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
    default="int8_fwd",
    help="what an op planned at int8 runs: int8_fwd (QSync's op: int8 forward, fp16 backward) or int8 on all legs",
  )
  parser.add_argument("--slack", type=float, default=0.02, help="throughput given up for accuracy (fraction)")
  parser.add_argument("--granularity", type=int, default=1, help="per-device batches are multiples of this")
  parser.add_argument("--out", required=True, help="output plan JSON")


def mix(counts: dict[str, int]) -> str:
  return ", ".join(f"{p}×{n}" for p, n in sorted(counts.items()))


def train_precision(cluster, training: tuple[str, ...], preset: str | None) -> str:
  """The policy preset the ``training`` groups of ``cluster`` run: ``preset`` (``--train-precision``)
  when given, after checking that it is a preset every training group's device type runs; else the
  first of ``TRAIN_PRECISION_ORDER`` that all of their device types run (``DEVICES[type].precisions``)."""
  types = sorted({cluster.group(name).device_type for name in training})
  if preset is None:
    return next(p for p in TRAIN_PRECISION_ORDER if all(p in DEVICES[t].precisions for t in types))
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


def run(args) -> int:
  from planners.allocator import joint_plan, make_problem, plan_of, precision_counts
  from planners.allocator.greedy import default_training_groups
  from planners.allocator.summary import summarize
  from planners.indicator import check_values
  from planners.predictor import predict
  from planners.report import estimated_costs, table
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.train.task import load_task

  # Arguments and input files first: a bad one is named before the model is built.
  if args.slack < 0:
    raise QsyncError(f"--slack {args.slack} must be 0 or more. Fix: pass e.g. --slack 0.02.")
  if args.granularity < 1:
    raise QsyncError(f"--granularity {args.granularity} must be at least 1. Fix: pass e.g. --granularity 1.")
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
  preset = train_precision(cluster, training, args.train_precision)
  profiles, files = load_profiles(args.profile, with_paths=True)
  check_profiles_fit(profiles, cluster)
  indicator = load_json(args.indicator, "indicator")
  check_values(indicator, args.indicator)
  task = load_task(args.model)
  check_model(profiles, task.name)
  check_indicator_model(indicator, args.indicator, task.name, args.model)
  problem = make_problem(cluster, profiles, indicator, training, preset, int8_op=args.int8_op)
  progress(
    f"{len(problem.op_names)} ops, {len(cluster.groups)} groups, global batch {cluster.global_batch}: "
    f"{args.batch} batch × precision search; training group(s) {', '.join(training)} at {preset}"
  )
  t0 = time.perf_counter()
  chosen, cands, search = joint_plan(problem, args.granularity, args.slack, args.batch)
  seconds = time.perf_counter() - t0
  alternatives = [c.to_json(problem) for c in cands]
  plan = plan_of(problem, chosen)
  pred = predict(cluster, profiles, plan)
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
  plan.save(args.out)
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
  modeled = sorted({g for g, src in pred.sources.items() if src.startswith("modeled")})
  label = f" (modeled costs for {', '.join(modeled)})" if modeled else ""
  print(
    f"chosen: {chosen.name}; predicted step {chosen.step_ms:.3f} ms, {chosen.samples_per_s:.1f} samples/s"
    f"{label}, accuracy cost {chosen.cost:.4g}; {search.replays} replays in {seconds:.2f} s"
  )
  print("\n".join(summary.lines()))
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
  print("\nalternatives (predicted; batch per device in group order):")
  print(table(["plan", "batches", "step ms", "samples/s", "vs chosen", "accuracy cost"], alt_rows))
  print(f"wrote {args.out}")
  return 0
