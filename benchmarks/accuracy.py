"""Accuracy of the planner's candidates over several seeds → ``docs/results.md``.

  python -m benchmarks.accuracy                       # vgg (digits) and lm (stdlib), seeds 0 1 2
  python -m benchmarks.accuracy --tasks vgg --seeds 0 1 2 3 4 --steps 300
  python -m benchmarks.accuracy --testbed gpt         # on ≥ 2 GPUs: benchmarks.accuracy_gpu

``--testbed gpt`` runs the realistic testbed of ``benchmarks.accuracy_gpu`` (a 25 M-parameter
GPT on the standard library's source): its ``plan``, ``compare`` and ``report`` steps with that
module's defaults. The rest of this docstring is the CPU testbed (``--testbed demo``).

For each task it runs the ``qsync demo`` pipeline once (fp32 pre-training → gradient
indicator → traced ops with V100/T4 costs modeled → the joint planner, for the pool at
``--pool-batch-per-device``), then trains every candidate the demo trains — the training
groups alone, dynamic batching (fp32), uniform low precision on the T4 group, QSync's
precision-only plan, the joint plan — with its precisions and batch shares on 4 simulated CPU
devices at ``--batch-per-device``, once per seed, and evaluates the fp32 master weights on
the held-out split.

Prints a table (mean ± std over seeds; ratio against dynamic batching, the full-precision
plan, of the same run), appends JSON lines to ``benchmarks/results/accuracy.jsonl`` and
rewrites ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import optax

from benchmarks.common.result_rows import ROOT, mean_std, results_path, script_dir, write_section
from examples import demo
from qsync_jax.train.task import get_task

TARGET_POINTS = 0.3
"""QSync's target: ≥ uniform low precision + 0.3 points and within 0.3 points of full precision."""

FULL = "dynamic batching"
"""The full-precision (fp32) candidate the others are compared with."""


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.accuracy",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--testbed", choices=("demo", "gpt"), default="demo")
  parser.add_argument("--tasks", nargs="+", default=["vgg", "lm"])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch-per-device", type=int, default=16, help="as `qsync demo`")
  parser.add_argument("--pool-batch-per-device", type=int, default=128, help="as `qsync demo`")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--pretrain-steps", type=int, default=40)
  parser.add_argument("--indicator-batches", type=int, default=16)
  parser.add_argument("--eval-max-batches", type=int, default=8, help="held-out batches of 256 (LM)")
  parser.add_argument("--jsonl", default=results_path("accuracy"))
  parser.add_argument("--doc", default=os.path.join(ROOT, "docs", "results.md"))
  return parser.parse_args(argv)


def run_task(name, args, devices, say):
  """Plans once, trains every configuration for every seed; returns (planned, trained, cluster)."""
  task = get_task(name)
  cluster, cpu = demo.demo_cluster(args.pool_batch_per_device), demo.demo_cluster(args.batch_per_device)
  stage_args = argparse.Namespace(
    pretrain_steps=args.pretrain_steps, seed=args.seeds[0], indicator_batches=args.indicator_batches
  )
  indicator = demo.stage_indicator(task, stage_args, say)
  profiles = demo.stage_profile(task, args.pool_batch_per_device, say)
  planned = demo.stage_plan(cluster, profiles, indicator, say)
  plans = {
    k: demo.cpu_plan(plan, cluster, cpu)
    for k, (plan, _, cand) in planned.items()
    if k in demo.CONFIGS and cand.fits
  }
  eval_max = args.eval_max_batches if name == "lm" else None
  trained = demo.stage_train(
    task, cpu, plans, devices, args.steps, optax.adam(args.lr), args.seeds, say, eval_max
  )
  return planned, trained, cluster, profiles


def _metric(row, metric: str) -> float:
  return {
    "accuracy": 100 * row["eval_accuracy"],
    "loss": row["eval_loss"],
    "perplexity": math.exp(row["eval_loss"]),
  }[metric]


def summarize(trained):
  """``{config: {metric: (mean, std)}}`` over seeds; accuracies in points (×100)."""
  out = {}
  for config, rows in trained.items():
    out[config] = {m: mean_std([_metric(r, m) for r in rows]) for m in ("accuracy", "loss", "perplexity")}
  return out


def jsonl_rows(task, summary, device, date):
  import jax

  rows = []
  for config, metrics in summary.items():
    for metric, (mean, std) in metrics.items():
      base = summary[FULL][metric][0]
      rows.append(
        {
          "benchmark": "accuracy",
          "case": f"{task}/{config}",
          "device": device,
          "jax_version": jax.__version__,
          "date": date,
          "metric": f"held-out {metric}",
          "value": mean,
          "std": std,
          "baseline": base,
          "ratio": mean / base if base else float("nan"),
        }
      )
  return rows


def verdict(summary) -> str:
  """Whether the QSync plan met the target, and whether seeds can resolve the differences."""
  names = ("joint", "uniform low precision", FULL)
  if any(c not in summary for c in names):
    return "not evaluated (a configuration is missing)"
  (q, q_sd), (u, u_sd), (f, f_sd) = (summary[c]["accuracy"] for c in names)
  over_uniform, gap = q - u, q - f
  ok = over_uniform >= TARGET_POINTS and abs(gap) <= TARGET_POINTS
  text = (
    f"{'MET' if ok else 'MISSED'}: joint − uniform low precision = {over_uniform:+.2f} points "
    f"(target ≥ +{TARGET_POINTS}), joint − fp32 ({FULL}) = {gap:+.2f} points (target within ±{TARGET_POINTS})"
  )
  spread = max(q_sd, u_sd, f_sd)
  if spread > TARGET_POINTS:
    text += (
      f". The seed-to-seed std (up to {spread:.2f} points) exceeds the {TARGET_POINTS}-point margins, so "
      "these seeds cannot resolve the target either way"
    )
  return text


