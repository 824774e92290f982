"""``qsync predict``: predicted step time and memory of a plan on a cluster (replay)."""

from __future__ import annotations

import json

from qsync_cli.common import add_model_argument
from qsync_jax.errors import PlanError
from qsync_jax.jsonio import write_atomic, write_text_atomic

HELP = "Predict the synchronous step time and per-group peak memory of a plan (replay simulator)."


def add_arguments(parser) -> None:
  add_model_argument(parser)
  parser.add_argument("--cluster", required=True, help="cluster spec JSON/YAML")
  parser.add_argument("--plan", required=True, help="plan JSON (from `qsync plan` or hand-written)")
  parser.add_argument("--profile", required=True, nargs="+", help="profile JSON(s) from `qsync profile`")
  parser.add_argument("--trace", help="write a Chrome trace JSON (open in ui.perfetto.dev)")
  parser.add_argument("--png", help="write a PNG timeline")
  parser.add_argument("--json", help="write the prediction as JSON")


def run(args) -> int:
  from planners.inputs import check_model, check_profiles_fit, load_profiles
  from planners.plan_report import cost_source_lines
  from planners.predictor import limits, predict, save_chrome_trace, save_png
  from planners.predictor.step_error import step_error_for
  from planners.report import table
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.plan import Plan
  from qsync_jax.train.task import load_task

  # Input files first: a bad one is named before the model is built.
  cluster = ClusterSpec.load(args.cluster)
  plan = Plan.load(args.plan)
  profiles, files = load_profiles(args.profile)
  check_profiles_fit(profiles, cluster, plan)
  task = load_task(args.model)
  check_model(profiles, task.name)
  pred = predict(cluster, profiles, plan)
  rows = [
    [g.name, g.device_type, g.count, pred.group_compute_ms[g.name], pred.group_step_ms[g.name]]
    + [pred.memory_bytes[g.name] / 1e9, g.memory_gb, pred.sources[g.name]]
    if g.name in pred.group_step_ms
    else [g.name, g.device_type, g.count, "(sits out)", "-", "-", g.memory_gb, "-"]
    for g in cluster.groups
  ]
  print(table(["group", "device", "n", "compute ms", "step ms", "mem GB", "limit GB", "costs"], rows))
  error = step_error_for(sum(g.count for g in plan.apply_to(cluster).groups))
  step = error.step_text(pred.step_ms) if error else f"{pred.step_ms:.3f} ms"
  print(f"modeled: synchronous step {step}; collectives {pred.comm_ms:.3f} ms")
  if error is not None:
    print(f"multi-device step error: {error.note()}")
  print(f"modeled: {limits(pred).line()}")
  print("\n".join(cost_source_lines(cluster, profiles, files)))
  if args.trace:
    save_chrome_trace(pred, args.trace)
    print(f"wrote {args.trace}")
  if args.png:
    save_png_atomic(save_png, pred, args.png)
    print(f"wrote {args.png}")
  if args.json:
    write_text_atomic(args.json, json.dumps(pred.to_json(), indent=2) + "\n", "--json", PlanError)
    print(f"wrote {args.json}")
  over = [g for g in pred.memory_bytes if pred.memory_bytes[g] > pred.memory_limit_bytes[g]]
  if over:
    raise PlanError(
      f"the plan does not fit in memory on group(s) {over} (predicted peak above memory_gb, table above). "
      "Fix: plan again (`qsync plan` keeps every group within its memory), or lower their batch_per_device."
    )
  return 0


def save_png_atomic(save_png, pred, path: str, what: str = "--png") -> None:
  """``save_png(pred, tmp)`` written to ``path`` by ``qsync_jax.jsonio.write_atomic``: ``path``
  holds its old image or the new one, never part of one; a failed write is one ``PlanError``
  naming ``path`` as ``what``."""
  write_atomic(path, lambda tmp: save_png(pred, tmp), what, PlanError, suffix=".png")
