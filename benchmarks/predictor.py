"""Predictor error: predicted vs measured step time and memory on plans not used to fit anything.

For each model (``benchmarks.common.zoo.MODELS``: ``mlp``, ``lm``, ``vgg`` on a CPU; ``mlp_base``,
``vgg_wide``, ``lm_base``… on a GPU): measure its profile on the local device
(``planners.profiler.measure.measure_profile``: op legs and whole-policy programs standalone,
casts, the optimizer, the all-bf16 step — which fits the remainder — and the compiled fp32 and
all-bf16 steps — which fit the memory corrections), then for every evaluation plan (uniform and mixed, never the fit step; marked
``(fit)``) compare

* the replay's predicted step time with the measured median of the jitted single-device
  training step (the step is fed its own donated outputs, as in training), and
* the predicted peak memory with XLA's ``compiled.memory_analysis()`` (arguments + outputs
  − aliased + temporaries), for every plan but those memory is fitted to: fp32, and all-bf16.

The baseline of the ratio column is the measured step time (ratio = predicted / measured).
Targets: mean |error| ≤ 5 % on the CPU (≤ 3 % on an H100), memory within 10 %.

The plans are compiled first and timed round-robin over ``--rounds`` rounds
(``planners.profiler.timing.time_train_steps_interleaved``: the median of the round medians), so that
slow drift of the host falls on every plan alike. With ``--refit`` the error is reported a
second time with the remainder refitted to the fit step timed among the plans
(``planners.profiler.fit.fit_remainder``). Where the profile traced its all-int8 step (on a GPU) every plan
is also predicted from the same profile without the in-step factors (``no_in_step``).

  python -m benchmarks.predictor [--models lm vgg mlp] [--repeats N] [--rounds 3] [--refit]

On a GPU, the GPU-sized models and saved profiles (a profile cut short resumes):

  python -m benchmarks.predictor --models mlp_base vgg_wide lm_base --profile-dir DIR --refit
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from benchmarks.common import zoo
from benchmarks.common.result_rows import append_rows, result_row, results_path
from planners.predictor.replay import predict
from planners.profile import Profile
from planners.profiler import timing
from planners.profiler.fit import SIXTEEN_BIT_PRESET, fit_profile, fit_remainder
from planners.profiler.measure import measure_profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.train.task import Task

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "fp8")
"""Profiled precisions: those the evaluation plans use."""
RESULTS = results_path("predictor")


def measured_clock(requested: str | None = None) -> str:
  """The clock every timing of a benchmark run uses: ``requested``, else process CPU time on a
  CPU host (shared with other work) and ``timing.default_step_clock()`` on an accelerator."""
  return requested or ("cpu" if jax.devices()[0].platform == "cpu" else timing.default_step_clock())


def mixed(op_names, pattern) -> PrecisionPolicy:
  """Op i gets ``pattern[i % len(pattern)]`` (a preset name)."""
  return PrecisionPolicy.from_ops(
    {n: OpPolicy.preset(pattern[i % len(pattern)]) for i, n in enumerate(op_names)}
  )


def plans(op_names) -> dict[str, PrecisionPolicy]:
  """Uniform presets and mixed per-op assignments (the caller adds fp32)."""
  half = len(op_names) // 2
  return {
    "bf16": PrecisionPolicy.uniform("bf16"),
    "fp16": PrecisionPolicy.uniform("fp16"),
    "int8_fwd": PrecisionPolicy.uniform("int8_fwd"),
    "int8": PrecisionPolicy.uniform("int8"),
    "fp8": PrecisionPolicy.uniform("fp8"),
    "mixed int8_fwd/bf16": mixed(op_names, ["int8_fwd", "bf16"]),
    "mixed fp32/fp16/int8_fwd": mixed(op_names, ["fp32", "fp16", "int8_fwd"]),
    "first half fp8": PrecisionPolicy.from_ops({n: OpPolicy.preset("fp8") for n in op_names[:half]}),
  }


def saved_profile(path: str | None, measure: Callable[[str | None], Profile], say) -> Profile:
  """The profile saved at ``path`` if there; else ``measure(checkpoint)`` — the checkpoint
  ``<path>.partial``, so that a run cut short resumes — saved at ``path``. No path: measured,
  not saved. ``say`` reports which."""
  if path and os.path.exists(path):
    prof = Profile.load(path)
    say(f"profile {path} ({prof.meta.get('device_kind', prof.device_type)})")
    return prof
  t0 = time.perf_counter()
  prof = measure(f"{path}.partial" if path else None)
  say(f"profiled {len(prof.ops)} ops in {time.perf_counter() - t0:.0f} s")
  if path:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.save(path)
  return prof


def model_profile(model: str, task: Task, batch_size: int, clock: str, args) -> Profile:
  """``model``'s profile, saved in ``args.profile_dir`` (``saved_profile``)."""
  return saved_profile(
    os.path.join(args.profile_dir, f"{model}.json") if args.profile_dir else None,
    lambda checkpoint: measure_profile(
      task,
      batch_size,
      repeats=args.profile_repeats,
      step_repeats=args.repeats,
      clock=clock,
      progress=lambda msg: print(f"# {model} profile: {msg}", flush=True),
      checkpoint=checkpoint,
    ),
    lambda msg: print(f"# {model}: {msg}", flush=True),
  )


