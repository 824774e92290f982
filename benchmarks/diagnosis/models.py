"""Realistic models on the lent GPU: step time per precision policy and the predictor's error.

Models (``benchmarks.common.zoo.MODELS``): ``resnet18_224`` — ResNet-18 on synthetic
224×224 images, batch 64 — and ``lm_base`` — a BERT-base-wide causal LM (d=768, 12 heads, 4
layers, seq 256, batch 16) on the Python standard-library corpus. Policies:

* ``fp32``, ``bf16``: uniform;
* ``int8``: every op all-int8 (int8 forward and backward, stochastic rounding on gradients);
* ``int8_fwd``: every op QSync's int8 op (int8 forward, fp16 backward);
* with ``--mixed``: also ``fp16`` and ``predictor.py``'s mixed plans within the profiled
  precisions (``mixed int8_fwd/bf16``, ``mixed fp32/fp16/int8_fwd``: op i gets the i-th preset
  of the pattern, cyclically);
* ``qsync``: the greedy allocator's plan for this GPU as the *inference* group of a hybrid
  cluster whose training group is the same GPU type running bf16 — the most precise plan
  predicted to keep pace with bf16 (T* = the bf16 step). Its Ω comes from the gradient
  indicator at the model's initial weights (enough to rank ops for a timing run; the
  accuracy results in ``docs/results.md`` use trained weights).

For each policy and clock (``--clocks``): the measured median step (jitted single-device
training step fed its own donated outputs; the policies compiled first, then timed round-robin
over ``--rounds`` rounds, the median of the round medians, with their spread — max − min), its
ratio to bf16 measured in the same run, and the replay's
predicted step from a profile measured first in the same run (``planners.profiler.measure``; its fit step
does not count in the mean error; with ``--refit``, the remainder refitted to that step as timed
on each clock). Clocks: ``wall`` waits for every step (rows ``step_ms_median``);
``pipelined`` dispatches them back to back as the trainer does (rows ``step_ms_pipelined``) — on
a GPU the step a training run sees. Rows go to ``benchmarks/results/models.jsonl``.

  python -u -m benchmarks.diagnosis.models [--models resnet18_224 lm_base] [--repeats 20]
      [--results PATH] [--steps-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from benchmarks.common import zoo
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.diagnosis.predictor_replay import with_measurements
from benchmarks.predictor import plans, saved_profile
from planners.allocator.greedy import greedy, make_problem
from planners.indicator import compute
from planners.predictor.replay import predict
from planners.profile import Profile
from planners.profiler import timing
from planners.profiler.fit import fit_profile, fit_remainder
from planners.profiler.measure import measure_profile, task_ops
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train.train_step import init_variables

RESULTS = results_path("models")
PRECISIONS = ("fp32", "bf16", "fp16", "int8")
"""Profiled precisions: those the policies below use (int8_fwd's backward is fp16)."""
UNIFORM = ("fp32", "bf16", "int8", "int8_fwd")
MIXED = ("fp16", "mixed int8_fwd/bf16", "mixed fp32/fp16/int8_fwd")
"""``--mixed``'s extra plans (``predictor.plans``): every preset they use is within ``PRECISIONS``."""


def evaluation_policies(op_names, mixed: bool) -> dict[str, PrecisionPolicy]:
  """The policies timed per model: ``UNIFORM``, and with ``mixed`` also ``MIXED``."""
  extra = plans(op_names) if mixed else {}
  return {
    **{name: PrecisionPolicy.uniform(name) for name in UNIFORM},
    **{n: extra[n] for n in MIXED if mixed},
  }


def qsync_policy(task, prof, batch_size: int, say) -> PrecisionPolicy:
  """The allocator's plan for an inference group next to a bf16 training group (same GPU)."""
  batch = timing.device_batch(task, batch_size)
  variables = init_variables(task, 0, batch)[0]
  stream = task.train_batches(batch_size, 2)
  t0 = time.perf_counter()
  omega = compute(task, variables, [next(stream) for _ in range(2)], ("gradient",), ("int8", "bf16"))
  say(f"indicator: {len(omega['gradient']['omega'])} ops in {time.perf_counter() - t0:.0f} s")
  t = prof.device_type
  cluster = ClusterSpec(
    (DeviceGroup("training", t, 1, 1e3, batch_size), DeviceGroup("inference", t, 1, 1e3, batch_size))
  )
  problem = make_problem(cluster, {t: prof}, omega["gradient"], ["training"], train_policy="bf16")
  alloc = greedy(problem)
  return alloc.plan.policies["inference"]


STEP_METRICS = {"wall": "step_ms_median", timing.PIPELINED_CLOCK: "step_ms_pipelined", "cpu": "step_ms_cpu"}
"""The metric of a step timed on each clock (``planners.profiler.timing``): ``wall`` waits for every step,
``pipelined`` dispatches them back to back as the trainer does."""


def steps_from(path: str, run: str, model: str, clock: str = "wall") -> tuple[dict, str]:
  """``({policy: (median ms, spread or IQR ms, None)}, device)`` of ``model``'s steps on ``clock`` in
  the rows of ``run`` (all but the qsync plan's, which is not rebuilt offline) in the results
  file ``path`` (XLA's peak is not in those rows); empty if ``run`` has no steps on that clock."""
  found, device = {}, None
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      name = r["case"].partition("/")[2]
      if r.get("run") == run and r["case"].startswith(f"{model}/") and r["metric"] == STEP_METRICS[clock]:
        if name != "qsync":
          spread = r.get("spread_ms", r.get("iqr_ms", float("nan")))
          found[name], device = (r["value"], spread, None), r["device"]
  return found, device


def precast_profile(saved: str | None, progress) -> Profile:
  """The profile saved at ``<saved>.precast.json``: the model's whole-policy programs timed with
  their activations in the dtypes the step converts them to (as ``measure_profile`` times them on
  a GPU)."""
  path = saved[: -len(".json")] + ".precast.json" if saved else None
  if not path or not os.path.exists(path):
    raise SystemExit(f"--precast: no {path or '<profile-dir>/<model>.precast.json'}. Fix: drop --precast.")
  progress(f"profile {path}")
  return Profile.load(path)


def row(model, case, metric, value, baseline, device, **extra):
  return result_row("models", f"{model}/{case}", metric, value, baseline, device, **extra)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.models", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--models", nargs="+", default=["resnet18_224", "lm_base"])
  ap.add_argument("--repeats", type=int, default=20, help="timed steps per policy (and per round; median)")
  ap.add_argument(
    "--rounds",
    type=int,
    default=3,
    help="time the policies round-robin over this many rounds (median of the round medians; the "
    "spread column is their max - min), so that drift falls on every policy alike; 1: one after another",
  )
  ap.add_argument(
    "--clocks",
    nargs="+",
    choices=sorted(STEP_METRICS),
    default=["wall", timing.PIPELINED_CLOCK],
    help="clocks the steps are timed on (planners.profiler.timing; default: wall — every step waited for — and "
    "pipelined — steps dispatched back to back, as the trainer runs them); each is predicted on its own",
  )
  ap.add_argument("--profile-repeats", type=int, default=5)
  ap.add_argument("--batch", type=int, help="override the model's per-device batch")
  ap.add_argument("--results", default=RESULTS)
  ap.add_argument("--no-save", action="store_true")
  ap.add_argument(
    "--profile-dir",
    help="each model's profile: loaded from <dir>/<model>.json if there, else measured and saved there",
  )
  ap.add_argument(
    "--steps-from",
    metavar="RUN",
    help="take the uniform policies' measured steps from the rows of RUN in --results instead of timing "
    "them (with a saved profile in --profile-dir: an offline replay; no qsync plan)",
  )
  ap.add_argument(
    "--precast",
    action="store_true",
    help="also predict from <model>.precast.json in --profile-dir: the whole-policy programs timed with "
    "their activations in the dtypes the step converts them to",
  )
  ap.add_argument(
    "--refit",
    action="store_true",
    help="refit the profile's remainder to this run's fit step (planners.profiler.fit.fit_remainder): for a "
    "profile measured on another host",
  )
  ap.add_argument("--no-plan", action="store_true", help="skip the qsync plan (its indicator, plan and step)")
  ap.add_argument("--mixed", action="store_true", help="also time fp16 and two mixed plans (MIXED)")
  ap.add_argument(
    "--steps-only", action="store_true", help="time the uniform policies; no profile, plan or prediction"
  )
  args = ap.parse_args(argv)
  device = jax.devices()[0].device_kind
  t_start = time.perf_counter()

  def say(msg):
    print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

  def emit(r):
    if not args.no_save:
      append_rows(args.results, [{**r, "run": f"replay-{args.steps_from}"} if args.steps_from else r])

  table = []
  fits = set()  # (model, operands, clock, policy) of the steps a profile was fitted to
  for model in args.models:
    task, batch_size = zoo.get(model)
    batch_size = args.batch or batch_size
    batch = timing.device_batch(task, batch_size)
    measured = {clock: {} for clock in args.clocks}  # clock -> policy -> (ms, spread ms, XLA peak)

    def measure(policies):
      """Times ``policies`` round-robin on every clock and records their rows."""
      timed = timing.time_train_steps_interleaved(
        task,  # noqa: B023
        policies,
        batch,  # noqa: B023
        args.repeats,
        args.rounds,
        clocks=args.clocks,
        progress=lambda msg: say(f"{model} {msg}"),  # noqa: B023
      )
      for clock, by_name in timed.items():
        for name, (ms, round_medians, peak) in by_name.items():
          spread = max(round_medians) - min(round_medians)
          measured[clock][name] = (ms, spread, peak)  # noqa: B023
          bf16 = measured[clock].get("bf16", (None,))[0]  # noqa: B023
          extra = {"batch": batch_size, "rounds": round_medians, "spread_ms": spread, "clock": clock}  # noqa: B023
          extra["policy"] = policies[name].to_json() if name == "qsync" else name
          emit(row(model, name, STEP_METRICS[clock], ms, bf16, device, **extra))  # noqa: B023

    op_names = [o.name for o in task_ops(task, batch_size)[2]]
    policies = evaluation_policies(op_names, args.mixed or bool(args.steps_from))
    if args.steps_from:
      for clock in args.clocks:
        measured[clock], dev = steps_from(args.results, args.steps_from, model, clock)
        device = dev or device
      measured = {clock: steps for clock, steps in measured.items() if steps}
      if not measured:
        raise SystemExit(
          f"{args.results}: no step rows of {model!r} in run {args.steps_from!r} on the clocks "
          f"{', '.join(args.clocks)}. Fix: pass a run tag those rows carry."
        )
      policies = {name: policies[name] for name in next(iter(measured.values()))}
    else:  # step times first: they are the point of the run, and do not depend on the profile
      measure(policies)
    if args.steps_only:
      table += [
        (model, name, clock, "", ms, spread, None, None, None, peak)
        for clock, steps in measured.items()
        for name, (ms, spread, peak) in steps.items()
      ]
      continue
    saved = os.path.join(args.profile_dir, f"{model}.json") if args.profile_dir else None
    prof = saved_profile(
      saved,
      lambda checkpoint, task=task, batch_size=batch_size, model=model: measure_profile(
        task,
        batch_size,
        PRECISIONS,
        repeats=args.profile_repeats,
        step_repeats=args.repeats,
        progress=lambda msg: say(f"{model} profile: {msg}"),
        checkpoint=checkpoint,  # a call cut short resumes in the next
      ),
      lambda msg, model=model: say(f"{model}: {msg}"),
    )
    variants = {prof.meta.get("policy_operands", "fp32"): prof}  # a GPU profile measured now is precast
    if args.precast and "precast" not in variants:
      variants["precast"] = precast_profile(saved, lambda msg, model=model: say(f"{model} precast: {msg}"))
    variants = {name: fit_profile(with_measurements(p)) for name, p in variants.items()}
    cluster = ClusterSpec.uniform(prof.device_type, 1, batch_size, memory_gb=1e3)
    if args.steps_from or args.no_plan:
      say(f"{model}: no qsync plan ({'--steps-from' if args.steps_from else '--no-plan'})")
    else:
      try:
        policies["qsync"] = qsync_policy(task, prof, batch_size, say)
        measure({"qsync": policies["qsync"]})
      except Exception as e:  # noqa: BLE001 - report it; the uniform policies still count
        say(f"{model}: no qsync plan: {type(e).__name__}: {str(e)[:300]}")
    for clock, steps in measured.items():
      for variant, vprof in variants.items():
        preset = vprof.meta["fit_preset"]
        if args.refit and preset in steps:
          vprof = fit_remainder(vprof, preset, steps[preset][0])
          say(f"{model}: {variant} profile refitted to this run's {preset} step on the {clock} clock")
        tags = {"operands": variant, "clock": clock, **({"refit": True} if args.refit else {})}
        fits.add((model, variant, clock, preset))
        for name, (meas, spread, peak) in steps.items():
          pred = predict(cluster, {vprof.device_type: vprof}, Plan(policies={"all": policies[name]}))
          err = (pred.step_ms - meas) / meas
          mem = pred.memory_bytes["all"]
          table.append((model, name, clock, variant, meas, spread, pred.step_ms, err, mem, peak))
          emit(row(model, name, "predicted_step_ms", pred.step_ms, meas, device, **tags))
          emit(row(model, name, "predicted_peak_bytes", mem, peak, device, **tags))

  print(
    f"\n{'model':13s} {'policy':24s} {'clock':9s} {'operands':8s} {'meas ms':>8s} {'spread':>6s} {'bf16/x':>7s} "
    f"{'pred ms':>8s} {'error':>7s} {'mem err':>7s}"
  )
  for model, name, clock, variant, meas, spread, pms, err, mem, peak in table:
    bf16 = next(m for mo, n, c, _, m, *_ in table if mo == model and n == "bf16" and c == clock)
    head = f"{model:13s} {name:24s} {clock:9s} {variant:8s} {meas:8.2f} {spread:6.2f} {bf16 / meas:7.3f}"
    if pms is None:
      print(head)
      continue
    merr = f"{100 * (mem - peak) / peak:+6.1f}%" if peak else "   n/a"
    print(f"{head} {pms:8.2f} {100 * err:+6.1f}% {merr}")
  if args.steps_only:
    return 0
  for clock, variant in dict.fromkeys((r[2], r[3]) for r in table):
    # the plans the profile was fitted to are no predictions
    evals = [r for r in table if r[2] == clock and r[3] == variant and (r[0], r[3], r[2], r[1]) not in fits]
    errs = np.abs([r[7] for r in evals])
    fitted = sorted({r[1] for r in table if (r[0], r[3], r[2], r[1]) in fits})
    print(
      f"\npredictor on {device}, {clock} clock, {variant} operands: mean |error| {100 * errs.mean():.1f} %, "
      f"median {100 * np.median(errs):.1f} %, max {100 * errs.max():.1f} % over {len(errs)} runs "
      f"({', '.join(fitted)}: the plans the profile is fitted to, excluded)"
    )
    tags = {"operands": variant, "clock": clock, **({"refit": True} if args.refit else {})}
    emit(row("all", "mean_abs_step_error", "abs_rel_error", float(errs.mean()), None, device, **tags))
  return 0


if __name__ == "__main__":
  sys.exit(main())
