"""Allocator speed on a BERT-base-sized graph, and greedy vs exhaustive search on small graphs.

1. BERT-base (12 layers, d=768, 12 heads, seq 384, SQuAD-like) as an op graph of 98
   quantizable ops (embedding, Q/K/V/out projections, both attention products, MLP, head),
   costed by the catalog (all costs *modeled*), on QSync's cluster: V100s (training, fp32)
   and T4s (inference). Prints the planning time, the number of replays, the plan's mix of
   precisions, its predicted step against T*, and the dynamic-batch-sizing baseline.
   Baseline of the ratio column: the 1 s target.
2. Greedy vs exhaustive on random small graphs (3–6 ops, random costs and Ω): how often
   greedy is optimal and its mean Ω gap. Baseline: the exhaustive optimum.

  python -m benchmarks.allocator [--trials 100]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from benchmarks.result_rows import result_row, save_rows
from planners.allocator import dynamic_batch, exhaustive, greedy, make_problem
from planners.derived_profiles import modeled_profile
from planners.ops import OpShape
from planners.profiler import Profile
from planners.replay import predict
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan

RESULTS = os.path.join(os.path.dirname(__file__), "results", "allocator.jsonl")


def bert_ops(batch=12, seq=384, d=768, heads=12, layers=12, ff=3072, vocab=30522) -> list[OpShape]:
  """The quantizable ops of BERT-base as canonical GEMMs (``planners.ops``)."""
  t = batch * seq

  def dense(name, k, n, kind="dense_general"):
    return OpShape(name, kind, 1, t, k, n, 1, t * k, k * n, t * n)

  ops = [OpShape("embed:embed", "embed", 1, t, vocab, d, 1, t * vocab, vocab * d, t * d)]
  bh = batch * heads
  for i in range(layers):
    p = f"layer_{i}"
    ops += [dense(f"{p}/attn/{x}:dense_general", d, d) for x in ("query", "key", "value")]
    ops.append(
      OpShape(
        f"{p}/attn:attention_qk", "attention_qk", bh, seq, d // heads, seq, 1, t * d, t * d, bh * seq * seq
      )
    )
    ops.append(
      OpShape(
        f"{p}/attn:attention_pv", "attention_pv", bh, seq, seq, d // heads, 1, bh * seq * seq, t * d, t * d
      )
    )
    ops.append(dense(f"{p}/attn/out:dense_general", d, d))
    ops.append(dense(f"{p}/mlp/up:dense", d, ff, "dense"))
    ops.append(dense(f"{p}/mlp/down:dense", ff, d, "dense"))
  ops.append(dense("qa_head:dense", d, 2, "dense"))
  return ops


def bert_profile(batch=12) -> Profile:
  ops = tuple(bert_ops(batch))
  params = 110_000_000 * 4
  memory = {"param_bytes": params, "opt_state_bytes": 2 * params, "batch_bytes": 0, "other_bytes": 0}
  return Profile("bert-base", "traced", "traced", batch, ops, {}, {}, 0.0, {}, memory)


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
  alloc = greedy(problem)
  seconds = time.perf_counter() - t0
  levels = alloc.plan.predictions["levels"]["infer"]
  mix = {p: sum(1 for v in levels.values() if v == p) for p in sorted(set(levels.values()))}
  batches, dbs_ms = dynamic_batch(cluster, profiles)
  fp32 = predict(cluster, profiles, Plan.uniform(cluster, "fp32"))
  print(
    f"BERT-base graph: {len(base.ops)} quantizable ops, 2 groups (4×V100 train fp32, 4×T4 infer), costs modeled"
  )
  print(f"  planned in {seconds:.3f} s with {alloc.replays} replays (target ≤ 1 s: ratio {seconds:.3f})")
  print(f"  T4 mix: {mix}; Σ Ω {alloc.omega:.3g}")
  print(
    f"  predicted sync step {alloc.step_ms:.1f} ms vs T* {alloc.target_ms:.1f} ms "
    f"(all-fp32 {fp32.step_ms:.1f} ms); dynamic batch sizing {batches} → {dbs_ms:.1f} ms"
  )
  rows += [
    row_json("bert-base/2 groups", "planning_s", seconds, 1.0),
    row_json("bert-base/2 groups", "replays", alloc.replays, None),
    row_json("bert-base/2 groups", "step_ms_vs_all_fp32", alloc.step_ms, fp32.step_ms),
    row_json("bert-base/2 groups", "step_ms_vs_dynamic_batch", alloc.step_ms, dbs_ms),
  ]


def small_case(trials, rows):
  rng = np.random.default_rng(1)
  gaps, optimal, seconds = [], 0, []
  for _ in range(trials):
    n = int(rng.integers(3, 7))
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
    from planners.casts import CAST_TYPES, CastModel

    casts = {c: CastModel(0.0, 0.0, 0.0) for c in CAST_TYPES}
    train = Profile(**{**base.__dict__, "op_ms": op_ms, "cast": casts, "device_type": "A100"})
    slow = float(rng.uniform(1.2, 3.0))
    infer_ms = {
      o: {leg: {p: t * slow for p, t in row.items()} for leg, row in legs.items()}
      for o, legs in op_ms.items()
    }
    infer = Profile(**{**train.__dict__, "op_ms": infer_ms, "device_type": "T4"})
    cluster = ClusterSpec((DeviceGroup("train", "A100", 2, 40.0, 8), DeviceGroup("infer", "T4", 2, 16.0, 8)))
    sens = rng.exponential(size=n)
    omega = {
      o.name: {"int8": float(s), "fp16": float(s * rng.uniform(0.01, 0.3)), "fp32": 0.0}
      for o, s in zip(base.ops, sens)
    }
    problem = make_problem(cluster, {"A100": train, "T4": infer}, {"omega": omega})
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
  save_rows(RESULTS, rows, not args.no_save)


if __name__ == "__main__":
  main()
