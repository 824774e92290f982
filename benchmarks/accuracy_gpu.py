"""The realistic accuracy testbed: a GPT-style byte LM of ~25 M parameters on the Python
standard library's source, trained on GPUs.

* ``sweep``: the model on one device under each uniform policy (every op: token and position
  embeddings, q/k/v/out projections, both attention products, the MLP and the head) over
  seeds: does uniform low precision cost held-out loss beyond the seed spread? ``auto``: the
  policy ``planners.allocator.auto_policy`` measures on this GPU (8-bit where it pays, else bf16);
  ``int8_dense`` / ``fp8_dense``: that preset on every Dense, the rest bf16 (``dense_policy``).
* ``compare`` (``benchmarks.accuracy --testbed gpt``): the planner's candidates trained on
  two devices with their batch shares and precisions.

The model (``gpt_25m``): ``examples.models.transformer.TransformerLM`` with d = 512, 8 heads,
8 pre-LN blocks, sequence 256, byte vocabulary (25.3 M parameters), on the first 24 MB of the
standard library's source (``examples.data.stdlib_text``; the last 10 % held out). Training:
AdamW (weight decay 0.1, gradients clipped at global norm 1), linear warmup then cosine decay
to a tenth of the peak learning rate (1e-3 after 100 warmup steps, 1,000 steps), 64 sequences
(16,384 tokens) per step. Held-out metrics are over the first 4,096 windows (1 M tokens) of the
held-out split.

* ``wide`` (``benchmarks.accuracy_wide``): byte LMs of width 2048, a GPT and a Llama-style model,
  where ``auto_policy`` keeps 8-bit: bf16, int8 / fp8 on every Dense, auto with its default accuracy
  budget and auto speed-only, over paired seeds on one GPU.

  python -m benchmarks.accuracy_gpu sweep [--policies fp32 int8_fwd int8 fp8 auto] [--lr 1e-3]
  python -m benchmarks.accuracy_gpu plan; python -m benchmarks.accuracy_gpu compare
  python -m benchmarks.accuracy_gpu wide [--models gpt llama] [--seeds 0 1 2]   # lr 5e-4, batch 32
  python -m benchmarks.accuracy_gpu wide --models llama --wide-policies bf16 auto auto_speed \
      int8_dense fp8_dense --skip-done    # only the seeds the jsonl lacks; every policy timed again
  python -m benchmarks.accuracy_gpu wide --search-only     # the search alone, its phases printed
  python -m benchmarks.accuracy_gpu report        # rewrites the testbeds' sections of docs/results.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import optax

from benchmarks import accuracy_wide
from benchmarks.common import zoo
from benchmarks.common.result_rows import (
  ROOT,
  append_rows,
  mean_std,
  result_row,
  results_path,
  script_dir,
  write_section,
)

RESULTS = results_path("accuracy_gpu")
MODEL = "gpt_25m"
"""The testbed's model in ``benchmarks.common.zoo.MODELS`` (its options: ``zoo.GPT_25M``)."""
EVAL_BATCHES = 16
BATCH = 64


def optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
  """AdamW on a warmup + cosine schedule, gradients clipped at global norm 1."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def pool_cluster(batch_per_device: int):
  """1 × V100 (``training``, fp32) + 1 × T4 (``inference``), the paper's kind of pool, modeled
  from the catalog; its plans run on two local devices."""
  from qsync_jax.cluster import ClusterSpec, DeviceGroup

  return ClusterSpec(
    (
      DeviceGroup("training", "V100", 1, 32.0, batch_per_device, link_gbps=100.0),
      DeviceGroup("inference", "T4", 1, 16.0, batch_per_device, link_gbps=32.0),
    ),
    name="gpt-v100-t4",
  )


def write_row(args, row: dict) -> None:
  append_rows(args.jsonl, [row])
  if args.out:
    append_rows(os.path.join(args.out, "accuracy_gpu.jsonl"), [row])


def trained_rows(args, mode: str, trained: dict, extra: dict | None = None) -> list[dict]:
  device = jax.devices()[0].device_kind
  rows = []
  for config, per_seed in trained.items():
    for r in per_seed:
      rows.append(
        result_row(
          "accuracy_gpu",
          f"{mode}/{config}",
          "held-out loss",
          r["eval_loss"],
          None,
          device,
          seed=r["seed"],
          steps=args.steps,
          lr=args.lr,
          batch=args.batch,
          eval_accuracy=r["eval_accuracy"],
          train_loss=r["train_loss"],
          seconds=r["cpu_seconds"],
          steps_run=r["steps_run"],
          setup=setup_of(args),
          **(extra or {}).get(config, {}),
        )
      )
  return rows


def dense_policy(preset: str):
  """``preset`` (``"int8"``, ``"fp8"``) on every ``Dense`` / ``DenseGeneral`` (q/k/v/out
  projections, the MLP, the head), the rest bf16 with the attention products fused: what
  ``auto_policy`` keeps on an H200 at GPT widths 2048 and 4096 (``docs/results.md``), on this
  testbed's model."""
  import dataclasses

  from benchmarks.e2e import DENSE_KINDS, kinds_policy
  from qsync_jax.precision import OpPolicy

  return dataclasses.replace(kinds_policy(preset, DENSE_KINDS), default=OpPolicy.preset("bf16"))


