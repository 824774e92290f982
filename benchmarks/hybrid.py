"""Joint batch × precision plans on realistic hybrid pools, against every alternative (modeled).

For each pool (4 training + 4 inference devices of the catalog, at their datasheet memory,
100 Gbit/s links) and each model at real size (``benchmarks.common.zoo.HYBRID_MODELS``:
ResNet-50 at 224², BERT-base at sequence 128 and 512, a GPT-2-medium-sized LM at sequence
1024), the model's ops are traced (abstractly: nothing runs), every device is costed from the
catalog (``planners.predictor.modeled``), and ``planners.allocator.joint`` plans it. Printed and written as rows:
predicted samples/s, its ratio to dynamic batching, and the accuracy cost of the joint plan
and of every alternative. Every figure is **modeled** (catalog roofline + replay), not
measured. The sensitivities Ω are synthetic (a seeded exponential draw per op, int8 : fp8 :
16-bit = 1 : 1/2 : 1/50): the accuracy costs compare plans of one model, not models.

  python -m benchmarks.hybrid                    # all pools × models, ≈ 1-2 minutes on a CPU
  python -m benchmarks.hybrid --models bert_s128 --pools A100+T4
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.common.op_profile import base_profile, build, model_ops
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import HYBRID_MODELS
from planners.allocator.greedy import fastest_levels, make_problem, uniform_levels
from planners.allocator.joint import joint_plan, precision_counts
from planners.catalog import allreduce_ms
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import sync_step_ms
from planners.report import table
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import device

RESULTS = results_path("hybrid")

POOLS = {
  "V100+T4": ("V100", "T4", "fp32"),
  "A100+T4": ("A100", "T4", "bf16"),
  "H100+L4": ("H100", "L4", "bf16"),
  "A100+A10": ("A100", "A10", "bf16"),
}
"""pool → (training device, inference device, training precision). V100 has no bf16."""

LINK_GBPS = 100.0


def traced(name: str) -> dict:
  """The model's ops at its per-device batch, as ``benchmarks.diagnosis.roofline`` records them
  (``benchmarks.common.op_profile``)."""
  task, data, batch = build(name, tiny=False)
  ops, param_bytes = model_ops(task, data)
  return {
    "model": name,
    "device_type": "cpu",
    "batch_per_device": batch,
    "ops": [o.to_json() for o in ops],
    "param_bytes": param_bytes,
  }


def synthetic_omega(op_names, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  out = {}
  for name in op_names:
    s = float(rng.exponential())
    out[name] = {"int8": s, "fp8": s / 2, "fp16": s / 50, "bf16": s / 50, "fp32": 0.0}
  return {"omega": out}


def plan_pool(model: dict, pool: str, granularity: int, slack: float):
  train_dev, infer_dev, train_precision = POOLS[pool]
  base = base_profile(model)
  profiles = {d: modeled_profile(base, d) for d in (train_dev, infer_dev)}
  b = model["batch_per_device"]
  cluster = ClusterSpec(
    (
      DeviceGroup("train", train_dev, 4, device(train_dev).memory_gb, b, LINK_GBPS),
      DeviceGroup("infer", infer_dev, 4, device(infer_dev).memory_gb, b, LINK_GBPS),
    ),
    name=pool,
  )
  problem = make_problem(cluster, profiles, synthetic_omega(base.op_names), ["train"], train_precision)
  t0 = time.perf_counter()
  chosen, cands, search = joint_plan(problem, granularity, slack)
  return problem, chosen, cands, time.perf_counter() - t0, search


def limits(problem, search, model) -> tuple[float, float, float]:
  """What caps the inference group: its fastest per-device speed (any configuration the
  planner considers, at the spec's batch, compute alone) over a training device's, and the
  all-reduce of the gradients over the training devices alone and over all 8 (ms)."""
  b = model["batch_per_device"]
  j, gi = 0, problem.inference[0]
  rows = [uniform_levels(problem, j, p) for p in {p for lad in problem.ladders[j] for p, _ in lad}]
  rows.append(fastest_levels(problem, fit_memory=False)[0])
  alone = [predict_compute(search, gi, b, r) for r in rows]
  ratio = predict_compute(search, 0, b, None) / min(alone)
  grad_bytes = model["param_bytes"]
  return ratio, allreduce_ms(grad_bytes, 4, LINK_GBPS), allreduce_ms(grad_bytes, 8, LINK_GBPS)


def predict_compute(search, gi, b, row) -> float:
  """The group's step at batch ``b`` on one device with no all-reduce (ms)."""
  from planners.predictor.graph import Comm

  group = search.group_at(gi, b, row)
  comm = Comm(1, LINK_GBPS, search.p.bucket_bytes, 0.0, "tree")
  return sync_step_ms([group], comm, search.ev.cost)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.hybrid", description=__doc__.splitlines()[0])
  ap.add_argument("--models", default=",".join(HYBRID_MODELS))
  ap.add_argument("--pools", default=",".join(POOLS))
  ap.add_argument("--granularity", type=int, default=1)
  ap.add_argument("--slack", type=float, default=0.02)
  args = ap.parse_args(argv)
  device = jax.devices()[0].device_kind
  rows, lines, summary = [], [], []
  for name in args.models.split(","):
    model = traced(name)
    for pool in args.pools.split(","):
      problem, chosen, cands, seconds, search = plan_pool(model, pool, args.granularity, args.slack)
      speed, ar4, ar8 = limits(problem, search, model)
      case = f"{pool}/{name}"
      dyn = next((c for c in cands if c.name == "dynamic batching"), None)
      counts = precision_counts(problem, chosen).get("infer", {})
      mix = ", ".join(f"{p}×{n}" for p, n in sorted(counts.items())) or "(sits out)"
      summary.append(
        [
          pool,
          name,
          "/".join(map(str, chosen.batches)),
          mix,
          f"{chosen.samples_per_s:.1f}",
          f"{chosen.samples_per_s / dyn.samples_per_s:.2f}×" if dyn else "-",
          f"{chosen.cost:.3g}",
          f"{speed:.2f}",
          f"{ar4:.0f} / {ar8:.0f}",
          f"{seconds:.2f}",
        ]
      )
      for c in cands:
        lines.append(
          [
            pool,
            name,
            c.name + ("" if c.fits else " (does not fit)"),
            "/".join(map(str, c.batches)),
            f"{c.samples_per_s:.1f}",
            f"{c.samples_per_s / dyn.samples_per_s:.2f}×" if dyn else "-",
            f"{c.cost:.3g}",
          ]
        )
        rows.append(
          result_row(
            "hybrid",
            f"{case}/{c.name}",
            "modeled_samples_per_s",
            c.samples_per_s,
            dyn.samples_per_s if dyn else None,
            device,
            accuracy_cost=c.cost,
            batch_per_device=list(c.batches),
            fits=c.fits,
            chosen=c is chosen or (c.name == "joint" and chosen.name == "joint"),
            slack=args.slack,
            granularity=args.granularity,
          )
        )
      rows.append(result_row("hybrid", case, "planning_s", seconds, None, device, replays=search.replays))
      rows.append(result_row("hybrid", case, "modeled_infer_over_train_speed", speed, None, device))
  print("every candidate (modeled; batches train/infer per device; ratio to dynamic batching):")
  print(table(["pool", "model", "plan", "batches", "samples/s", "vs dynamic", "acc. cost"], lines))
  print(
    "\nthe chosen plan (modeled). infer/train speed: an inference device's fastest per-device speed (any "
    "configuration, compute alone) over a training device's; all-reduce: the gradients over the 4 training "
    "devices / all 8, at 100 Gbit/s:"
  )
  print(
    table(
      [
        "pool",
        "model",
        "batches",
        "infer precisions",
        "samples/s",
        "vs dynamic",
        "acc. cost",
        "infer/train speed",
        "all-reduce ms 4/8",
        "plan s",
      ],
      summary,
    )
  )
  append_rows(RESULTS, rows)
  print(f"appended {len(rows)} rows to {RESULTS}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