def source_commit() -> str:
  """The checkout's commit (``QSYNC_COMMIT`` when run from an exported tree)."""
  import subprocess

  if os.environ.get("QSYNC_COMMIT"):
    return os.environ["QSYNC_COMMIT"]
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"
  except OSError:
    return "unknown"


NOT_RUN_IN_CI = (
  "<!-- not run in CI: trains the demo's plans once per task and seed (each a 3-5 minute demo run) -->"
)
"""The marker before the command in ``docs/results.md`` (``tests/docs/blocks.py``)."""


def markdown(results, args, device, date, command) -> str:
  lines = [
    f"### The joint plan against its alternatives (CPU numerics, modeled pool): {', '.join(results)}",
    "",
    f"Generated by `benchmarks/accuracy.py` on {date} ({device}) at commit {source_commit()}; command:",
    "",
    NOT_RUN_IN_CI,
    "```",
    command,
    "```",
    "",
    "Setup (the `qsync demo` pipeline): 4 simulated CPU devices in two groups, 2 × V100 (`training`)",
    f"and 2 × T4 (`inference`), planned at {args.pool_batch_per_device} per device and trained at "
    f"{args.batch_per_device} per device with each plan's batch shares, {args.steps} Adam steps (lr {args.lr}), "
    f"seeds {args.seeds}. The plans are made once per task (seed {args.seeds[0]}): {args.pretrain_steps} fp32 "
    f"pre-training steps, the gradient indicator on {args.indicator_batches} batches, V100/T4 costs modeled "
    "from the catalog on the traced ops, and the joint planner. Numerics run on the CPU exactly as planned "
    "per group; the held-out metrics are of the fp32 master weights. `uniform low precision` is QSync's int8 "
    "op (int8 forward, fp16 backward) on every op of the T4 group.",
    "",
  ]
  for task, (summary, planned, op_names) in results.items():
    lm = task == "lm"
    kind = "held-out token accuracy (%)" if lm else "held-out accuracy (%)"
    extra = " perplexity |" if lm else ""
    lines += [
      f"#### `{task}`",
      "",
      f"| config | T4 fwd precisions | pool batch V100/T4 | predicted samples/s (modeled) | {kind} | held-out loss |{extra}",
      "|---|---|---|---|---|---|" + ("---|" if lm else ""),
    ]
    for config, m in summary.items():
      plan, _, cand = planned[config]
      mix = demo.precision_mix(plan, "inference", op_names) if cand.batches[1] else "(sits out)"
      row = (
        f"| {config} | {mix} | {'/'.join(map(str, cand.batches))} | {cand.samples_per_s:.0f} | "
        f"{m['accuracy'][0]:.2f} ± {m['accuracy'][1]:.2f} | {m['loss'][0]:.4f} ± {m['loss'][1]:.4f} |"
      )
      if lm:
        row += f" {m['perplexity'][0]:.3f} ± {m['perplexity'][1]:.3f} |"
      lines.append(row)
    lines += ["", f"Target: {verdict(summary)}.", ""]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.testbed == "gpt":
    from benchmarks import accuracy_gpu

    plans = os.path.join(script_dir("accuracy_gpu"), "plans_int8")
    seeds = [str(s) for s in args.seeds]
    for step in (["plan", "--plans", plans], ["compare", "--plans", plans, "--seeds", *seeds], ["report"]):
      if accuracy_gpu.main(step) != 0:
        return 1
    return 0
  devices = demo.simulated_devices(demo.NUM_DEVICES)
  say = demo.Progress()
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  device = "this machine's CPU (2 cores, shared), 4 simulated devices"
  command = "python -m benchmarks.accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
  results = {}
  t0 = time.perf_counter()
  for name in args.tasks:
    planned, trained, cluster, profiles = run_task(name, args, devices, say)
    summary = summarize(trained)
    results[name] = (summary, planned, profiles["cpu"].op_names)
    rows = jsonl_rows(name, summary, device, date)
    for row in rows:  # the per-seed values behind each mean
      config, metric = row["case"].split("/", 1)[1], row["metric"].split()[-1]
      row["seeds"] = list(args.seeds)
      row["values"] = [_metric(r, metric) for r in trained[config]]
    print(f"\n{name}: mean ± std over seeds {args.seeds}")
    for config, m in summary.items():
      ratio = m["accuracy"][0] / summary[FULL]["accuracy"][0]
      print(
        f"  {config:22s} accuracy {m['accuracy'][0]:6.2f} ± {m['accuracy'][1]:.2f}  (×{ratio:.4f} of {FULL})  "
        f"loss {m['loss'][0]:.4f} ± {m['loss'][1]:.4f}  perplexity {m['perplexity'][0]:.3f}"
      )
    print(f"  {verdict(summary)}")
    # Written after every task, so a later task's failure keeps the earlier results.
    os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
    with open(args.jsonl, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
    os.makedirs(os.path.dirname(args.doc), exist_ok=True)
    write_section(args.doc, markdown(results, args, device, date, command), " ".join(args.tasks))
  say(f"done in {time.perf_counter() - t0:.0f}s; wrote {args.doc} and appended to {args.jsonl}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