def alternative_profiles(prof: Profile) -> dict[str, Profile]:
  """Other profiles every plan is also predicted from, by name (its rows' metric suffix):
  ``no_in_step`` where the profile traced its all-int8 step (the same profile without
  ``quantized_in_step_ms``, refitted to its own fit step): the in-step factors' gain, measured
  on the same steps."""
  if not prof.quantized_in_step_ms:
    return {}
  return {"no_in_step": fit_profile(dataclasses.replace(prof, quantized_in_step_ms={}))}


def priceable(model: str, cluster, prof: Profile, cases: dict[str, PrecisionPolicy]) -> dict:
  """The ``cases`` the profile can price; the others are said and left out (a saved profile
  of fewer precisions, e.g. no fp8)."""
  out = {}
  for name, pol in cases.items():
    try:
      predict(cluster, {prof.device_type: prof}, Plan(policies={"all": pol}))
    except PlanError as e:
      print(f"# {model}: {name} left out: {str(e).splitlines()[0]}", flush=True)
    else:
      out[name] = pol
  return out


def tagged(rows: list[dict], run: str | None) -> list[dict]:
  """``rows``, each with ``"run": run`` when a run tag is given."""
  return [r | ({"run": run} if run else {}) for r in rows]


def row_json(model, case, metric, value, baseline, device):
  return result_row("predictor", f"{model}/{case}", metric, value, baseline, device)


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.predictor", description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=["mlp", "lm", "vgg"], help="of benchmarks.common.zoo.MODELS")
  ap.add_argument(
    "--repeats",
    type=int,
    help="timed repeats of each step (default: timing.default_step_repeats of the clock)",
  )
  ap.add_argument("--profile-repeats", type=int, default=10)
  ap.add_argument(
    "--clock",
    choices=["wall", "cpu", "pipelined"],
    help="clock of every timing, profile and measured steps alike (default: cpu — process CPU "
    "time — on a CPU host shared with other work; on accelerators pipelined — steps dispatched "
    "back to back, as the trainer runs them)",
  )
  ap.add_argument("--no-save", action="store_true")
  ap.add_argument("--run", help="a tag every row of this run carries (its 'run' field)")
  ap.add_argument(
    "--profile-dir",
    help="each model's profile: loaded from <dir>/<model>.json if there, else measured and saved there "
    "(an interrupted profile resumes from <model>.json.partial)",
  )
  ap.add_argument("--results", default=RESULTS, help=f"JSON lines file to append to (default {RESULTS})")
  ap.add_argument(
    "--rounds",
    type=int,
    default=3,
    help="time the plans round-robin over this many rounds (median of rounds)",
  )
  ap.add_argument(
    "--refit",
    action="store_true",
    help="also report the error with the remainder refitted to the fit step timed among the plans",
  )
  args = ap.parse_args(argv)
  device = jax.devices()[0].device_kind
  clock = measured_clock(args.clock)
  args.repeats = args.repeats or timing.default_step_repeats(clock)
  rows, out, refitted = [], [], []
  variant_errors: dict[str, list[float]] = {}
  for model in args.models:
    task, batch_size = zoo.get(model)
    prof = model_profile(model, task, batch_size, clock, args)
    variants = alternative_profiles(prof)
    cluster = ClusterSpec.uniform(prof.device_type, 1, batch_size, memory_gb=1e3)
    batch = timing.device_batch(task, batch_size)
    fit = (prof.meta["fit_preset"],)
    cases = priceable(
      model,
      cluster,
      prof,
      {
        f"{name} (fit)" if name in fit else name: pol
        for name, pol in {"fp32": PrecisionPolicy.uniform("fp32"), **plans(prof.op_names)}.items()
      },
    )
    timed = timing.time_train_steps_interleaved(
      task,
      cases,
      batch,
      args.repeats,
      args.rounds,
      clocks=(clock,),
      progress=lambda msg, model=model: print(f"# {model}: {msg}", flush=True),
      skip=(jax.errors.JaxRuntimeError,),  # e.g. XLA:CPU has no batched bf16 x bf16 -> f32 dot
    )[clock]
    fitted = None
    if args.refit and f"{fit[0]} (fit)" in timed:
      fitted = fit_remainder(prof, fit[0], timed[f"{fit[0]} (fit)"][0])
    memory_fits = ("fp32", SIXTEEN_BIT_PRESET) if "other_bytes_16bit" in prof.memory else ("fp32",)
    for case, (meas, round_medians, peak) in timed.items():
      plan = Plan(policies={"all": cases[case]})
      pred = predict(cluster, {prof.device_type: prof}, plan)
      spread = (max(round_medians) - min(round_medians)) / meas
      mem = pred.memory_bytes["all"]
      err_t, err_m = (pred.step_ms - meas) / meas, (mem - peak) / peak if peak else float("nan")
      rows.append(
        (
          model,
          case,
          pred.step_ms,
          meas,
          spread,
          err_t,
          mem / 1e6,
          (peak or 0) / 1e6,
          err_m,
          case.split(" ")[0] in memory_fits,
        )
      )
      print(
        f"{model:5s} {case:26s} pred {pred.step_ms:8.2f} ms  meas {meas:8.2f} ms (rounds spread {100 * spread:4.1f} %)  "
        f"err {100 * err_t:+6.1f} %   mem pred {mem / 1e6:7.2f} MB  xla {(peak or 0) / 1e6:7.2f} MB  "
        f"err {100 * err_m:+6.1f} %",
        flush=True,
      )
      if case.split(" ")[0] not in memory_fits:  # memory is fitted to fp32 and all-bf16 alone
        out.append(row_json(model, case, "peak_bytes", mem, peak, device))
      if "(fit)" in case:  # its measured step, for offline refits; no step prediction to score
        out.append(
          row_json(model, case, f"step_ms_{clock}_clock", pred.step_ms, meas, device)
          | {"fit": True, "rounds": round_medians}
        )
        continue
      for variant, alternative in variants.items():
        pred_v = predict(cluster, {prof.device_type: alternative}, plan).step_ms
        variant_errors.setdefault(variant, []).append(abs(pred_v - meas) / meas)
        print(
          f"      {variant} pred {pred_v:8.2f} ms, err {100 * (pred_v - meas) / meas:+6.1f} %", flush=True
        )
        out.append(row_json(model, case, f"step_ms_{clock}_clock_{variant}", pred_v, meas, device))
      out.append(
        row_json(model, case, f"step_ms_{clock}_clock", pred.step_ms, meas, device)
        | {"rounds": round_medians}
      )
      if fitted is not None:
        pred_fit = predict(cluster, {prof.device_type: fitted}, plan).step_ms
        refitted.append(abs(pred_fit - meas) / meas)
        print(
          f"      refitted to the fit step timed among the plans: pred {pred_fit:8.2f} ms, "
          f"err {100 * (pred_fit - meas) / meas:+6.1f} %",
          flush=True,
        )
        out.append(row_json(model, case, f"step_ms_{clock}_clock_refit", pred_fit, meas, device))
    if not args.no_save:  # each model's rows as soon as it is done: a run cut short keeps them
      append_rows(args.results, tagged(out, args.run))
      print(f"appended {len(out)} rows of {model} to {args.results}", flush=True)
      out = []
  evals = [r for r in rows if "(fit)" not in r[1]]
  t_err = np.abs([r[5] for r in evals])
  m_evals = [r for r in rows if not r[9]]  # all but memory's fit plans
  m_err = np.abs([r[8] for r in m_evals])
  print(
    f"\n{'model':6s} {'plan':26s} {'pred ms':>9s} {'meas ms':>9s} {'ratio':>6s} {'pred MB':>8s} {'xla MB':>8s} {'ratio':>6s}"
  )
  for r in rows:
    print(
      f"{r[0]:6s} {r[1]:26s} {r[2]:9.2f} {r[3]:9.2f} {r[2] / r[3]:6.3f} {r[6]:8.2f} {r[7]:8.2f} {r[6] / r[7]:6.3f}"
    )
  print(
    f"\n{len(evals)} evaluation plans on {device}: step-time |error| mean {100 * t_err.mean():.1f} %, "
    f"median {100 * np.median(t_err):.1f} %, max {100 * t_err.max():.1f} %; memory |error| ({len(m_evals)} "
    f"plans but its fits) mean {100 * m_err.mean():.1f} %, max {100 * m_err.max():.1f} %"
  )
  if refitted:
    print(
      f"refitted to the fit step timed among the plans: step-time |error| mean "
      f"{100 * np.mean(refitted):.1f} %, median {100 * np.median(refitted):.1f} %, max {100 * np.max(refitted):.1f} %"
    )
  for variant, errors in variant_errors.items():
    print(
      f"{variant} profile: step-time |error| mean {100 * np.mean(errors):.1f} %, median "
      f"{100 * np.median(errors):.1f} %, max {100 * np.max(errors):.1f} %"
    )
  if not args.no_save:
    summary = [
      row_json("all", "mean_abs_step_error", "abs_rel_error", float(t_err.mean()), None, device),
      row_json("all", "mean_abs_memory_error", "abs_rel_error", float(m_err.mean()), None, device),
    ]
    for variant, errors in variant_errors.items():
      summary.append(
        row_json(
          "all", f"mean_abs_step_error_{variant}", "abs_rel_error", float(np.mean(errors)), None, device
        )
      )
    if refitted:
      summary.append(
        row_json("all", "mean_abs_step_error_refit", "abs_rel_error", float(np.mean(refitted)), None, device)
      )
    append_rows(args.results, tagged(summary, args.run))
    print(f"appended {len(summary)} summary rows to {args.results}")


if __name__ == "__main__":
  main()
