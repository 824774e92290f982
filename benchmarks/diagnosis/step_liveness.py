"""Where a compiled training step's memory peaks, by the schedule's liveness
(``planners.profiler.step_hlo.live_ranges``), beside XLA's own peak (``compiled.memory_analysis()``).

For each plan of ``benchmarks/predictor.py`` the jitted single-device training step of
``--model`` is compiled on the local device — or, with ``--hlo``, modules saved earlier are
read (``--save-hlo DIR`` writes them: ``<model>_<plan>.hlo.gz``, so that a GPU's modules can be
studied after the GPU is gone). Printed per plan: the live peak of the temporaries plus the
step's arguments (parameters, optimizer state, batch) against XLA's peak — the difference is
XLA's heap packing, which the liveness ignores —, the instruction it peaks at, the largest
buffers live there, and each op's largest live bytes during its forward and its gradient legs.

  python -m benchmarks.diagnosis.step_liveness --model vgg_wide [--plans fp32 int8 ...] [--save-hlo DIR]
  python -m benchmarks.diagnosis.step_liveness --model vgg_wide --hlo DIR/vgg_wide_int8.hlo.gz ...

A diagnostic of the replay's memory model (``planners.predictor.memory_model.memory_bytes``): nothing is
timed and no row is written.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys

from benchmarks.common import zoo
from benchmarks.predictor import plans
from planners.profiler import timing
from planners.profiler.hlo import entry_instructions
from planners.profiler.measure import task_ops
from planners.profiler.step_hlo import busiest_moments, live_ranges, live_totals
from qsync_jax.policy import PrecisionPolicy

MB = 1e6


def file_name(model: str, plan: str) -> str:
  """``<model>_<plan>.hlo.gz`` with the plan's spaces and slashes made file-safe."""
  return f"{model}_{plan.replace(' ', '_').replace('/', '-')}.hlo.gz"


def liveness_report(hlo: str, ops, top: int = 8) -> dict:
  """``{"peak": bytes, "at": instruction, "at_name": its JAX name stack, "largest": [(bytes,
  instruction, shape)], "per_op": {op name: {"fwd": bytes, "bwd": bytes}}}`` of one compiled
  module: its live temporaries' peak, the ``top`` largest buffers live there, and each op's
  most live bytes while its forward / gradient instructions run."""
  instructions = entry_instructions(hlo)
  ranges = live_ranges(instructions)
  live = live_totals(ranges, len(instructions))
  at = max(range(len(live)), key=live.__getitem__)
  covering = sorted((r for r in ranges if r.start <= at <= r.end), key=lambda r: -r.size)[:top]
  by_name = {ins.name: ins for ins in instructions}
  per_op: dict[str, dict[str, int]] = {}
  for (name, leg), i in busiest_moments(instructions, live, ops)[0].items():
    per_op.setdefault(name, {"fwd": 0, "bwd": 0})[leg] = live[i]
  return {
    "peak": live[at],
    "at": instructions[at].name,
    "at_name": instructions[at].op_name,
    "largest": [(r.size, r.instruction, by_name[r.instruction].shape) for r in covering],
    "per_op": per_op,
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.step_liveness", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--model", default="vgg")
  ap.add_argument("--plans", nargs="+", help="default: fp32 and every plan of benchmarks/predictor.py")
  ap.add_argument("--hlo", nargs="+", help="saved modules (.hlo or .hlo.gz) to read instead of compiling")
  ap.add_argument("--save-hlo", help="write each compiled module to DIR/<model>_<plan>.hlo.gz")
  args = ap.parse_args(argv)
  task, batch_size = zoo.get(args.model)
  batch, variables, ops = task_ops(task, batch_size)
  state_bytes = timing.tree_bytes(variables) + timing.tree_bytes(
    timing.default_optimizer().init(variables["params"])
  )
  arguments = state_bytes + timing.tree_bytes(batch)
  modules: dict[str, tuple[str, int | None]] = {}
  if args.hlo:
    for path in args.hlo:
      with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        modules[os.path.basename(path)] = (f.read(), None)
  else:
    every = {"fp32": PrecisionPolicy.uniform("fp32"), **plans([op.name for op in ops])}
    names = args.plans or list(every)
    unknown = sorted(set(names) - set(every))
    if unknown:
      raise SystemExit(f"unknown plans {unknown}. Fix: choose from {sorted(every)}.")
    for name in names:
      compiled, _ = timing.compile_train_step(task, every[name], batch)
      modules[name] = (compiled.as_text(), timing.xla_peak_bytes(compiled))
      if args.save_hlo:
        os.makedirs(args.save_hlo, exist_ok=True)
        with gzip.open(os.path.join(args.save_hlo, file_name(args.model, name)), "wt") as f:
          f.write(modules[name][0])
  for name, (hlo, xla_peak) in modules.items():
    report = liveness_report(hlo, ops)
    total = report["peak"] + arguments
    xla = (
      f"XLA {xla_peak / MB:.1f} MB (liveness {100 * (total / xla_peak - 1):+.1f} %)" if xla_peak else "XLA -"
    )
    print(
      f"\n== {args.model} {name}: live {total / MB:.1f} MB (temporaries {report['peak'] / MB:.1f} + arguments "
      f"{arguments / MB:.1f}); {xla}"
    )
    print(f"   peaks at {report['at']} [{report['at_name'][-80:]}]")
    for size, instruction, shape in report["largest"]:
      print(f"   {size / MB:9.1f} MB  {instruction:32s} {shape[:70]}")
    print(f"   {'op':28s} {'fwd MB':>9s} {'bwd MB':>9s}  (most live while its legs run)")
    for op in ops:
      legs = report["per_op"].get(op.name, {"fwd": 0, "bwd": 0})
      print(f"   {op.name[:28]:28s} {legs['fwd'] / MB:9.1f} {legs['bwd'] / MB:9.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
