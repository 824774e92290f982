"""Replays a ``benchmarks/predictor.py`` run offline: its measured steps and XLA peaks against
the replay of its saved profiles, as the code predicts now.

For each model of the run (its rows in ``predictor.jsonl``, chosen by ``--run``): the profile
``<profile-dir>/<model>.json`` fitted as the profiler fits it now (``planners.profiler.fit.fit_profile``)
to the fit step and XLA peaks its meta records — "as profiled" — and, with ``--refit``, to the
fit step timed among the run's plans; then every plan's predicted step against the run's
measured one, and every plan's predicted peak against XLA's. The mean errors are over the plans
the run did not fit anything to (its ``(fit)`` rows are left out, whatever the code fits now),
and memory's over the plans memory is not fitted to (fp32, all-bf16). Nothing is timed or
compiled: it runs on any machine, so a change of the replay can be scored on GPU runs after the
GPU is gone. Prints the table and appends the rows tagged ``replay-<run>``.

  python -m benchmarks.diagnosis.predictor_replay --run gpu-run-8-h100 \
      --profile-dir benchmarks/results/predictor/h100_run8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from benchmarks.common.result_rows import append_rows, result_row
from benchmarks.diagnosis.step_ops import table_names
from benchmarks.predictor import RESULTS, plans
from planners.predictor.graph import QUANTIZED_TRACE_PRESET
from planners.predictor.replay import predict
from planners.profile import Profile
from planners.profiler.fit import SIXTEEN_BIT_PRESET, fit_profile, fit_remainder, one_device
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy

FORMER_META = {
  "sixteen_bit_fit_step_ms": "fit_step_ms",
  "sixteen_bit_step_ms_samples": "fit_step_round_ms",
  "sixteen_bit_xla_peak_bytes": "bf16_xla_peak_bytes",
}
"""Meta keys of profiles measured before ``fit_step_ms`` (their all-bf16 fit step and peak)."""


def with_measurements(prof: Profile) -> Profile:
  """``prof`` with the fit step and XLA peaks ``fit_profile`` reads, from the keys an older
  profile recorded them under (``FORMER_META``: its all-bf16 step; without one, its fp32 step)."""
  meta = dict(prof.meta)
  if "fit_preset" not in meta:
    for old, new in FORMER_META.items():
      if old in meta:
        meta[new] = meta[old]
    meta["fit_preset"] = SIXTEEN_BIT_PRESET if "fit_step_ms" in meta else "fp32"
    meta.setdefault("fit_step_ms", meta.get("fp32_step_ms"))
  return dataclasses.replace(prof, meta=meta)


def fit_preset_of(prof: Profile) -> str:
  """The uniform preset the current code fits ``prof``'s remainder to."""
  return with_measurements(prof).meta["fit_preset"]


def run_rows(path: str, run: str) -> dict[str, dict[str, dict]]:
  """``{model: {plan: {"step": ms, "peak": bytes, "fit": bool, "device": …, "metric": …}}}`` of
  ``run``'s measured steps (``step_ms_<clock>_clock``, fit steps included) and XLA peaks."""
  out: dict[str, dict[str, dict]] = {}
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      if r.get("run") != run or r.get("baseline") is None:
        continue
      model, _, plan = r["case"].partition("/")
      entry = out.setdefault(model, {}).setdefault(plan.removesuffix(" (fit)"), {})
      entry["fit"] = entry.get("fit", False) or plan.endswith(" (fit)")
      if r["metric"] == "peak_bytes":
        entry["peak"] = r["baseline"]
      elif r["metric"].startswith("step_ms_") and r["metric"].endswith("_clock"):
        entry.update(step=r["baseline"], metric=r["metric"], device=r["device"])
  return out


def with_in_step_table(prof: Profile, path: str) -> Profile:
  """``prof`` with ``quantized_in_step_ms`` from a ``benchmarks/diagnosis/step_ops.py`` table of
  the same model: its all-int8 plan's ``<op>|fwd`` and ``<op>|bwd`` entries (ops by ``table_names``)."""
  with open(path) as f:
    tables = json.load(f)
  if QUANTIZED_TRACE_PRESET not in tables:
    raise SystemExit(
      f"{path} has no {QUANTIZED_TRACE_PRESET!r} plan (it has {sorted(tables)}). "
      f"Fix: trace it with python -m benchmarks.diagnosis.step_ops --plans {QUANTIZED_TRACE_PRESET}."
    )
  table, names = tables[QUANTIZED_TRACE_PRESET], table_names(prof.ops)
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
        "benchmarks/diagnosis/step_ops.py table. Fix: e.g. --in-step vgg_wide=benchmarks/results/step_ops/per_op_….json"
      )
    out[model] = path
  return out


