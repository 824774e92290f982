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
3. Joint vs exhaustive on random small problems (3 ops, 2 + 2 devices, global batch 16; and
   2 ops, 2 + 1 + 1 devices, global batch 16): every batch split × every level combination,
   the least cost within the slack of the fastest. Reports how often the joint plan is as fast
   (within slack) and as cheap.
4. The joint planner on BERT-base over 3 and 4 device groups (A100 + L4 + T4; A100 + A10 +
   L4 + T4, the A100s training at fp32), global batch 256, 512 and 1,024: its time, replays
   and predicted throughput against dynamic batching's (costs modeled; time measured on the
   machine that runs it).

  python -m benchmarks.allocator [--trials 100] [--sections 1234]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import numpy as np

from benchmarks.common.result_rows import result_row, results_path, save_rows
from benchmarks.common.zoo import bert_profile
from planners.allocator.bound import best_baseline
from planners.allocator.exhaustive import exhaustive
from planners.allocator.greedy import greedy, make_problem
from planners.allocator.joint import joint_plan
from planners.allocator.search import precision_counts
from planners.allocator.splits import splits_within
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
  problem = make_problem(cluster, profiles, {"omega": omega}, train_policy="fp16")  # V100 mixed precision
  chosen, cands, search = joint_plan(problem)
  seconds = time.perf_counter() - t0
  dyn = best_baseline(cands)
  fp32 = predict(cluster, profiles, Plan.uniform(cluster, "fp32"))
  print(
    f"BERT-base graph: {len(base.ops)} quantizable ops, 2 groups (4×V100 train fp16, 4×T4 infer), costs modeled"
  )
  print(
    f"  joint plan in {seconds:.3f} s with {search.replays} replays (target ≤ 2 s: ratio {seconds / 2:.3f})"
  )
  print(
    f"  chosen {chosen.name!r}: batches {chosen.batches}, T4 mix {precision_counts(problem, chosen).get('infer')}"
  )
  print(
    f"  predicted {chosen.samples_per_s:.1f} samples/s (mode {chosen.mode}); best baseline {dyn.name!r} "
    f"{dyn.batches} {dyn.samples_per_s:.1f}; "
    f"all-fp32 step {fp32.step_ms:.1f} ms"
  )
  rows += [
    row_json("bert-base/2 groups", "joint_planning_s", seconds, 2.0),
    row_json("bert-base/2 groups", "replays", search.replays, None),
    row_json("bert-base/2 groups", "samples_per_s_vs_best_baseline", chosen.samples_per_s, dyn.samples_per_s),
  ]


