"""``qsync plan``: every group's per-device batch and per-op precisions (``planners.allocator.joint``)."""

from __future__ import annotations

import time

from planners.allocator import INT8_OPS, joint_plan, make_problem, plan_of, precision_counts
from planners.predictor import predict
from planners.report import estimated_costs, table
from qsync_cli.common import (
  add_model_argument,
  check_model,
  check_profiles_fit,
  load_json,
  load_profiles,
  progress,
)
from qsync_jax.cluster import ClusterSpec
from qsync_jax.train.task import load_task

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
  parser.add_argument("--train-precision", default="fp32", help="policy preset of the training groups")
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


def run(args) -> int:
  task = load_task(args.model)
  profiles = load_profiles(args.profile)
  check_model(profiles, task.name)
  cluster = ClusterSpec.load(args.cluster)
  check_profiles_fit(profiles, cluster)
  indicator = load_json(args.indicator, "indicator")
  training = args.training_groups.split(",") if args.training_groups else None
  problem = make_problem(cluster, profiles, indicator, training, args.train_precision, int8_op=args.int8_op)
  progress(
    f"{len(problem.op_names)} ops, {len(cluster.groups)} groups, global batch {cluster.global_batch}: "
    f"{args.batch} batch × precision search"
  )
  t0 = time.perf_counter()
  chosen, cands, search = joint_plan(problem, args.granularity, args.slack, args.batch)
  seconds = time.perf_counter() - t0
  alternatives = [c.to_json(problem) for c in cands]
  plan = plan_of(problem, chosen)
  pred = predict(cluster, profiles, plan)
  plan = plan_of(
    problem,
    chosen,
    {
      **pred.to_json(),
      "chosen": chosen.name,
      "samples_per_s": chosen.samples_per_s,
      "accuracy_cost": chosen.cost,
      "alternatives": alternatives,
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
  alt_rows = []
  for c in cands:
    batches = "/".join(str(b) for b in c.batches)
    ratio = c.samples_per_s / chosen.samples_per_s
    fits = "" if c.fits else " (does not fit)"
    alt_rows.append([c.name + fits, batches, c.step_ms, c.samples_per_s, f"{ratio:.2f}×", f"{c.cost:.4g}"])
  estimates = estimated_costs({g.name: g.device_type for g in cluster.groups}, pred.sources, counts)
  if estimates:
    print("modeled costs this plan relies on:\n  " + "\n  ".join(estimates))
  print("\nalternatives (predicted; batch per device in group order):")
  print(table(["plan", "batches", "step ms", "samples/s", "vs chosen", "accuracy cost"], alt_rows))
  print(f"wrote {args.out}")
  return 0
