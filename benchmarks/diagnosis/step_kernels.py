"""Where a GPU training step's time goes: matrix products, the other kernels, and the gaps.

For each model and uniform policy: the jitted single-device training step (``planners.profiler.timing``,
fed its own donated outputs) is timed on the wall clock (median of ``--repeats``, IQR), then
traced (``benchmarks.common.kernel_summary.gpu_kernels``): GPU kernel time and launches per
step, the part of it in matrix-product kernels (name-based,
``kernel_summary.GEMM_KERNEL_MARKS``), and the gap — wall time in which the GPU runs no kernel
(launches, host work, waits). The predictor's profile times each
op standalone; this says what the step around the ops costs under each policy (the baseline
of the ratio column is the fp32 step's value of the same metric).

With ``--ops N`` it also traces, for the first N ops of each model, the two standalone
programs the profiler times per op and policy (``planners.profiler.op_programs.policy_programs``: the
forward, and forward + both gradients), with their product / other split and largest kernels:
what a standalone program runs that the step fuses away. Needs a GPU.

  python -m benchmarks.diagnosis.step_kernels [--models lm_base resnet18_224] [--ops 4]
      [--policies fp32 bf16 int8_fwd int8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from benchmarks.common import zoo
from benchmarks.common.kernel_summary import gpu_kernels
from benchmarks.common.result_rows import append_rows, result_row, results_path
from planners.profiler import timing
from planners.profiler.measure import traced_profile
from planners.profiler.op_programs import policy_programs
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy

RESULTS = results_path("step_kernels")


def step_kernels(task, policy, batch, repeats: int, traced: int = 5):
  """``(wall median ms, IQR ms, KernelSummary | None)`` of the jitted training step."""
  run, _ = timing.compiled_train_step(task, policy, batch)

  def blocked():
    jax.block_until_ready(run())

  med, samples = timing.timed_ms(blocked, repeats)
  iqr = float(np.percentile(samples, 75) - np.percentile(samples, 25))
  return med, iqr, gpu_kernels(blocked, traced)


def op_program_rows(task, batch_size: int, policies, n_ops: int, device: str, traced: int = 5) -> list[dict]:
  """Rows (and a printed table) of the standalone per-op programs of the first ``n_ops`` ops."""
  rows = []
  prof = traced_profile(task, batch_size)
  print(
    f"\n{'op':40s} {'policy':9s} {'program':8s} {'kernel ms':>9s} {'GEMM ms':>8s} {'kernels':>7s}  largest"
  )
  for op in prof.ops[:n_ops]:
    for name in policies:
      programs = policy_programs(OpPolicy.preset(name), op.batch, op.m, op.k, op.n, op=op)
      for label, prog in zip(("fwd", "fwd+bwd"), programs):
        jax.block_until_ready(prog())
        k = gpu_kernels(lambda prog=prog: jax.block_until_ready(prog()), traced)
        if k is None:
          print(f"{op.name[:40]:40s} {name:9s} {label:8s}  (no GPU kernels traced: this needs a GPU)")
          continue
        largest = ", ".join(f"{n[:40]} {ms:.3f}" for n, ms in k.top[:3])
        print(
          f"{op.name[:40]:40s} {name:9s} {label:8s} {k.ms:9.3f} {k.gemm_ms:8.3f} {k.kernels:7.0f}  {largest}"
        )
        case = f"{task.name}/{op.name}/{name}/{label}"
        rows += [
          result_row("step_kernels", case, "program_kernel_ms", k.ms, None, device, kernels=k.kernels),
          result_row("step_kernels", case, "program_gemm_kernel_ms", k.gemm_ms, k.ms, device, top=k.top[:5]),
        ]
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.step_kernels", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--models", nargs="+", default=["lm_base"])
  ap.add_argument("--policies", nargs="+", default=["fp32", "bf16", "int8_fwd", "int8"])
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--top-dir", help="write each case's 20 largest kernels here as JSON")
  ap.add_argument("--no-save", action="store_true")
  ap.add_argument("--ops", type=int, default=0, help="also trace the standalone programs of the first N ops")
  args = ap.parse_args(argv)
  device = jax.devices()[0].device_kind
  print(
    f"{'model':13s} {'policy':9s} {'wall ms':>8s} {'IQR':>5s} {'kernel ms':>9s} {'GEMM ms':>8s} "
    f"{'other ms':>8s} {'gap ms':>7s} {'kernels':>7s}"
  )
  for model in args.models:
    task, batch_size = zoo.get(model)
    batch = timing.device_batch(task, batch_size)
    base = {}
    for name in args.policies:
      t0 = time.perf_counter()
      wall, iqr, k = step_kernels(task, PrecisionPolicy.uniform(name), batch, args.repeats)
      if k is None:
        print(f"{model:13s} {name:9s} {wall:8.2f} {iqr:5.2f}  (no GPU kernels traced: this needs a GPU)")
        continue
      metrics = {
        "wall_ms": wall,
        "kernel_ms": k.ms,
        "gemm_kernel_ms": k.gemm_ms,
        "other_kernel_ms": k.ms - k.gemm_ms,
        "gap_ms": wall - k.ms,
        "kernels": k.kernels,
      }
      base = base or metrics
      print(
        f"{model:13s} {name:9s} {wall:8.2f} {iqr:5.2f} {k.ms:9.2f} {k.gemm_ms:8.2f} {k.ms - k.gemm_ms:8.2f} "
        f"{wall - k.ms:7.2f} {k.kernels:7.0f}   ({time.perf_counter() - t0:.0f} s)"
      )
      if not args.no_save:
        append_rows(
          args.results,
          [
            result_row("step_kernels", f"{model}/{name}", m, v, base[m], device, batch=batch_size)
            for m, v in metrics.items()
          ],
        )
      if args.top_dir:
        os.makedirs(args.top_dir, exist_ok=True)
        with open(os.path.join(args.top_dir, f"{model}_{name}.json"), "w") as f:
          json.dump({"wall_ms": wall, "top": k.top}, f, indent=1)
    if args.ops:
      rows = op_program_rows(task, batch_size, args.policies, args.ops, device)
      if not args.no_save:
        append_rows(args.results, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
