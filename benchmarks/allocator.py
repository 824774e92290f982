"""Planner speed on a BERT-base-sized graph, and greedy / joint vs exhaustive search.

1. BERT-base (12 layers, d=768, 12 heads, seq 384, SQuAD-like) as an op graph of 98
   quantizable ops (embedding, Q/K/V/out projections, both attention products, MLP, head;
   ``benchmarks.common.zoo.bert_ops``),
   costed by the catalog (all costs *modeled*), on QSync's cluster: V100s (training, fp32)
   and T4s (inference). Prints the joint planner's time (batch × precision, target ≤ 2 s),
   its replays, the plan's batches and mix of precisions, and its predicted throughput
   against dynamic batching's.
2. Greedy vs exhaustive on random small graphs (3–6 ops, random costs and Ω): how often
   greedy is optimal and its mean Ω gap. Baseline: the exhaustive optimum.
3. Joint vs exhaustive on random small problems (3 ops, 2 + 2 devices, global batch 16):
   every batch split × every level combination, the least cost within the slack of the
   fastest. Reports how often the joint plan is as fast (within slack) and as cheap.

  python -m benchmarks.allocator [--trials 100]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import numpy as np

from benchmarks.common.result_rows import result_row, results_path, save_rows
from benchmarks.common.zoo import bert_profile
from planners.allocator.greedy import exhaustive, greedy, make_problem
from planners.allocator.joint import joint_plan, precision_counts
from planners.ops import OpShape
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import predict
from planners.profile import Profile
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan

RESULTS = results_path("allocator")


def row_json(case, metric, value, baseline):
  return result_row("allocator", case, metric, value, baseline, jax.devices()[0].device_kind)


def bert_case(rows):
  base = bert_profile()
  profiles = {t: modeled_profile(base, t) for t in ("V100", "T4")}
  cluster = ClusterSpec(
    (
      DeviceGroup("train", "V100", 4, 32.0, 12, 100.0),
      DeviceGroup("infer", "T4", 4, 16.0, 12, 100.0),
    ),
    name="qsync-bert",
  )
  rng = np.random.default_rng(0)
  omega = {}
  for op in base.ops:
    s = float(rng.exponential())
    omega[op.name] = {"int8": s, "fp16": s / 50, "fp32": 0.0}
  t0 = time.perf_counter()
  problem = make_problem(cluster, profiles, {"omega": omega})
  chosen, cands, search = joint_plan(problem)
  seconds = time.perf_counter() - t0
  dyn = next(c for c in cands if c.name == "dynamic batching")
  fp32 = predict(cluster, profiles, Plan.uniform(cluster, "fp32"))
  print(
    f"BERT-base graph: {len(base.ops)} quantizable ops, 2 groups (4×V100 train fp32, 4×T4 infer), costs modeled"
  )
  print(
    f"  joint plan in {seconds:.3f} s with {search.replays} replays (target ≤ 2 s: ratio {seconds / 2:.3f})"
  )
  print(
    f"  chosen {chosen.name!r}: batches {chosen.batches}, T4 mix {precision_counts(problem, chosen).get('infer')}"
  )
  print(
    f"  predicted {chosen.samples_per_s:.1f} samples/s; dynamic batching {dyn.batches} {dyn.samples_per_s:.1f}; "
    f"all-fp32 step {fp32.step_ms:.1f} ms"
  )
  rows += [
    row_json("bert-base/2 groups", "joint_planning_s", seconds, 2.0),
    row_json("bert-base/2 groups", "replays", search.replays, None),
    row_json(
      "bert-base/2 groups", "samples_per_s_vs_dynamic_batching", chosen.samples_per_s, dyn.samples_per_s
    ),
  ]


def exhaustive_joint(problem, slack: float):
  """The least-cost plan within ``slack`` of the fastest over every batch split (granularity
  1) and level combination of a 2-group problem (one inference group), and the fastest step."""
  _, _, s = joint_plan(problem, 1, slack)
  cluster, ladder = problem.cluster, problem.ladders[0]
  (c0, c1), total = (g.count for g in cluster.groups), cluster.global_batch
  found = []
  for b0 in range(1, total // c0 + 1):
    b1, rest = divmod(total - c0 * b0, c1)
    if rest:
      continue
    combos = itertools.product(*(range(len(lad)) for lad in ladder)) if b1 else [None]
    for row in combos:
      cand = s.candidate("exhaustive", (b0, b1), [None, row])
      if cand.fits:
        found.append(cand)
  fastest = min(c.step_ms for c in found)
  best = min((c for c in found if c.step_ms <= fastest * (1 + slack) + 1e-12), key=lambda c: c.cost)
  return best, fastest


def random_small_problem(rng, n: int, batch: int = 8):
  """A 2 + 2-device problem of ``n`` dense ops with random leg costs, slowdown and Ω."""
  base = Profile(
    "small",
    "cpu",
    "measured",
    8,
    tuple(OpShape(f"Dense_{i}:dense", "dense", 1, 8, 10, 100, 1, 1000, 1000, 800) for i in range(n)),
    {},
    {"fwd": 0.0, "bwd": 0.0},
    0.0,
    {},
    {"param_bytes": 4000 * n, "opt_state_bytes": 8000 * n, "batch_bytes": 0, "other_bytes": 0},
  )
  op_ms = {}
  speed = {"fp32": 1.0, "fp16": 0.5, "int8": 0.3, "fp8": 0.3, "bf16": 0.5, "tf32": 1.0}
  for o in base.ops:
    legs = rng.uniform(0.2, 3.0, size=3)
    jitter = {p: s * rng.uniform(0.8, 1.2) for p, s in speed.items()}
    op_ms[o.name] = {
      leg: {p: float(t * jitter[p]) for p in speed} for leg, t in zip(("fwd", "dlhs", "drhs"), legs)
    }
  from planners.profile import CAST_TYPES, CastModel

  casts = {c: CastModel(0.0, 0.0, 0.0) for c in CAST_TYPES}
  train = Profile(**{**base.__dict__, "op_ms": op_ms, "cast": casts, "device_type": "A100"})
  slow = float(rng.uniform(1.2, 3.0))
  infer_ms = {
    o: {leg: {p: t * slow for p, t in row.items()} for leg, row in legs.items()} for o, legs in op_ms.items()
  }
  infer = Profile(**{**train.__dict__, "op_ms": infer_ms, "device_type": "T4"})
  cluster = ClusterSpec(
    (DeviceGroup("train", "A100", 2, 40.0, batch), DeviceGroup("infer", "T4", 2, 16.0, batch))
  )
  sens = rng.exponential(size=n)
  omega = {
    o.name: {"int8": float(s), "fp16": float(s * rng.uniform(0.01, 0.3)), "fp32": 0.0}
    for o, s in zip(base.ops, sens)
  }
  return make_problem(cluster, {"A100": train, "T4": infer}, {"omega": omega})


def joint_case(trials, rows, slack=0.02):
  rng = np.random.default_rng(2)
  as_fast = as_cheap = 0
  gaps = []
  for _ in range(trials):
    problem = random_small_problem(rng, 3, batch=4)
    chosen, _, _ = joint_plan(problem, 1, slack)
    best, fastest = exhaustive_joint(problem, slack)
    as_fast += chosen.step_ms <= fastest * (1 + slack) * (1 + 1e-9)
    as_cheap += chosen.cost <= best.cost + 1e-9
    gaps.append(chosen.cost - best.cost)
  print(
    f"joint vs exhaustive on {trials} random problems (3 ops, 2+2 devices, global batch 16, slack {slack}): "
    f"within the slack of the fastest plan in {as_fast}/{trials}, as cheap as the exhaustive optimum in "
    f"{as_cheap}/{trials}; accuracy-cost gap mean {np.mean(gaps):.3g}, max {np.max(gaps):.3g}"
  )
  rows += [
    row_json("joint small random", "within_slack_of_fastest_fraction", as_fast / trials, 1.0),
    row_json("joint small random", "as_cheap_as_exhaustive_fraction", as_cheap / trials, 1.0),
    row_json("joint small random", "cost_gap_mean", float(np.mean(gaps)), None),
  ]


def small_case(trials, rows):
  rng = np.random.default_rng(1)
  gaps, optimal, seconds = [], 0, []
  for _ in range(trials):
    problem = random_small_problem(rng, int(rng.integers(3, 7)))
    t0 = time.perf_counter()
    g = greedy(problem)
    seconds.append(time.perf_counter() - t0)
    e = exhaustive(problem)
    gap = (g.omega - e.omega) / max(e.omega, 1e-12)
    gaps.append(gap)
    optimal += gap <= 1e-9
  gaps = np.array(gaps)
  print(
    f"greedy vs exhaustive on {trials} random graphs of 3-6 ops: optimal in {optimal}/{trials}; "
    f"Ω gap mean {100 * gaps.mean():.2f} %, max {100 * gaps.max():.1f} %; greedy median {1e3 * np.median(seconds):.1f} ms"
  )
  rows += [
    row_json("small random graphs", "greedy_optimal_fraction", optimal / trials, 1.0),
    row_json("small random graphs", "omega_gap_mean", float(gaps.mean()), None),
    row_json("small random graphs", "omega_gap_max", float(gaps.max()), None),
  ]


def main():
  ap = argparse.ArgumentParser(prog="python -m benchmarks.allocator", description=__doc__.splitlines()[0])
  ap.add_argument("--trials", type=int, default=100)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args()
  rows = []
  bert_case(rows)
  small_case(args.trials, rows)
  joint_case(max(args.trials // 5, 5), rows)
  save_rows(RESULTS, rows, not args.no_save)


if __name__ == "__main__":
  main()