def sweep(args) -> int:
  """Uniform policies on one device, each seed: the same path as the pool's plans."""
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.plan import Plan

  task = zoo.task(MODEL)
  cluster = ClusterSpec.uniform("H100", 1, args.batch, memory_gb=80.0, name="gpu")
  named = {f"{p}_dense": dense_policy(p) for p in ("int8", "fp8")}
  plans = {
    p: (Plan() if p == "fp32" else Plan.uniform(cluster, named.get(p, p)))
    for p in args.policies
    if p != "auto"
  }
  if "auto" in args.policies:  # the policy planners.allocator.auto_policy measures on this GPU
    from planners.allocator import auto_policy

    found = auto_policy(task, args.batch, progress=print)
    print("\n".join(found.summary()))
    if found.chosen:
      plans["auto"] = Plan.uniform(cluster, found.policy)
    else:  # every op stays bf16: the bf16 sweep's program, not trained twice
      print("auto: no op pays on this GPU at this model's sizes; its policy is the bf16 step's")
  train_and_record(args, "sweep", task, cluster, plans, jax.devices()[:1])
  return 0


def train_and_record(args, mode: str, task, cluster, plans: dict, devices) -> None:
  """Trains each plan over ``args.seeds`` (``examples.demo.stage_train``), writing each seed's
  row as soon as it is done (a run cut short keeps what it has)."""
  from examples import demo

  def record(name, result):
    extra = {name: {"batch_per_device": dict(plans[name].batch_per_device)}}
    for row in trained_rows(args, mode, {name: [result]}, extra):
      write_row(args, row)

  opt = optimizer(args.lr, args.steps, args.warmup)
  demo.stage_train(
    task,
    cluster,
    plans,
    devices,
    args.steps,
    opt,
    args.seeds,
    print,
    EVAL_BATCHES,
    args.log_every,
    on_seed=record,
  )


