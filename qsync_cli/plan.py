"""``qsync plan``: every group's per-device batch and per-op precisions (``planners.planning.plan_cluster``).

With ``--measured RUN``, each group is costed from a profile calibrated to its compute measured
in a ``qsync train`` run (``planners.calibrate``), written next to ``--out`` as
``profile-GROUP.json`` so that ``qsync plan --profile profile-*.json`` plans the same offline.
"""

from __future__ import annotations

from planners.allocator import INT8_OPS
from qsync_cli.common import add_model_argument, progress

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
    help="comma-separated groups that keep --train-precision (default: the groups of the device type "
    "with the highest fp16 peak, ties broken by memory bandwidth, then memory)",
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
  parser.add_argument(
    "--optimizer-update",
    choices=("auto", "replicated", "sharded"),
    default="auto",
    help="where the optimizer runs: replicated (every device updates every parameter), sharded (ZeRO-1: each "
    "device updates and holds 1/N of the parameters' optimizer state; the fp32 sync only), auto: the "
    "planner searches both (default)",
  )
  parser.add_argument(
    "--sync",
    choices=("fp32", "bf16", "fp16", "global_qsgd", "auto"),
    default="fp32",
    help="the gradient sync the plan is made for and `qsync train` runs (qsync_jax.sync; its payload and "
    "(de)quantize passes priced): fp32 (default), bf16 or fp16 all-reduce, global_qsgd (integer); auto: "
    "the planner searches all and takes the least accuracy cost within --slack of the fastest, each "
    "payload charged its accuracy cost as `qsync indicator` measured it (not measured: nothing, and the widest "
    "payload wins). (selsync and qsdp build "
    "their own step, which the planner does not model.)",
  )
  parser.add_argument("--out", required=True, help="output plan JSON")


def request_of(args):
  """The ``planners.planning.PlanRequest`` of parsed ``args``."""
  from planners.planning import PlanRequest

  return PlanRequest(
    model=args.model,
    cluster=args.cluster,
    indicator=args.indicator,
    profiles=tuple(args.profile),
    out=args.out,
    training_groups=tuple(args.training_groups.split(",")) if args.training_groups else None,
    train_precision=args.train_precision,
    train_budget=args.train_budget,
    batch=args.batch,
    int8_op=args.int8_op,
    slack=args.slack,
    granularity=args.granularity,
    measured=args.measured,
    optimizer_update=args.optimizer_update,
    sync=args.sync,
  )


def run(args) -> int:
  from planners.plan_report import plan_report
  from planners.planning import plan_cluster

  result = plan_cluster(request_of(args), progress)
  result.save(args.out)
  print("\n".join(plan_report(result)))
  print(f"wrote {args.out}")
  return 0