def replay_model(prof: Profile, measured: dict[str, dict], refit: bool) -> list[tuple]:
  """``[(plan, fitted in the run?, predicted ms, measured ms, memory fitted?, predicted bytes,
  XLA bytes)]`` of one model, its profile fitted ``as profiled`` or, with ``refit``, its
  remainder to the run's own fit step."""
  fitted = fit_profile(with_measurements(prof))
  preset = fitted.meta["fit_preset"]
  if refit:
    if "step" not in measured.get(preset, {}):
      raise SystemExit(f"the run has no {preset} step of {prof.model!r}. Fix: pass a run with its fit step.")
    fitted = fit_remainder(fitted, preset, measured[preset]["step"])
  memory_fits = ("fp32", SIXTEEN_BIT_PRESET) if "other_bytes_16bit" in fitted.memory else ("fp32",)
  cluster = one_device(prof)
  out = []
  for plan, policy in {"fp32": PrecisionPolicy.uniform("fp32"), **plans(prof.op_names)}.items():
    if plan not in measured or "step" not in measured[plan]:
      continue
    pred = predict(cluster, {prof.device_type: fitted}, Plan(policies={"all": policy}))
    entry = measured[plan]
    out.append(
      (
        plan,
        entry["fit"],
        pred.step_ms,
        entry["step"],
        plan in memory_fits,
        pred.memory_bytes["all"],
        entry.get("peak"),
      )
    )
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.predictor_replay", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--run", required=True, help="run tag of the measured rows")
  ap.add_argument("--profile-dir", required=True, help="holds <model>.json for every model of the run")
  ap.add_argument("--models", nargs="+", help="default: every model of the run")
  ap.add_argument("--refit", action="store_true", help="fit the remainder to the run's own fit step")
  ap.add_argument(
    "--in-step",
    nargs="+",
    default=[],
    metavar="MODEL=TABLE",
    help="give MODEL's profile the per-op all-int8 step times of a benchmarks/diagnosis/step_ops.py table",
  )
  ap.add_argument("--tag", help="the rows' run tag (default: replay-<run>)")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  args = ap.parse_args(argv)
  measured = run_rows(args.results, args.run)
  if not measured:
    raise SystemExit(f"no rows of run {args.run!r} in {args.results}. Fix: pass a run tag of that file.")
  in_step = in_step_tables(args.in_step, set(args.models or measured))
  tag, rows, t_err, m_err, unfitted = args.tag or f"replay-{args.run}", [], [], [], []
  metric_suffix = "_refit" if args.refit else "_replay"
  print(
    f"{'model':9s} {'plan':26s} {'pred ms':>8s} {'meas ms':>8s} {'err':>7s} {'pred MB':>8s} {'xla MB':>8s} {'err':>7s}"
  )
  device = None
  for model in args.models or sorted(measured):
    prof = Profile.load(os.path.join(args.profile_dir, f"{model}.json"))
    if model in in_step:
      prof = with_in_step_table(prof, in_step[model])
    for plan, fit, pred, meas, memory_fit, mem, peak in replay_model(prof, measured[model], args.refit):
      device, metric = measured[model][plan]["device"], measured[model][plan]["metric"]
      extra = {"run": tag, "fit": fit}
      rows.append(
        result_row("predictor", f"{model}/{plan}", f"{metric}{metric_suffix}", pred, meas, device, **extra)
      )
      if not fit:
        t_err.append(abs(pred - meas) / meas)
      elif plan != fit_preset_of(prof):  # fitted in the run, predicted now
        unfitted.append(abs(pred - meas) / meas)
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
      f"all/mean_abs_step_error{metric_suffix}",
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
  if unfitted:
    print(f"the run's other {len(unfitted)} fit plans, predicted now: mean {100 * np.mean(unfitted):.1f} %")
  if not args.no_save:
    append_rows(args.results, rows + summary)
    print(f"appended {len(rows) + len(summary)} rows tagged {tag} to {args.results}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
