"""Does a training step's time depend on the process it runs in? Several executables of the same
steps, timed round-robin, round by round.

``benchmarks/predictor.py`` times its profile's fit steps (fp32, all-int8, all-bf16) and later
its plans in one process; on an H100 ``vgg_wide``'s all-bf16 step has come out at 1.45 ms in the
first and 1.60-1.67 ms in the second. This benchmark
compiles each of ``--presets`` ``--compiles`` times (each compile is its own executable, with
its own state) plus ``--others`` once each, then times all of them round-robin
(``planners.profiler.timing.time_train_steps_interleaved``, the predictor's timing) and prints every
round, so that a drift over the rounds, a slow executable, or a dependence on how many
executables share the process shows. Each copy's median is reported against the first copy of
its preset, measured in the same rounds. On a GPU each round's line also gives the GPU's SM
clock, power and temperature after it (``nvidia-smi``), so that a clock or thermal drift shows.

  python -m benchmarks.diagnosis.step_drift --model vgg_wide --presets bf16 --compiles 3 \
      --others fp32 int8 --rounds 10
"""

from __future__ import annotations

import argparse
import subprocess

import jax
import numpy as np

from benchmarks.common import zoo
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.predictor import measured_clock
from planners.profiler import timing
from qsync_jax.policy import PrecisionPolicy

RESULTS = results_path("step_drift")


def executables(presets, compiles: int, others) -> dict[str, PrecisionPolicy]:
  """``{name: policy}``: ``<preset>#<i>`` for each of ``presets`` and ``i`` in 1..compiles, then
  each of ``others`` once (``<preset>#1``)."""
  names = [f"{p}#{i}" for p in presets for i in range(1, compiles + 1)]
  names += [f"{p}#1" for p in others if p not in presets]
  return {name: PrecisionPolicy.uniform(name.partition("#")[0]) for name in names}


def gpu_state() -> str:
  """The GPU's SM clock, power draw and temperature now (``nvidia-smi``), or ``""`` where there
  is no ``nvidia-smi``."""
  query = "--query-gpu=clocks.sm,power.draw,temperature.gpu"
  try:
    done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
  except OSError:
    return ""
  return done.stdout.strip().replace("\n", " / ")


def progress(message: str) -> None:
  """Prints a timing progress line; a finished round's with ``gpu_state``."""
  state = gpu_state() if message.startswith("round") else ""
  print(f"# {message}" + (f" | GPU {state}" if state else ""), flush=True)


def rows_of(model, timed, device, clock, run=None) -> list[dict]:
  """One row per executable: its median step (of the round medians) against the first copy of
  its preset over the same rounds (a late copy ran the last rounds alone), with its round
  medians."""
  out = []
  for name, (ms, rounds, _) in timed.items():
    first_rounds = timed[f"{name.partition('#')[0]}#1"][1][-len(rounds) :]
    extra = {"rounds": [float(r) for r in rounds], **({"run": run} if run else {})}
    out.append(
      result_row(
        "step_drift",
        f"{model}/{name}",
        f"step_ms_{clock}_clock",
        ms,
        float(np.median(first_rounds)),
        device,
        **extra,
      )
    )
  return out


def timed_with_late_copies(task, policies, batch, args) -> dict[str, tuple[float, list[float], int | None]]:
  """As ``timing.time_train_steps_interleaved`` on ``args``'s clock, with one more copy of each of
  ``args.presets`` (``<preset>#late``) compiled after the first half of the rounds and timed in
  the second half beside the others."""
  clock = measured_clock(args.clock)
  compiled = {name: timing.compiled_train_step(task, pol, batch) for name, pol in policies.items()}
  first = args.rounds // 2
  medians = timing.time_round_robin(
    {n: run for n, (run, _) in compiled.items()}, args.repeats, first, (clock,), progress, 1, args.rounds
  )[clock]
  for preset in args.presets:
    compiled[f"{preset}#late"] = timing.compiled_train_step(task, PrecisionPolicy.uniform(preset), batch)
    progress(f"compiled {preset}#late")
  later = timing.time_round_robin(
    {n: run for n, (run, _) in compiled.items()},
    args.repeats,
    args.rounds - first,
    (clock,),
    progress,
    first + 1,
    args.rounds,
  )[clock]
  rounds = {name: medians.get(name, []) + later[name] for name in compiled}
  return {name: (float(np.median(r)), r, compiled[name][1]) for name, r in rounds.items()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.step_drift", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--model", default="mlp", help="a model of benchmarks.common.zoo.MODELS")
  ap.add_argument("--presets", nargs="+", default=["bf16"], help="compiled --compiles times each")
  ap.add_argument("--compiles", type=int, default=2)
  ap.add_argument("--others", nargs="*", default=["fp32", "int8"], help="compiled once each")
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument(
    "--repeats",
    type=int,
    help="steps per executable and round (default: timing.default_step_repeats of the clock)",
  )
  ap.add_argument("--clock", choices=["wall", "cpu", "pipelined"], help="default: as predictor.py's")
  ap.add_argument(
    "--late",
    action="store_true",
    help="compile one more copy of each of --presets (<preset>#late) after half the rounds: one that "
    "starts fast beside slow earlier copies says the drift follows the steps an executable has taken",
  )
  ap.add_argument("--run", help="a tag every row carries")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  if args.compiles < 1 or args.rounds < (2 if args.late else 1):
    raise SystemExit(
      "--compiles must be at least 1 and --rounds at least 1 (2 with --late). Fix: pass larger counts."
    )
  clock = measured_clock(args.clock)
  args.repeats = args.repeats or timing.default_step_repeats(clock)
  task, batch_size = zoo.get(args.model)
  batch = timing.device_batch(task, batch_size)
  policies = executables(args.presets, args.compiles, args.others)
  timed = (
    timed_with_late_copies(task, policies, batch, args)
    if args.late
    else timing.time_train_steps_interleaved(
      task,
      policies,
      batch,
      args.repeats,
      args.rounds,
      clocks=(clock,),
      progress=progress,
    )[clock]
  )
  device = jax.devices()[0].device_kind
  rows = rows_of(args.model, timed, device, clock, args.run)
  print(f"\n{args.model} on {device}, {clock} clock, ms per step, {args.rounds} rounds")
  print(f"{'executable':12s} {'median':>8s} {'vs #1':>7s} {'spread':>7s}  rounds")
  for r in rows:
    rounds = r["rounds"]
    spread = 100 * (max(rounds) - min(rounds)) / float(np.median(rounds))
    print(
      f"{r['case'].partition('/')[2]:12s} {r['value']:8.3f} {r['ratio']:7.3f} {spread:6.1f}%  "
      + " ".join(f"{x:.3f}" for x in rounds)
    )
  if not args.no_save:
    append_rows(args.results, rows)
    print(f"appended {len(rows)} rows to {args.results}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
