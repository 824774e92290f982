"""``qsync profile``: cost profile of a model on the local device (or modeled for another)."""

from __future__ import annotations

import argparse

from planners.cli_common import progress, table
from planners.derived_profiles import modeled_profile, traced_profile
from planners.profiler import local_device_type, measure_profile
from qsync_jax.errors import UnsupportedPrecisionError
from qsync_jax.precision import LEGS, supported_precisions
from qsync_jax.tasks import load_task

HELP = "Measure op × leg × precision costs, casts and memory of a model's training step (JSON)."


def add_arguments(parser) -> None:
  parser.add_argument(
    "--model", required=True, help="example name (e.g. mlp, lm) or package.module:make_task"
  )
  parser.add_argument(
    "--device-type",
    help="device type to profile for; a type other than the local one is modeled from the catalog",
  )
  parser.add_argument("--batch", type=int, default=32, help="per-device batch to profile at (default 32)")
  parser.add_argument(
    "--precisions", help="comma-separated precisions to time (default: all the device runs)"
  )
  parser.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement (median)")
  parser.add_argument(
    "--cast-sizes",
    default="16384,65536,262144,1048576",
    help="comma-separated element counts the cast models are fitted on",
  )
  parser.add_argument(
    "--clock",
    choices=["wall", "cpu", "pipelined"],
    default=None,
    help="clock of the fp32 and all-int8 steps the remainder and the int8 legs' scale are fitted to: wall time; process CPU time (steadier on "
    "a CPU host shared with other work); or pipelined — steps dispatched back to back, as `qsync "
    "train` runs them (default: pipelined on a GPU, else wall)",
  )
  parser.add_argument(
    "--op-clock",
    choices=["wall", "cpu", "device"],
    default=None,
    help="clock of the standalone op, optimizer and cast programs (default: device — their kernel "
    "time from a profiler trace — on a GPU, else --clock); the fp32 step is always on --clock",
  )
  parser.add_argument(
    "--precast",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="time each op under a whole policy with its activations in the dtypes the step converts them "
    "to, as XLA fuses those conversions into neighbouring kernels (default: on a GPU only)",
  )
  parser.add_argument(
    "--out",
    required=True,
    help="output JSON file; the op timings so far are kept in <out>.partial while it runs, and an "
    "interrupted run with the same arguments resumes from there",
  )


def run(args) -> int:
  task = load_task(args.model)
  local = local_device_type()
  precisions = args.precisions.split(",") if args.precisions else None
  bad = [p for p in precisions or () if p not in supported_precisions(local)]
  if bad:
    raise UnsupportedPrecisionError(
      f"--precisions {args.precisions!r}: {bad} cannot run on {local}. "
      f"Fix: choose from {list(supported_precisions(local))}."
    )
  if args.device_type and args.device_type != local:
    progress(f"tracing {task.name}; {args.device_type} costs are modeled from the catalog (roofline)")
    prof = modeled_profile(traced_profile(task, args.batch), args.device_type)
  else:
    sizes = [int(x) for x in args.cast_sizes.split(",")]
    prof = measure_profile(
      task,
      args.batch,
      precisions,
      args.repeats,
      progress=progress,
      cast_sizes=sizes,
      clock=args.clock,
      op_clock=args.op_clock,
      precast=args.precast,
      checkpoint=f"{args.out}.partial",
    )
  prof.save(args.out)
  rows = []
  for op in prof.ops:
    times = prof.op_ms[op.name]
    row = [op.name, f"{op.batch}x{op.m}x{op.k}x{op.n}"]
    for p in ("fp32", "bf16", "fp16", "int8", "fp8"):
      row.append(sum(times[leg][p] for leg in LEGS) if p in times["fwd"] else "-")
    rows.append(row)
  clocks = f", ops on the {prof.meta['op_clock']} clock" if "op_clock" in prof.meta else ""
  print(
    f"{prof.model} on {prof.device_type} ({prof.source}{clocks}), batch {prof.batch_per_device}; "
    "fwd+dlhs+drhs ms:"
  )
  print(table(["op", "gemm b×m×k×n", "fp32", "bf16", "fp16", "int8", "fp8"], rows))
  print(
    f"remainder {sum(prof.remainder_ms.values()):.3f} ms, optimizer {prof.optimizer_ms:.3f} ms"
    + (f", measured fp32 step {prof.meta['fp32_step_ms']:.3f} ms" if "fp32_step_ms" in prof.meta else "")
  )
  if "quantized_fit_step_ms" in prof.meta:
    print(
      f"int8 legs inside the step x{prof.quantized_leg_scale:.3f} of their standalone time, fitted to the "
      f"measured all-int8 step {prof.meta['quantized_fit_step_ms']:.3f} ms"
    )
  if "sixteen_bit_fit_step_ms" in prof.meta:
    print(
      f"remainder fitted to the measured all-bf16 step {prof.meta['sixteen_bit_fit_step_ms']:.3f} ms; "
      f"fp32 legs inside the step x{prof.fp32_leg_scale:.3f} of their standalone time"
    )
  print(f"wrote {args.out}")
  return 0