def exhaustive_joint(problem, slack: float):
  """The least-cost plan within ``slack`` of the fastest over every batch split (granularity
  1; training groups ≥ 1, inference groups ≥ 0) and every level combination of the inference
  groups that run, and the fastest step."""
  _, _, s = joint_plan(problem, 1, slack)
  counts = [g.count for g in problem.cluster.groups]
  total, n = problem.cluster.global_batch, len(counts)
  lows = [0 if gi in problem.inference else 1 for gi in range(n)]
  found = []
  for split in splits_within(total, counts, lows, [total // c for c in counts], 1):
    running = [j for j, gi in enumerate(problem.inference) if split[gi]]
    levels = [itertools.product(*(range(len(lad)) for lad in problem.ladders[j])) for j in running]
    for combo in itertools.product(*levels):
      rows = [None] * n
      for j, row in zip(running, combo):
        rows[problem.inference[j]] = row
      cand = s.candidate("exhaustive", split, rows)
      if cand.fits:
        found.append(cand)
  fastest = min(c.step_ms for c in found)
  best = min((c for c in found if c.step_ms <= fastest * (1 + slack) + 1e-12), key=lambda c: c.cost)
  return best, fastest


def random_small_problem(rng, n: int, batch: int = 8, infer=(("T4", 2),)):
  """A problem of ``n`` dense ops with random leg costs, slowdown and Ω: 2 training devices
  (A100) and the inference groups ``infer`` ((device type, count) each, its own slowdown)."""
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
  profiles = {"A100": train}
  groups = [DeviceGroup("train", "A100", 2, 40.0, batch)]
  for k, (device_type, count) in enumerate(infer):
    slow = float(rng.uniform(1.2, 3.0))
    infer_ms = {
      o: {leg: {p: t * slow for p, t in row.items()} for leg, row in legs.items()}
      for o, legs in op_ms.items()
    }
    profiles[device_type] = Profile(**{**train.__dict__, "op_ms": infer_ms, "device_type": device_type})
    groups.append(DeviceGroup("infer" if len(infer) == 1 else f"infer{k}", device_type, count, 16.0, batch))
  sens = rng.exponential(size=n)
  omega = {
    o.name: {"int8": float(s), "fp16": float(s * rng.uniform(0.01, 0.3)), "fp32": 0.0}
    for o, s in zip(base.ops, sens)
  }
  return make_problem(ClusterSpec(tuple(groups)), profiles, {"omega": omega})


def joint_case(trials, rows, slack=0.02):
  cases = [
    ("joint small random", "3 ops, 2+2 devices", 2, dict(n=3, batch=4)),
    (
      "joint small random 3 groups",
      "2 ops, 2+1+1 devices",
      3,
      dict(n=2, batch=4, infer=(("T4", 1), ("L4", 1))),
    ),
  ]
  for case, label, seed, kwargs in cases:
    rng = np.random.default_rng(seed)
    as_fast = as_cheap = 0
    gaps = []
    for _ in range(trials):
      problem = random_small_problem(rng, **kwargs)
      chosen, _, _ = joint_plan(problem, 1, slack)
      best, fastest = exhaustive_joint(problem, slack)
      as_fast += chosen.step_ms <= fastest * (1 + slack) * (1 + 1e-9)
      as_cheap += chosen.cost <= best.cost + 1e-9
      gaps.append(chosen.cost - best.cost)
    print(
      f"joint vs exhaustive on {trials} random problems ({label}, global batch 16, slack {slack}): "
      f"within the slack of the fastest plan in {as_fast}/{trials}, as cheap as the exhaustive optimum in "
      f"{as_cheap}/{trials}; accuracy-cost gap mean {np.mean(gaps):.3g}, max {np.max(gaps):.3g}"
    )
    rows += [
      row_json(case, "within_slack_of_fastest_fraction", as_fast / trials, 1.0),
      row_json(case, "as_cheap_as_exhaustive_fraction", as_cheap / trials, 1.0),
      row_json(case, "cost_gap_mean", float(np.mean(gaps)), None),
    ]


POOLS = {
  3: (("a100", "A100", 2, 80.0), ("l4", "L4", 3, 24.0), ("t4", "T4", 3, 16.0)),
  4: (("a100", "A100", 2, 80.0), ("a10", "A10", 3, 24.0), ("l4", "L4", 4, 24.0), ("t4", "T4", 7, 16.0)),
}
"""The pools of section 4: (name, device type, count, memory GB) per group."""


def bert_pool_problem(groups: int, global_batch: int):
  """BERT-base on ``POOLS[groups]`` at ``global_batch`` (the same batch on every device), Ω
  drawn as in section 1."""
  spec = POOLS[groups]
  per_device = global_batch // sum(count for _, _, count, _ in spec)
  cluster = ClusterSpec(
    tuple(DeviceGroup(name, t, count, memory, per_device, 100.0) for name, t, count, memory in spec),
    name=f"bert-{groups}-groups",
  )
  base = bert_profile()
  profiles = {t: modeled_profile(base, t) for _, t, _, _ in spec}
  rng = np.random.default_rng(0)
  omega = {}
  for op in base.ops:
    s = float(rng.exponential())
    omega[op.name] = {"int8": s, "fp16": s / 50, "fp32": 0.0}
  return make_problem(cluster, profiles, {"omega": omega}, train_policy="bf16")  # as an A100 trains


def pool_case(rows):
  for groups in (3, 4):
    for global_batch in (256, 512, 1024):
      problem = bert_pool_problem(groups, global_batch)
      wall, cpu = time.perf_counter(), time.process_time()
      chosen, cands, search = joint_plan(problem)
      wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
      dyn = best_baseline(cands)
      case = f"joint {groups} groups B={global_batch}"
      vs = f"best baseline ({dyn.name}) {dyn.samples_per_s:.1f}" if dyn else "no baseline fits"
      modes = sorted({c.mode for c in cands})
      print(
        f"{case}: {wall:.2f} s ({cpu:.2f} s CPU), {search.replays} replays; chosen {chosen.batches} "
        f"{chosen.samples_per_s:.1f} samples/s (modeled), cost {chosen.cost:.3g}, mode {chosen.mode}; {vs}; "
        f"modes searched {modes}"
      )
      rows += [
        row_json(case, "plan_s", wall, 2.0) | {"cpu_s": cpu},
        row_json(case, "replays", search.replays, None),
        row_json(
          case, "samples_per_s_vs_best_baseline", chosen.samples_per_s, dyn.samples_per_s if dyn else None
        ),
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
  ap.add_argument("--sections", default="1234", help="which sections to run, e.g. 34")
  args = ap.parse_args()
  rows = []
  if "1" in args.sections:
    bert_case(rows)
  if "2" in args.sections:
    small_case(args.trials, rows)
  if "3" in args.sections:
    joint_case(max(args.trials // 5, 5), rows)
  if "4" in args.sections:
    pool_case(rows)
  save_rows(RESULTS, rows, not args.no_save)


if __name__ == "__main__":
  main()
