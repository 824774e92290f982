"""Per-op time inside compiled training steps, forward and gradient apart, beside the profile's
standalone programs: where the predictor's op costs and its fitted remainder differ from the step.

For each plan of ``benchmarks/predictor.py`` (uniform and mixed) the jitted single-device
training step of ``--model`` is traced (``planners.profiler.timing.instruction_times``): on a GPU its
kernel events, each charged to the HLO instruction it runs (``hlo_op``; command buffers are
switched off so that every kernel names its instruction, not its CUDA graph); on XLA:CPU its
per-instruction events. Each instruction's time goes to the
op its JAX name stack names (``planners.profiler.step_hlo.op_of``) — gradient legs are those under
``transpose(...)`` — and the rest (activations, norms, the loss, the optimizer, and fusions that
XLA named after a neighbour) to ``rest``. With ``--profile`` the table shows, for the uniform
plans, each op's standalone whole-policy time (``policy:<preset>``, forward + backward) beside
its in-step time.

  python -m benchmarks.diagnosis.step_ops --model vgg_wide [--profile P.json] [--plans fp32 int8 ...]
      [--repeats 20]

Writes ``{plan: {"<op>|fwd": ms, "<op>|bwd": ms, "rest|fwd": …, "total": kernel ms per step}}`` to
``--out`` (default ``benchmarks/results/step_ops/per_op_<device>_<model>.json``). A
diagnostic: attribution follows XLA's fusion names, so work fused across an op boundary lands on
one side of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from benchmarks.common import zoo
from benchmarks.common.result_rows import script_dir
from benchmarks.predictor import plans
from planners.profile import Profile
from planners.profiler import step_hlo, timing
from planners.profiler.measure import task_ops
from qsync_jax.policy import PrecisionPolicy

TABLES_DIR = script_dir("step_ops")


def table_names(ops) -> dict[str, str]:
  """``{op name: its name in the tables}``: the op's module path, or its full name where ops
  share the path (an attention's two products, ``attention_qk`` and ``attention_pv``)."""
  paths = [op.name.split(":")[0] for op in ops]
  return {op.name: path if paths.count(path) == 1 else op.name for op, path in zip(ops, paths)}


def flat_per_op_ms(hlo: str, instruction_ms: dict[str, float], ops) -> dict[str, float]:
  """``{"<op>|fwd" / "<op>|bwd" / "rest|…": ms}`` (the op by ``table_names``; legs with time
  only): ``step_hlo.per_op_ms`` flattened, as this benchmark's tables write it."""
  names = {**table_names(ops), "rest": "rest"}
  return {
    f"{names[name]}|{leg}": ms
    for name, legs in step_hlo.per_op_ms(hlo, instruction_ms, ops).items()
    for leg, ms in legs.items()
    if ms
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.step_ops", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--model", default="vgg")
  ap.add_argument("--profile", help="a saved profile of the model: its standalone times beside")
  ap.add_argument("--plans", nargs="+", help="default: fp32 and every plan of benchmarks/predictor.py")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  task, batch_size = zoo.get(args.model)
  batch = timing.device_batch(task, batch_size)
  ops = task_ops(task, batch_size)[2]
  prof = Profile.load(args.profile) if args.profile else None
  every = {"fp32": PrecisionPolicy.uniform("fp32"), **plans([op.name for op in ops])}
  names = args.plans or list(every)
  unknown = sorted(set(names) - set(every))
  if unknown:
    raise SystemExit(f"unknown plans {unknown}. Fix: choose from {sorted(every)}.")
  result = {}
  for name in names:
    hlo, instruction_ms = timing.instruction_times(task, every[name], batch, args.repeats)
    total = sum(instruction_ms.values())
    result[name] = {**flat_per_op_ms(hlo, instruction_ms, ops), "total": total}
    print(f"# {args.model} {name}: {total:.3f} ms traced", flush=True)
  device = jax.devices()[0].device_kind
  names_of = table_names(ops)
  shorts = [names_of[op.name] for op in ops] + ["rest"]
  print(f"\nms per step inside the {args.model} step on {device} (forward + gradient legs)")
  print(f"{'op':14s}" + "".join(f"{n[:16]:>17s}" for n in names))
  for short in shorts:
    cells = [result[n].get(f"{short}|fwd", 0.0) + result[n].get(f"{short}|bwd", 0.0) for n in names]
    line = f"{short:14s}" + "".join(f"{c:17.3f}" for c in cells)
    op = next((o for o in ops if names_of[o.name] == short), None)
    if prof and op:  # the standalone whole-policy times of the uniform plans, beside
      whole = [prof.op_ms.get(op.name, {}).get(f"policy:{n}") for n in names]
      line += "   standalone " + " ".join(f"{n}:{w['fwd'] + w['bwd']:.3f}" for n, w in zip(names, whole) if w)
    print(line)
  print(f"{'total':14s}" + "".join(f"{result[n]['total']:17.3f}" for n in names))
  out = args.out or os.path.join(TABLES_DIR, f"per_op_{device.replace(' ', '_')}_{args.model}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
