"""Where a plan's GPU kernel time goes, in the training step and in the profile's programs.

For each uniform policy: the kernels of one ``lm_base`` (or ``--model``) training step on the
first GPU (``planners.profiler.timing.compiled_train_step``, traced with ``planners.profiler.timing.profiler_events``), and the
sum over every op of the standalone whole-policy program the profiler times for it
(``planners.profiler.op_programs.policy_programs``, forward + both gradients, precast), each summed by
kernel category (``category``). The replay charges the programs' time plus one remainder fitted
on the fp32 step; the per-category difference says which kernels the step runs that the
programs do not, or the reverse.

  python -m benchmarks.diagnosis.kernel_categories [--model lm_base] [--policies int8 int8_fwd bf16]

Needs a GPU (on a CPU the traces hold no GPU kernels and every table is empty).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import jax

from benchmarks.common import zoo
from benchmarks.common.result_rows import append_rows, result_row, results_path
from planners.profiler import timing
from planners.profiler.measure import policy_key, task_ops
from planners.profiler.op_programs import policy_programs
from planners.profiler.timing import kernels_by, profiler_events
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy

RESULTS = results_path("kernel_categories")
CATEGORIES = (
  ("int8_gemm", ("mosaic",)),
  ("quantize_kernel", ("quantize",)),
  ("float_gemm", ("nvjet", "gemm", "cublas", "cutlass", "sm90_xmma", "triton_dot")),
  ("rng", ("rng", "threefry", "random", "philox")),
  ("reduce_fusion", ("reduce",)),
)
"""Kernel name marks per category, first match wins; any other kernel is ``elementwise``."""


def category(kernel_name: str) -> str:
  """The category of a GPU kernel by its name (``CATEGORIES``)."""
  name = kernel_name.lower()
  return next((c for c, marks in CATEGORIES if any(m in name for m in marks)), "elementwise")


def by_category(run, repeats: int = 5) -> dict[str, tuple[float, float]]:
  """``{category: (kernel ms, kernels)}`` per call of ``run`` on the first GPU."""
  return kernels_by(profiler_events(run, repeats), repeats, key=category)


def policy_categories(task, batch_size: int, policy: str, say) -> dict[str, dict]:
  """``{"step": {...}, "programs": {...}}`` of ``policy`` (``by_category``)."""
  batch = timing.device_batch(task, batch_size)
  run, _ = timing.compiled_train_step(task, PrecisionPolicy.uniform(policy), batch)
  for _ in range(3):
    jax.block_until_ready(run())
  out = {"step": by_category(lambda: jax.block_until_ready(run()))}
  say(f"step {policy} traced")
  total, cache = collections.defaultdict(lambda: [0.0, 0.0]), {}
  for op in task_ops(task, batch_size)[2]:
    key = policy_key(policy, op)
    if key not in cache:
      programs = policy_programs(OpPolicy.preset(policy), op.batch, op.m, op.k, op.n, op=op, precast=True)
      fwd_bwd = programs[1]
      jax.block_until_ready(fwd_bwd())
      cache[key] = by_category(lambda fwd_bwd=fwd_bwd: jax.block_until_ready(fwd_bwd()))
    for k, (ms, n) in cache[key].items():
      total[k][0] += op.calls * ms
      total[k][1] += op.calls * n
  out["programs"] = {k: (v[0], v[1]) for k, v in total.items()}
  say(f"programs {policy} traced")
  return out


def rows(model: str, results: dict[str, dict], device: str) -> list[dict]:
  """JSON rows: per policy and category, the step's kernel ms against the programs' sum."""
  out = []
  for policy, r in results.items():
    for k in sorted(set(r["step"]) | set(r["programs"])):
      ms, n = r["step"].get(k, (0.0, 0.0))
      pms, pn = r["programs"].get(k, (0.0, 0.0))
      case = f"{model}/{policy}/{k}"
      out.append(result_row("kernel_categories", case, "step_kernel_ms", ms, pms or None, device, kernels=n))
      out.append(result_row("kernel_categories", case, "programs_kernel_ms", pms, None, device, kernels=pn))
  return out


def print_table(results: dict[str, dict]) -> None:
  print(
    f"\n{'policy':9s} {'category':16s} {'step ms':>8s} {'kernels':>7s} {'programs ms':>11s} {'kernels':>7s}"
  )
  for policy, r in results.items():
    for k in sorted(set(r["step"]) | set(r["programs"])):
      ms, n = r["step"].get(k, (0.0, 0.0))
      pms, pn = r["programs"].get(k, (0.0, 0.0))
      print(f"{policy:9s} {k:16s} {ms:8.3f} {n:7.1f} {pms:11.3f} {pn:7.1f}")
    step_ms, prog_ms = (sum(v[0] for v in r[w].values()) for w in ("step", "programs"))
    print(
      f"{policy:9s} {'all':16s} {step_ms:8.3f} {'':7s} {prog_ms:11.3f}   step - programs {step_ms - prog_ms:.3f} ms"
    )


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.kernel_categories", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--model", default="lm_base")
  ap.add_argument("--policies", nargs="+", default=["int8", "int8_fwd", "bf16"])
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--json", help="also write the per-category tables here")
  args = ap.parse_args(argv)
  task, batch_size = zoo.get(args.model)
  say = lambda msg: print(msg, flush=True)  # noqa: E731
  results = {p: policy_categories(task, batch_size, p, say) for p in args.policies}
  print_table(results)
  append_rows(args.results, rows(args.model, results, jax.devices()[0].device_kind))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
