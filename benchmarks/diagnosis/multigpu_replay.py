"""Replays measured multi-GPU scaling steps with a saved profile: the predictor, offline.

``benchmarks/multigpu.py`` measures scaling steps on a multi-GPU host and prints the link fits
(``benchmarks.common.link``) it measured there; the op profile may come from another machine of
the same GPU type (``--profile-file``). This script predicts the scaling cases of one run (its rows in
``multigpu.jsonl``, chosen by ``--run``) from a profile and the link fits given on the command
line, prints predicted against measured — from the profile as it is, and refitted to the
run's fp32 step per device count (``multigpu.predictor_rows``), for the one-process and the
one-process-per-GPU steps — and appends those rows tagged ``replay-<run>``. Nothing here is
timed: it runs on any machine.

  python -m benchmarks.diagnosis.multigpu_replay --run run5-h100x4-order \
      --profile benchmarks/results/multigpu/lm_d768_l4_b8_h100_device_clock.json \
      --link 2:197:152 --link 4:269:269
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.common.link import LinkModel
from benchmarks.common.result_rows import append_rows
from benchmarks.multigpu import RESULTS, predictor_rows
from planners.profile import Profile

STEP_METRICS = {"wall": "step_time_ms_median", "pipelined": "step_time_ms_pipelined"}
"""The rows of the steps waited for one by one, and of those dispatched back to back."""


def measured_steps(path: str, run: str, clock: str = "wall") -> tuple[dict, dict, str, str]:
  """``(one process, one process per GPU, device, model)`` of ``run``'s rows in ``path``: each
  set ``{(case name, devices): step s}``, from the ``scaling/…`` and ``multiprocess/…`` rows
  of ``clock`` (``STEP_METRICS``)."""
  single, multi, device, model = {}, {}, "", ""
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      kind, _, rest = r["case"].partition("/")
      if r.get("run") != run or r["metric"] != STEP_METRICS[clock] or kind not in ("scaling", "multiprocess"):
        continue
      name, n = rest.split("/")
      (single if kind == "scaling" else multi)[(name, int(n[1:]))] = r["value"] / 1e3
      device, model = r["device"], r.get("model", "")
  return single, multi, device, model


def parse_link(text: str) -> tuple[int, float, float]:
  """``"N:GBps:us"`` → (devices, GB/s, µs per all-reduce)."""
  n, gbps, us = text.split(":")
  return int(n), float(gbps), float(us)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.multigpu_replay", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--run", required=True, help="run tag of the measured rows in the results file")
  parser.add_argument(
    "--profile", required=True, help="profile JSON (qsync profile / multigpu.py --profile-file)"
  )
  parser.add_argument("--link", action="append", default=[], help="N:GB/s:µs of a link fit (repeatable)")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--no-save", action="store_true")
  parser.add_argument(
    "--clock",
    choices=sorted(STEP_METRICS),
    default="wall",
    help="which measured steps: waited for, or pipelined",
  )
  args = parser.parse_args(argv)

  prof = Profile.load(args.profile)
  links = {n: LinkModel(n, 8 * gbps, us, float("nan")) for n, gbps, us in map(parse_link, args.link)}
  single, multi, device, model = measured_steps(args.results, args.run, args.clock)
  if not single and not multi:
    print(f"no scaling rows of run {args.run!r} in {args.results}")
    return 1
  print(
    f"replay of {args.run} with {args.profile} ({prof.meta.get('op_clock', prof.meta.get('clock'))} clock)"
  )
  profiled = set(prof.meta.get("precisions") or next(iter(prof.op_ms.values()))["fwd"])
  rows = []
  for label, steps in (("predictor", single), ("predictor-mp", multi)):
    steps = {(name, n): s for (name, n), s in steps.items() if n == 1 or n in links}  # no link fit: no replay
    if steps:
      one = single.get(("fp32", 1))  # the one-process run's: the multi-process run has no n=1
      rows += predictor_rows(prof, profiled, links, steps, prof.batch_per_device, device, label, one)
  tag = {
    "run": f"replay-{args.run}",
    "profile": os.path.basename(args.profile),
    "model": model,
    "clock": args.clock,
  }
  if not args.no_save:
    append_rows(args.results, [{**r, **tag} for r in rows])
  return 0


if __name__ == "__main__":
  sys.exit(main())