def plan(args) -> int:
  """Indicator on the early weights, modeled V100/T4 costs, the joint planner; saves the
  indicator table and every candidate's plan under ``--plans``."""
  from examples import demo
  from planners.indicator import compute, initial_variables, load, save

  task = zoo.task(MODEL)
  os.makedirs(args.plans, exist_ok=True)
  say = demo.Progress(sys.stdout)
  if args.indicator:
    indicator = load(args.indicator)
  else:
    opt = optimizer(args.lr, args.steps, args.warmup)
    say(f"indicator: the first {args.indicator_after} fp32 steps (seed {args.seeds[0]}), then probing")
    variables = initial_variables(task, args.seeds[0], args.indicator_after, args.batch, opt)
    stream = task.train_batches(32, args.seeds[0] + 1000)
    batches = [next(stream) for _ in range(args.indicator_batches)]
    indicator = compute(task, variables, batches, ("gradient",), ("int8", "fp16"), seed=args.seeds[0])[
      "gradient"
    ]
  save(indicator, os.path.join(args.plans, "indicator.json"))
  cluster = pool_cluster(args.batch // 2)
  profiles = demo.stage_profile(task, args.batch // 2, say)
  planned = demo.stage_plan(cluster, profiles, indicator, say, int8_op=args.int8_op)
  for name, (p, _, cand) in planned.items():
    if name in demo.CONFIGS and cand.fits:
      p.save(os.path.join(args.plans, demo.file_name(name) + ".json"))
  return 0


def compare(args) -> int:
  """The saved plans trained on two devices, every seed."""
  from examples import demo
  from qsync_jax.plan import Plan

  task = zoo.task(MODEL)
  cluster = pool_cluster(args.batch // 2)
  plans = {}
  for name in args.configs:
    with open(os.path.join(args.plans, demo.file_name(name) + ".json")) as f:
      plans[name] = Plan.from_json(json.load(f))
  train_and_record(args, "compare", task, cluster, plans, jax.devices()[:2])
  return 0


def summarize(rows: list[dict], mode: str, baseline: str) -> list[dict]:
  """Per config of ``mode``: held-out loss and token accuracy (mean ± std over seeds), and the
  loss difference from ``baseline`` paired by seed (same initial weights and batches): mean,
  its standard error and the seeds it is over."""
  by_config: dict[str, dict[int, dict]] = {}
  for r in rows:
    if r["case"].startswith(mode + "/"):
      by_config.setdefault(r["case"].split("/", 1)[1], {})[r["seed"]] = r
  base = by_config.get(baseline, {})
  out = []
  for config, per_seed in by_config.items():
    seeds = sorted(per_seed)
    paired = [per_seed[s]["value"] - base[s]["value"] for s in seeds if s in base]
    diff, diff_sd = mean_std(paired) if paired else (float("nan"), float("nan"))
    out.append(
      {
        "config": config,
        "seeds": seeds,
        "loss": mean_std([per_seed[s]["value"] for s in seeds]),
        "accuracy": mean_std([100 * per_seed[s]["eval_accuracy"] for s in seeds]),
        "paired": (diff, diff_sd / len(paired) ** 0.5 if len(paired) > 1 else float("nan"), len(paired)),
        "batch_per_device": per_seed[seeds[0]].get("batch_per_device"),
      }
    )
  return out


def _table(summary: list[dict], baseline: str, batches: bool) -> list[str]:
  head = "| config | batch V100/T4 " if batches else "| config "
  lines = [
    head + f"| seeds | held-out loss | token accuracy (%) | loss − {baseline}, paired (± s.e.) |",
    "|---|" + ("---|" if batches else "") + "---|---|---|---|",
  ]
  for s in summary:
    (loss, loss_sd), (a, a_sd), (d, se, n) = s["loss"], s["accuracy"], s["paired"]
    if s["config"] == baseline:
      paired = "–"
    else:
      paired = f"{d:+.4f} ± {se:.4f} ({n} seeds)" if n > 1 else f"{d:+.4f} (1 seed)"
    cell = "/".join(str(v) for v in (s["batch_per_device"] or {}).values()) + " | " if batches else ""
    seeds = ",".join(map(str, s["seeds"]))
    lines.append(
      f"| {s['config']} | {cell}{seeds} | {loss:.4f} ± {loss_sd:.4f} | {a:.2f} ± {a_sd:.2f} | {paired} |"
    )
  return lines


def markdown(rows: list[dict], command: str) -> str:
  """The testbed's section of ``docs/results.md`` from its rows: per training setup, the
  ``sweep`` and ``compare`` tables."""
  model = __doc__.split("The model (``gpt_25m``): ", 1)[1].split("  python -m", 1)[0].strip()
  lines = [
    "### GPU testbed: a 25 M-parameter GPT on the standard library's source (H100)",
    "",
    f"Generated by `{command}` from `benchmarks/results/accuracy_gpu.jsonl`, whose rows come from "
    "`python -m benchmarks.accuracy_gpu sweep` (1 × H100) and `compare` (2 × H100); the plans from "
    "`plan` (1 × H100), in `benchmarks/results/accuracy_gpu/plans_*/`. Rows the file marks `superseded` (each says why) are left out.",
    "",
    "The model and training: " + model.replace("``", "`"),
    "",
    "`sweep`: uniform policies on one device, every op (embeddings, attention products and head "
    "included). `compare`: the planner's candidates for a modeled 1 × V100 (`training`, fp32) + "
    "1 × T4 pool, planned at half the global batch per device with `--int8-op int8` (the int8 level runs int8 on every "
    "leg), run on two H100s with their batch shares and precisions. Both train through the "
    "trainer's step (`qsync_jax.train.train_step`, loss scaling where a leg is fp16) unless the setup "
    "says otherwise; loss differences are paired by seed (the same initial weights and batches).",
    "",
  ]
  setups = list(dict.fromkeys(r.get("setup", "") for r in rows))
  for setup in setups:
    of_setup = [r for r in rows if r.get("setup", "") == setup]
    lines += [f"**{setup}**", ""]
    for mode, baseline in (("sweep", "fp32"), ("compare", "dynamic batching")):
      summary = summarize(of_setup, mode, baseline)
      if summary:
        lines += [f"`{mode}`:", "", *_table(summary, baseline, mode == "compare"), ""]
  return "\n".join(lines) + "\n"


def setup_of(args) -> str:
  return f"make_train_step, lr {args.lr:g}, warmup {args.warmup}, batch {args.batch}, {args.steps} steps"


def report(args) -> int:
  with open(args.jsonl) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if not r.get("superseded")]  # a defect's rows, kept in the file with why
  command = "python -m benchmarks.accuracy_gpu report"
  narrow = [r for r in rows if not r["case"].startswith("wide/")]
  write_section(args.doc, markdown(narrow, command), "gpt")
  print(markdown(narrow, command))
  if len(narrow) < len(rows):
    write_section(args.doc, accuracy_wide.markdown(rows, command), "gpt-wide")
    print(accuracy_wide.markdown(rows, command))
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.accuracy_gpu", description=__doc__)
  ap.add_argument("mode", choices=["sweep", "plan", "compare", "wide", "report"])
  ap.add_argument(
    "--configs",
    nargs="+",
    default=[
      "dynamic batching",
      "uniform low precision",
      "joint",
      "QSync (precision only)",
      "training groups only",
    ],
    help="compare: the candidates to train, in this order",
  )
  ap.add_argument("--policies", nargs="+", default=["fp32", "int8_fwd", "int8", "fp8"])
  ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  ap.add_argument("--steps", type=int, default=1000)
  ap.add_argument("--warmup", type=int, default=100)
  ap.add_argument("--lr", type=float, help="peak learning rate (default 1e-3; wide: 5e-4)")
  ap.add_argument(
    "--models", nargs="+", choices=list(accuracy_wide.MODELS), default=list(accuracy_wide.MODELS)
  )
  ap.add_argument(
    "--wide-policies",
    nargs="+",
    choices=accuracy_wide.POLICIES,
    default=list(accuracy_wide.POLICIES),
    help="wide: the policies to train, in this order",
  )
  ap.add_argument(
    "--skip-done",
    action="store_true",
    help="wide: train only the seeds --jsonl lacks for this setup and device (a policy with rows keeps "
    "the 8-bit set they trained; the search runs only for an auto policy without rows, or for the Ω of "
    "a policy to train where no search row has an indicator table)",
  )
  ap.add_argument("--search-only", action="store_true", help="wide: the search alone (no training)")
  ap.add_argument("--eval-windows", type=int, default=2048, help="wide: held-out windows")
  ap.add_argument("--eval-batch", type=int, default=64, help="wide: held-out windows per batch")
  ap.add_argument("--tiny", action="store_true", help="wide: a CPU size (width 32, one block), seconds")
  ap.add_argument("--depth", type=int, help="wide: blocks per model (default 2; --tiny 1)")
  ap.add_argument(
    "--log-every", type=int, default=100, help="training loss every N steps; stop a seed on NaN"
  )
  ap.add_argument("--batch", type=int, help=f"global batch (sequences; default {BATCH}, wide: 32)")
  ap.add_argument("--indicator-after", type=int, default=100, help="fp32 steps before the indicator")
  ap.add_argument("--indicator-batches", type=int, default=16)
  ap.add_argument("--indicator", help="plan: an indicator JSON to use instead of computing one")
  ap.add_argument(
    "--int8-op", default="int8", help="plan: what the int8 level runs (planners.allocator.greedy.INT8_OPS)"
  )
  ap.add_argument("--plans", default=script_dir("accuracy_gpu"))
  ap.add_argument("--out", default=os.environ.get("OUT"))
  ap.add_argument("--jsonl", default=RESULTS)
  ap.add_argument(
    "--doc", default=os.path.join(ROOT, "docs", "results.md"), help="report: the file to update"
  )
  args = ap.parse_args(argv)
  wide = args.mode == "wide"
  args.lr = args.lr if args.lr is not None else (5e-4 if wide else 1e-3)
  args.batch = args.batch if args.batch is not None else (32 if wide else BATCH)
  if wide:
    args.policies = args.wide_policies
    return accuracy_wide.run(args, optimizer, lambda row: write_row(args, row))
  return {"sweep": sweep, "plan": plan, "compare": compare, "report": report}[args.mode](args)


if __name__ == "__main__":
  sys.exit(main())
