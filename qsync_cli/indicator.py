"""``qsync indicator``: the sensitivity table Ω[op][precision] of a model, as JSON.

  qsync indicator --model vgg --out omega.json [--batches 16] [--method gradient]
                  [--train-steps 40] [--batch-size 32] [--precisions int8 fp16]
                  [--estimator moments|sample|batch|signed]

``--model`` is a registered task name (``qsync_jax.train.task``, e.g. the examples' ``vgg``) or
``package.module:fn`` returning a ``qsync_jax.train.task.Task``. The model starts from the parameters
``qsync train --seed S`` starts from; with ``--train-steps N`` it is first trained N steps in
fp32 by the library's ``Trainer`` (a fresh init's gradients say little about a trained model's
sensitivity).
"""

from __future__ import annotations

import argparse
import sys

from qsync_cli.common import add_model_argument
from qsync_jax.errors import QsyncError

HELP = "Score every quantizable op's sensitivity to each precision (Ω table, JSON)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
  from planners.indicator import ESTIMATORS, METHODS, PROBED_PRECISIONS

  add_model_argument(parser)
  parser.add_argument("--out", required=True, help="where to write the JSON table")
  parser.add_argument("--batches", type=int, default=16, help="training batches to average over (default 16)")
  parser.add_argument(
    "--method", choices=METHODS, default="gradient", help="indicator (default: gradient, ours)"
  )
  parser.add_argument(
    "--estimator",
    choices=ESTIMATORS,
    default="moments",
    help="gradient method only: mean square of a batch's loss change (moments, default), per-sample "
    "mean square, squared change per probed batch, or signed mean loss change",
  )
  parser.add_argument("--precisions", nargs="+", default=list(PROBED_PRECISIONS), help="precisions to score")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument(
    "--train-steps", type=int, default=0, help="fp32 training steps before probing (default 0)"
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--payload-devices",
    type=int,
    nargs="*",
    metavar="N",
    help="gradient method only: the device counts at which to measure each gradient sync's payload "
    "accuracy cost (planners.indicator.payload_cost; each N at most --batches; default 2 4 8, those up to "
    "--batches; none given: not measured)",
  )


def format_table(table: dict) -> str:
  """The Ω table as text: one row per op, one column per precision; "-" where the op has no Ω at
  that precision, and a line under the table saying why (``metadata["no_8bit"]``: a grouped
  convolution runs no 8-bit leg, so it has no 8-bit entries)."""
  precisions = table["precisions"]
  lines = [f"{'op':50s} " + " ".join(f"{p:>10s}" for p in precisions)]
  for op in table["ops"]:
    row = table["omega"][op]
    lines.append(
      f"{op:50s} " + " ".join(f"{row[p]:10.3g}" if p in row else f"{'-':>10s}" for p in precisions)
    )
  lines += payload_table_lines(table.get("payload"))
  why = table.get("metadata", {}).get("no_8bit", {})
  for reason in sorted(set(why.values())):
    ops = [op for op in table["ops"] if why.get(op) == reason]
    lines.append(
      f"- no 8-bit score for {len(ops)} op(s) ({', '.join(ops[:3])}{', …' if len(ops) > 3 else ''}): each is "
      f'{reason}. They train at 16 bits or fp32; a policy rule with "where_supported": true runs its 8-bit '
      "precision on the other ops and leaves these to the next rule."
    )
  return "\n".join(lines)


def payload_table_lines(section) -> list[str]:
  """The measured payloads (``planners.indicator.payload_cost``), one line per sync; none without."""
  if not section:
    return []
  lines = [
    f"payload accuracy cost against fp32 at n devices: Ω (one {section['optimizer']} update at lr "
    f"{section['lr']:g}), E‖δ‖² (‖ḡ‖² = {section['gradient2']:.3g})"
  ]
  for sync, by_n in section["syncs"].items():
    cells = [f"{n}: Ω {f['omega']:.3g}, E‖δ‖² {f['error2']:.3g}" for n, f in by_n.items()]
    lines.append(f"  {sync:<12s} " + "; ".join(cells))
  return lines


def payload_devices(args: argparse.Namespace) -> list[int]:
  """The device counts at which ``qsync indicator`` measures the payloads: ``--payload-devices``, by
  default those of ``DEFAULT_DEVICES`` up to ``--batches``; none for a method other than
  ``gradient`` (the payload's Ω is on its scale)."""
  from planners.indicator.payload_cost import DEFAULT_DEVICES

  if args.method != "gradient":
    return []
  if args.payload_devices is None:
    return [n for n in DEFAULT_DEVICES if n <= args.batches]
  return sorted(set(args.payload_devices))


def _progress(done: int, total: int) -> None:
  bar = "#" * (20 * done // total)
  print(f"\r  probing [{bar:20s}] {done}/{total} batches", end="\n" if done == total else "", file=sys.stderr)


def check_arguments(args: argparse.Namespace) -> None:
  """The options' constraints, checked before the model is built."""
  from planners.indicator import PROBED_PRECISIONS

  if args.batches < 1:
    raise QsyncError(f"--batches {args.batches} must be at least 1. Fix: pass e.g. --batches 8.")
  if args.batch_size < 1:
    raise QsyncError(f"--batch-size {args.batch_size} must be at least 1. Fix: pass e.g. --batch-size 32.")
  if args.train_steps < 0:
    raise QsyncError(f"--train-steps {args.train_steps} must be 0 or more. Fix: pass e.g. --train-steps 40.")
  for n in args.payload_devices or ():
    if not 1 <= n <= args.batches:
      raise QsyncError(
        f"--payload-devices {n}: each simulated device takes one of the --batches {args.batches} batches, so "
        f"N must be from 1 to {args.batches}. Fix: pass --batches {max(n, 1)} or more, or a smaller N."
      )
  bad = [p for p in args.precisions if p not in PROBED_PRECISIONS]
  if bad:
    raise QsyncError(
      f"--precisions {' '.join(bad)}: the indicator scores only {list(PROBED_PRECISIONS)} (fp32 is the "
      f"reference, Ω = 0). Fix: pass some of them, e.g. --precisions {' '.join(PROBED_PRECISIONS)}."
    )


def run(args: argparse.Namespace) -> int:
  from planners.indicator import compute, initial_variables, save, unreached_note
  from qsync_jax.train.task import load_task

  check_arguments(args)
  task = load_task(args.model)
  stream = task.train_batches(args.batch_size, args.seed + 1)
  batches = [next(stream) for _ in range(args.batches)]
  variables = initial_variables(task, args.seed, args.train_steps, args.batch_size)
  print(f"qsync indicator: {args.method} on {task.name}, {args.batches} batches of {args.batch_size}")
  tables = compute(
    task,
    variables,
    batches,
    [args.method],
    tuple(args.precisions),
    seed=args.seed,
    gradient_estimator=args.estimator,
    progress=_progress,
  )
  table = tables[args.method]
  devices = payload_devices(args)
  if devices:
    from planners.indicator.payload_cost import measure_payload

    print(
      f"qsync indicator: measuring the gradient syncs' payloads at {', '.join(map(str, devices))} devices"
    )
    table["payload"] = measure_payload(task, variables, batches, devices, seed=args.seed)
  save(table, args.out)
  print(format_table(table))
  note = unreached_note(table, args.train_steps)
  if note:
    print(f"qsync indicator: warning: {note}")
  print(f"wrote {args.out} ({len(table['ops'])} ops)")
  return 0
