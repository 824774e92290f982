"""Replays a ``benchmarks/predictor.py`` run offline: its measured steps and XLA peaks against
the replay of saved profiles, as the code predicts now.

For each model of the run (its rows in ``predictor.jsonl``, chosen by ``--run``): the profile
``<profile-dir>/<model>.json`` refitted to the run's fit steps — fp32, all-int8 and, unless
``--no-16bit``, all-bf16 (``planners.replay.refit_profile``; its XLA peak fits
``other_bytes_16bit``, ``planners.profiler.with_16bit_other_bytes``) — then every other plan's
predicted step against the run's measured one, and the predicted peak of every plan memory is
not fitted to (fp32, all-bf16) against XLA's. Prints the table and appends the rows tagged
``replay-<run>``. Nothing is timed or compiled: it runs on any machine, so a change of the
replay can be scored on GPU runs after the GPU is gone.

  python -m benchmarks.predictor_replay --run gpu-run-3-h100 \
      --profile-dir benchmarks/results/profiles/predictor_h100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from benchmarks.predictor import RESULTS, plans
from benchmarks.result_rows import append_rows, result_row
from benchmarks.step_ops import table_names
from planners.profiler import (
  QUANTIZED_FIT_PRESET,
  SIXTEEN_BIT_FIT_PRESET,
  Profile,
  with_16bit_other_bytes,
)
from planners.replay import fit_presets, memory_fit_presets, predict, refit_profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy


def run_rows(path: str, run: str) -> dict[str, dict[str, dict]]:
  """``{model: {plan: {"step": ms, "peak": bytes, "device": …, "metric": …}}}`` of ``run``'s
  measured steps (``step_ms_<clock>_clock``, fit steps included) and XLA peaks."""
  out: dict[str, dict[str, dict]] = {}
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      if r.get("run") != run or r.get("baseline") is None:
        continue
      model, _, plan = r["case"].partition("/")
      entry = out.setdefault(model, {}).setdefault(plan.removesuffix(" (fit)"), {})
      if r["metric"] == "peak_bytes":
        entry["peak"] = r["baseline"]
      elif r["metric"].startswith("step_ms_") and r["metric"].endswith("_clock"):
        entry.update(step=r["baseline"], metric=r["metric"], device=r["device"])
  return out


def with_in_step_table(prof: Profile, path: str) -> Profile:
  """``prof`` with ``quantized_in_step_ms`` from a ``benchmarks/step_ops.py`` table of the same
  model: its all-int8 plan's ``<op>|fwd`` and ``<op>|bwd`` entries (ops by ``table_names``), as the
  profiler now traces them itself (``planners.steptrace.op_leg_ms``)."""
  with open(path) as f:
    tables = json.load(f)
  if QUANTIZED_FIT_PRESET not in tables:
    raise SystemExit(
      f"{path} has no {QUANTIZED_FIT_PRESET!r} plan (it has {sorted(tables)}). "
      f"Fix: trace it with python -m benchmarks.step_ops --plans {QUANTIZED_FIT_PRESET}."
    )
  table, names = tables[QUANTIZED_FIT_PRESET], table_names(prof.ops)
  traced = {
    op.name: {leg: float(table.get(f"{names[op.name]}|{leg}", 0.0)) for leg in ("fwd", "bwd")}
    for op in prof.ops
  }
  return dataclasses.replace(prof, quantized_in_step_ms=traced)


def in_step_tables(specs: list[str], models: set[str]) -> dict[str, str]:
  """``{model: table path}`` of ``--in-step MODEL=TABLE`` arguments, each naming a model of the
  replay and an existing file; a SystemExit naming the fix otherwise."""
  out = {}
  for spec in specs:
    model, _, path = spec.partition("=")
    if model not in models or not os.path.isfile(path):
      raise SystemExit(
        f"--in-step {spec!r}: needs MODEL=TABLE with MODEL one of {sorted(models)} and TABLE an existing "
        "benchmarks/step_ops.py table. Fix: e.g. --in-step vgg_wide=benchmarks/results/step_kernels/per_op_….json"
      )
    out[model] = path
  return out


def replay_model(prof: Profile, measured: dict[str, dict], sixteen_bit: bool) -> list[tuple]:
  """``[(plan, step fitted?, predicted ms, measured ms, memory fitted?, predicted bytes, XLA
  bytes)]`` of one model."""
  cluster = ClusterSpec.uniform(prof.device_type, 1, prof.batch_per_device, memory_gb=1e3)
  fits = ["fp32", QUANTIZED_FIT_PRESET] + [SIXTEEN_BIT_FIT_PRESET] * sixteen_bit
  steps = [measured.get(p, {}).get("step") for p in fits]
  if steps[0] is None:
    raise SystemExit(
      f"the run has no fp32 step of {prof.model!r}. Fix: pass a run whose rows hold its fit steps."
    )
  if not sixteen_bit:  # the remainder on fp32 alone: no fp32 legs' scale beside it
    prof = dataclasses.replace(prof, fp32_leg_scale=1.0)
  fitted = refit_profile(cluster, prof, *steps)
  if sixteen_bit:  # memory too: the all-bf16 step's XLA peak fits the 16-bit correction
    fitted = with_16bit_other_bytes(fitted, measured.get(SIXTEEN_BIT_FIT_PRESET, {}).get("peak"))
  out = []
  for plan, policy in {"fp32": PrecisionPolicy.uniform("fp32"), **plans(prof.op_names)}.items():
    if plan not in measured or "step" not in measured[plan]:
      continue
    pred = predict(cluster, {prof.device_type: fitted}, Plan(policies={"all": policy}))
    entry = measured[plan]
    memory_fit = plan in memory_fit_presets(fitted)
    out.append(
      (
        plan,
        plan in fits or plan in fit_presets(prof),  # fp16 where its step's relayouts were traced
        pred.step_ms,
        entry["step"],
        memory_fit,
        pred.memory_bytes["all"],
        entry.get("peak"),
      )
    )
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.predictor_replay", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--run", required=True, help="run tag of the measured rows")
  ap.add_argument("--profile-dir", required=True, help="holds <model>.json for every model of the run")
  ap.add_argument("--models", nargs="+", help="default: every model of the run")
  ap.add_argument(
    "--no-16bit",
    action="store_true",
    help="refit to fp32 and all-int8 only (the remainder on fp32, no fp32 leg scale)",
  )
  ap.add_argument(
    "--in-step",
    nargs="+",
    default=[],
    metavar="MODEL=TABLE",
    help="give MODEL's profile the per-op all-int8 step times of a benchmarks/step_ops.py table",
  )
  ap.add_argument("--tag", help="the rows' run tag (default: replay-<run>)")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  measured = run_rows(args.results, args.run)
  if not measured:
    raise SystemExit(f"no rows of run {args.run!r} in {args.results}. Fix: pass a run tag of that file.")
  in_step = in_step_tables(args.in_step, set(args.models or measured))
  tag, rows, t_err, m_err = args.tag or f"replay-{args.run}", [], [], []
  print(
    f"{'model':9s} {'plan':26s} {'pred ms':>8s} {'meas ms':>8s} {'err':>7s} {'pred MB':>8s} {'xla MB':>8s} {'err':>7s}"
  )
  for model in args.models or sorted(measured):
    prof = Profile.load(os.path.join(args.profile_dir, f"{model}.json"))
    if model in in_step:
      prof = with_in_step_table(prof, in_step[model])
    for plan, fit, pred, meas, memory_fit, mem, peak in replay_model(
      prof, measured[model], not args.no_16bit
    ):
      device, metric = measured[model][plan]["device"], measured[model][plan]["metric"]
      extra = {"run": tag, "fit": fit, "sixteen_bit_fit": not args.no_16bit}
      rows.append(result_row("predictor", f"{model}/{plan}", f"{metric}_refit", pred, meas, device, **extra))
      if not fit:
        t_err.append(abs(pred - meas) / meas)
      if peak and not memory_fit:
        m_err.append(abs(mem - peak) / peak)
        rows.append(result_row("predictor", f"{model}/{plan}", "peak_bytes", mem, peak, device, **extra))
      mem_err = f"{100 * (mem - peak) / peak:+6.1f}%" if peak else "      -"
      print(
        f"{model:9s} {plan + (' (fit)' if fit else ''):26s} {pred:8.2f} {meas:8.2f} {100 * (pred - meas) / meas:+6.1f}% "
        f"{mem / 1e6:8.1f} {(peak or 0) / 1e6:8.1f} {mem_err}"
      )
  summary = [
    result_row(
      "predictor",
      "all/mean_abs_step_error_refit",
      "abs_rel_error",
      float(np.mean(t_err)),
      None,
      device,
      run=tag,
    )
  ]
  memory = "no XLA peaks"
  if m_err:  # a run may log no peaks (e.g. a backend without memory analysis)
    summary.append(
      result_row(
        "predictor",
        "all/mean_abs_memory_error",
        "abs_rel_error",
        float(np.mean(m_err)),
        None,
        device,
        run=tag,
      )
    )
    memory = f"mean {100 * np.mean(m_err):.1f} %, max {100 * np.max(m_err):.1f} %"
  print(
    f"\n{len(t_err)} evaluation plans: step |error| mean {100 * np.mean(t_err):.1f} %, max {100 * np.max(t_err):.1f} %; "
    f"memory ({len(m_err)} plans but its fits) {memory}"
  )
  if not args.no_save:
    append_rows(args.results, rows + summary)
    print(f"appended {len(rows) + len(summary)} rows tagged {tag} to {args.results}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
