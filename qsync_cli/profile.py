"""``qsync profile``: cost profile of a model on the local device (or modeled for another)."""

from __future__ import annotations

import sys

from qsync_cli.common import add_model_argument, progress
from qsync_jax.devices import DEVICES, device_type_of, supported_precisions
from qsync_jax.errors import Interrupted, QsyncError, UnsupportedPrecisionError
from qsync_jax.precision import LEGS, PRECISIONS

HELP = "Measure op × leg × precision costs, casts and memory of a model's training step (JSON)."


def add_arguments(parser) -> None:
  add_model_argument(parser)
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
    "--clock",
    choices=["wall", "cpu", "pipelined"],
    default=None,
    help="clock of the training step the remainder is fitted to: wall time; process CPU time "
    "(steadier on a CPU host shared with other work); or pipelined — steps dispatched back to back, "
    "as `qsync train` runs them (default: pipelined on a GPU, else wall)",
  )
  parser.add_argument(
    "--out",
    required=True,
    help="output JSON file; the op timings so far are kept in <out>.partial while it runs, and an "
    "interrupted run with the same arguments resumes from there",
  )


def check_arguments(args) -> list[str] | None:
  """The options' constraints that need no device and no model; returns ``--precisions`` as a list
  (None: all the device runs)."""
  if args.device_type is not None and args.device_type not in DEVICES:
    raise QsyncError(
      f"--device-type {args.device_type!r} is not in the device catalog (qsync_jax.devices.DEVICES). "
      f"Fix: use one of {sorted(DEVICES)}, or add the type's datasheet figures to the catalog."
    )
  if args.batch < 1:
    raise QsyncError(f"--batch {args.batch} must be at least 1. Fix: pass e.g. --batch 32.")
  if args.repeats < 1:
    raise QsyncError(f"--repeats {args.repeats} must be at least 1. Fix: pass e.g. --repeats 10.")
  precisions = [p.strip() for p in args.precisions.split(",")] if args.precisions else None
  unknown = [p for p in precisions or () if p not in PRECISIONS]
  if unknown:
    raise UnsupportedPrecisionError(
      f"--precisions {args.precisions!r}: {unknown} are not precisions. Fix: choose from {list(PRECISIONS)}, "
      "comma-separated (e.g. --precisions fp32,bf16,int8)."
    )
  return precisions


def run(args) -> int:
  from planners.predictor import modeled_profile
  from planners.profiler import measure_profile, traced_profile
  from planners.profiler.measure import noisy_host_warning
  from planners.report import table
  from qsync_jax.train.task import load_task

  precisions = check_arguments(args)
  import jax

  local = device_type_of(jax.devices()[0])
  bad = [p for p in precisions or () if p not in supported_precisions(local)]
  if bad:
    raise UnsupportedPrecisionError(
      f"--precisions {args.precisions!r}: {bad} cannot run on {local}. "
      f"Fix: choose from {list(supported_precisions(local))}."
    )
  task = load_task(args.model)
  if args.device_type and args.device_type != local:
    progress(
      f"{args.device_type} is not the local device ({local}): nothing is measured here; tracing {task.name} "
      f"and modeling {args.device_type}'s costs from the catalog (roofline)"
    )
    prof = modeled_profile(traced_profile(task, args.batch), args.device_type)
  else:
    try:
      prof = measure_profile(
        task,
        args.batch,
        precisions,
        args.repeats,
        progress=progress,
        clock=args.clock,
        checkpoint=f"{args.out}.partial",
      )
    except KeyboardInterrupt:
      raise Interrupted(
        f"interrupted; the timings measured so far are kept in {args.out}.partial. Resume with the same command."
      ) from None
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
  fit = prof.meta.get("fit_preset")
  print(
    f"remainder {sum(prof.remainder_ms.values()):.3f} ms, optimizer {prof.optimizer_ms:.3f} ms"
    + (f", fitted to the measured all-{fit} step {prof.meta['fit_step_ms']:.3f} ms" if fit else "")
  )
  print(f"wrote {args.out}")
  warning = noisy_host_warning(prof)
  if warning:
    print(warning, file=sys.stderr)
  return 0
