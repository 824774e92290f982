"""``qsync plan``: allocate per-op precisions on the inference groups (greedy, DESIGN §5.4)."""

from __future__ import annotations

import time

from planners.allocator import dynamic_batch, greedy, make_problem
from planners.cli_common import (
  CALIBRATE_DEVICES_HELP,
  CALIBRATE_HELP,
  calibrated_profiles,
  check_model,
  load_json,
  load_profiles,
  progress,
  table,
)
from planners.replay import CALIBRATION_DEVICES, predict
from qsync_jax.cluster import ClusterSpec
from qsync_jax.tasks import load_task

HELP = "Plan one precision policy per device group: fastest that fits, then recover sensitive ops."


def add_arguments(parser) -> None:
  parser.add_argument("--model", required=True, help="example name or package.module:make_task")
  parser.add_argument("--cluster", required=True, help="cluster spec JSON/YAML")
  parser.add_argument("--indicator", required=True, help="sensitivity JSON from `qsync indicator`")
  parser.add_argument("--profile", required=True, nargs="+", help="profile JSON(s) from `qsync profile`")
  parser.add_argument(
    "--training-groups",
    help="comma-separated groups that keep --train-precision (default: fastest device type)",
  )
  parser.add_argument("--train-precision", default="fp32", help="policy preset of the training groups")
  parser.add_argument("--out", required=True, help="output plan JSON")
  parser.add_argument("--calibrate", action="append", default=[], metavar="GROUP=MS", help=CALIBRATE_HELP)
  parser.add_argument(
    "--calibrate-devices", choices=CALIBRATION_DEVICES, default="group", help=CALIBRATE_DEVICES_HELP
  )


def run(args) -> int:
  task = load_task(args.model)
  profiles = load_profiles(args.profile)
  check_model(profiles, task.name)
  cluster = ClusterSpec.load(args.cluster)
  profiles = calibrated_profiles(cluster, profiles, args.calibrate, args.calibrate_devices)
  indicator = load_json(args.indicator, "indicator")
  training = args.training_groups.split(",") if args.training_groups else None
  problem = make_problem(cluster, profiles, indicator, training, args.train_precision)
  progress(f"{len(problem.op_names)} ops, {len(problem.inference)} inference group(s): greedy allocation")
  t0 = time.perf_counter()
  alloc = greedy(problem)
  seconds = time.perf_counter() - t0
  batches, dbs_ms = dynamic_batch(cluster, profiles, args.train_precision)
  pred = predict(cluster, profiles, alloc.plan)
  plan = alloc.plan
  plan = type(plan)(
    plan.policies,
    plan.batch_per_device,
    {
      **plan.predictions,
      **pred.to_json(),
      "replays": alloc.replays,
      "planning_s": seconds,
      "dynamic_batch_baseline": {"batch_per_device": batches, "step_ms": dbs_ms},
    },
  )
  plan.save(args.out)
  levels = plan.predictions["levels"]
  rows = []
  for g in cluster.groups:
    counts = {}
    for p in levels.get(g.name, {}).values():
      counts[p] = counts.get(p, 0) + 1
    mix = ", ".join(f"{p}×{n}" for p, n in sorted(counts.items())) or args.train_precision + " (all)"
    rows.append(
      [g.name, g.device_type, mix, pred.group_step_ms[g.name], pred.memory_bytes[g.name] / 1e9, g.memory_gb]
    )
  print(table(["group", "device", "precisions", "step ms", "mem GB", "limit GB"], rows))
  print(
    f"synchronous step {pred.step_ms:.3f} ms (target T* {alloc.target_ms:.3f} ms), Σ Ω {alloc.omega:.4g}; "
    f"{alloc.replays} replays in {seconds:.3f} s"
  )
  if alloc.straggles:
    print("NOTE: even the fastest plan of the inference groups is slower than the training groups.")
  print(f"dynamic batch sizing baseline: batches {batches}, step {dbs_ms:.3f} ms")
  print(f"wrote {args.out}")
  return 0
