"""Replays measured multi-GPU scaling steps with a saved profile: the predictor, offline.

``benchmarks/multigpu.py`` measures scaling steps on a multi-GPU host and prints the link fits
(``planners.link``) it measured there; the op profile may come from another machine of the same
GPU type (``--profile-file``). This script predicts the scaling cases of one run (its rows in
``multigpu.jsonl``, chosen by ``--run``) from a profile and the link fits given on the command
line, prints predicted against measured, and appends ``predictor`` rows tagged
``replay-<run>``. Nothing here is timed: it runs on any machine.

  python benchmarks/multigpu_replay.py --run run5-h100x4-order \
      --profile benchmarks/results/profiles/lm_d768_l4_b8_h100_device_clock.json \
      --link 2:197:152 --link 4:269:269
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from multigpu import RESULTS, predict_case
from result_rows import append_rows, result_row

from planners.link import LinkModel
from planners.profiler import Profile


def measured_steps(path: str, run: str) -> dict[tuple[str, int], tuple[float, str, str]]:
  """``{(case name, devices): (median step ms, device, model)}`` of the scaling rows of ``run``."""
  out = {}
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      if r.get("run") == run and r["case"].startswith("scaling/") and r["metric"] == "step_time_ms_median":
        _, name, n = r["case"].split("/")
        out[(name, int(n[1:]))] = (r["value"], r["device"], r.get("model", ""))
  return out


def parse_link(text: str) -> tuple[int, float, float]:
  """``"N:GBps:us"`` → (devices, GB/s, µs per all-reduce)."""
  n, gbps, us = text.split(":")
  return int(n), float(gbps), float(us)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--run", required=True, help="run tag of the measured rows in the results file")
  parser.add_argument(
    "--profile", required=True, help="profile JSON (qsync profile / multigpu.py --profile-file)"
  )
  parser.add_argument("--link", action="append", default=[], help="N:GB/s:µs of a link fit (repeatable)")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--no-save", action="store_true")
  args = parser.parse_args(argv)

  prof = Profile.load(args.profile)
  links = {n: (gbps, us) for n, gbps, us in map(parse_link, args.link)}
  steps = measured_steps(args.results, args.run)
  if not steps:
    print(f"no scaling rows of run {args.run!r} in {args.results}")
    return 1
  print(
    f"replay of {args.run} with {args.profile} ({prof.meta.get('op_clock', prof.meta.get('clock'))} clock)"
  )
  print(f"{'case':<14} {'devices':>7} {'pred ms':>8} {'meas ms':>8} {'error':>7} {'comm ms':>8}")
  rows, errors = [], []
  for (name, n), (meas, device, model) in sorted(steps.items()):
    if name.endswith("-tree") or (n > 1 and n not in links):
      continue  # "-tree" compiles to the default's collectives; no link fit for n: nothing to replay
    link = None
    if n > 1:
      gbps, us = links[n]
      link = LinkModel(n, 8 * gbps, us, float("nan"))
    pred = predict_case(prof, name, n, prof.batch_per_device, link)
    err = (pred.step_ms - meas) / meas
    errors.append(abs(err))
    print(f"{name:<14} {n:>7} {pred.step_ms:>8.2f} {meas:>8.2f} {100 * err:>+6.1f}% {pred.comm_ms:>8.2f}")
    rows.append(
      result_row(
        "multigpu",
        f"predictor/{name}/n{n}",
        "step_time_ms",
        pred.step_ms,
        meas,
        device,
        run=f"replay-{args.run}",
        profile=os.path.basename(args.profile),
        model=model,
      )
    )
  print(
    f"mean |error| {100 * np.mean(errors):.1f} % over {len(errors)} cases (max {100 * max(errors):.1f} %)"
  )
  if not args.no_save:
    append_rows(args.results, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
