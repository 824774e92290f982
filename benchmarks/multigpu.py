"""Multi-GPU validation: trainer scaling, gradient-sync payloads and times, SelSync, QSDP, and the
reduction / optimizer-update modes measured against the replay.

The model: a byte-level GPT (``benchmarks.common.zoo.gpt``) of ``--d-model``, ``--layers``,
``--heads`` and ``--seq``. One process drives all local devices (``jax.devices()``); with
``--processes 2 4`` the script also relaunches itself as 2 and as 4 ``jax.distributed``
processes of one device each and times every scaling policy there too. On a CPU it runs on simulated devices (a smoke test).

Cases (all against the fp32 all-reduce / bf16 policy measured in the same run):

* scaling: uniform fp32 (the predictor's fit plan), uniform bf16 and a mixed plan (MLP Dense
  layers ``int8_fwd``, the rest bf16) on 1, 2, 4… devices with a fixed per-device batch (weak
  scaling): step time and efficiency t(1) / t(n); each step's kernels on the first GPU
  (``benchmarks.common.kernel_summary.gpu_kernels``: time, count, of it collectives and matrix
  products) and, for n > 1, the compute the schedule places under each async collective
  (``hlo.async_spans``) are also reported;
* all-reduce order (bf16 policy, 2, 4… devices): the trainer's default (gradient leaves in the
  order the backward produces them, ``qsync_jax.sync.order``), tree order
  (``sync_leaf_order="tree"``) and our own 30 MiB buckets (``bucket_bytes``), timed round-robin
  so that drift falls on all three alike;
* sync: fp32, bf16, fp16 and Global-QSGD all-reduce on all devices (``--syncs``): step time,
  bytes per step in the compiled HLO's collectives, the collectives' dtypes (Global-QSGD must stay
  s8), and the step's time over fp32's measured beside the sync's passes as the replay prices them
  (``planners.predictor.payload.pass_ms``: modeled; on one device the measured difference is the
  passes alone, on more it also holds the collectives and the overlap a sync after the backward
  gives up);
* SelSync: step time and bytes of a local (never-sync) step and of a sync step (its warm-up
  and flagged steps: a parameter average after the update, which cannot overlap the
  backward pass); QSDP: step time and bytes (int8 all-gathers);
* predictor: the replay's step time for every bf16 / mixed scaling case (one process, and one
  process per device) against the measured one, from the op profile on one device
  (``measure_profile``, or ``--profile-file``) and, per device count, the all-reduce line of
  a ``psum`` microbenchmark (``benchmarks.common.link``); then again with the profile's
  remainder refitted to the fp32 step measured on the same device count
  (``planners.profiler.fit.fit_remainder``). The baseline of the ratio is the measured step;
* modes: on all devices (two groups of ``n - n // 2`` and ``n // 2`` from 4 devices on, else
  one), the bf16 policy with AdamW under every reduction / optimizer update the groups allow
  (``MODES``: ``flat/replicated``, ``flat/sharded``, ``flat/replicated/micro2`` — gradients
  accumulated over two half-batches — and, with two groups, ``two_level/replicated``; one
  device has the replicated update alone, and no link), timed
  round-robin (``MODE_ROUNDS`` rounds of ``--steps`` steps, pipelined on a GPU): the
  measured step (median, IQR) and, from a trace of the first GPU's kernels (``step_kernels``),
  each collective kind's kernel time, the other kernels' (compute) and the exposed collective
  time (a collective kernel runs, no other kernel does), and the first device's peak memory of
  the compiled step (``xla_peak_bytes``); against the replay's modeled step,
  ``comm_ms_by_phase``, ``exposed_comm_ms``, ``optimizer_tail_ms`` and ``memory_bytes`` of the same plan, from the
  one-device profile and the all-reduce line measured on all devices in the same run (every
  group's ``link_gbps`` and ``intra_link_gbps``: one host, the same link between any two
  devices). The baseline of the ratio is the measured ``flat/replicated`` step.

``--cases`` selects among them (default all). The modes case alone, its profile measuring bf16 only:

  python -m benchmarks.multigpu --cases modes --profile-precisions bf16

  python -m benchmarks.multigpu [--d-model 768 --layers 12 --seq 256 --batch 8] [--steps 20]
                                [--processes 2 4] [--profile-file PROFILE.json] [--cases …]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common.kernel_summary import gpu_kernels
from benchmarks.common.link import measure_link
from benchmarks.common.multigpu_modes import (
  MODES,
  mode_groups,
  mode_name,
  mode_rows,
  modes_of,
  predict_mode,
  time_modes,
)
from benchmarks.common.result_rows import ROOT, append_rows, result_row, results_path
from benchmarks.common.train_steps import build_program, pipelined_step_s, stepper, time_steps
from benchmarks.common.zoo import gpt
from planners.predictor.payload import pass_ms
from planners.predictor.replay import predict
from planners.profile import Profile
from planners.profiler import hlo
from planners.profiler.fit import fit_remainder
from planners.profiler.measure import measure_profile
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import device_type_of
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy, Rule
from qsync_jax.precision import OpPolicy
from qsync_jax.sync import make_grad_sync, make_qsdp_step, make_selsync_step
from qsync_jax.train.task_step import task_loss
from qsync_jax.train.train_step import make_train_step

RESULTS = results_path("multigpu")
CASES = ("scaling", "order", "sync", "predictor", "modes")
"""The cases ``--cases`` selects (module docstring)."""


def policies() -> dict[str, PrecisionPolicy]:
  mixed = PrecisionPolicy(
    rules=(Rule(r".*mlp.*|.*Dense.*", OpPolicy.preset("int8_fwd"), kind="dense"),),
    default=OpPolicy.preset("bf16"),
  )
  return {"fp32": PrecisionPolicy.uniform("fp32"), "bf16": PrecisionPolicy.uniform("bf16"), "mixed": mixed}


def collective_summary(step, *args, dump: str | None = None):
  """Collectives of the compiled step; falls back to the pre-optimization HLO (marked) when
  the compiled text hides them (e.g. inside async wrappers this parser does not follow).
  ``"async"``: how many run asynchronously, how many of those have no compute scheduled
  between their start and done (exposed), and the compute and custom-call instructions they
  span (``hlo.async_spans``)."""
  lowered = step.lower(*args)
  text = lowered.compile().as_text()
  if dump:
    with open(dump, "w") as f:
      f.write(text)
  found = hlo.summarize(hlo.collectives(text))
  spans = hlo.async_spans(text)
  found["async"] = {
    "count": len(spans),
    "exposed": sum(s.compute == 0 for s in spans),
    "compute_spanned": sum(s.compute for s in spans),
    "custom_calls_spanned": sum(s.custom_calls for s in spans),
  }
  if found["count"] == 0:
    found = hlo.summarize(hlo.collectives(lowered.compiler_ir("hlo").as_hlo_text()))
    found["source"] = "pre-optimization HLO"
  else:
    found["source"] = "compiled HLO"
  return found


BUCKET_BYTES = 30 * 2**20
"""The ``-buckets`` cases' all-reduce buckets: XLA:GPU's combine threshold, so XLA cannot merge two."""


def local_cluster(n: int, batch: int) -> ClusterSpec:
  """One group of the first ``n`` local devices at ``batch`` per device."""
  return ClusterSpec((DeviceGroup("gpus", device_type_of(jax.devices()[0]), n, 80, batch),))


def build_case(task, n, batch, policy, sync_name="fp32", leaf_order="auto", sync_options=None):
  """``(train step, first state, 3 sharded batches)`` of the trainer on the first ``n`` devices."""
  plan = Plan(policies={"gpus": policy})
  sync = make_grad_sync(sync_name, **(sync_options or {}))
  return build_program(task, local_cluster(n, batch), plan, optax.adam(1e-4), sync, leaf_order)


def trainer_case(task, n, batch, policy, sync_name, steps, dump=None):
  """``(median s, IQR s, collectives)`` of the trainer's step, with the first GPU's kernels
  (``kernel``: a ``benchmarks.common.kernel_summary.KernelSummary``, None without a GPU) and the step's time when
  steps are dispatched back to back (``pipelined_s``, ``pipelined_step_s``)."""
  ts, state, batches = build_case(task, n, batch, policy, sync_name)
  coll = collective_summary(ts.step, state, batches[0], dump=dump)
  coll["param_elements"] = sum(x.size for x in jax.tree.leaves(state.params))
  med, iqr, state = time_steps(ts.step, state, batches, steps)
  coll["pipelined_s"], state = pipelined_step_s(ts.step, state, batches, steps)
  coll["kernel"] = first_gpu_kernels(ts.step, state, batches[0])
  return med, iqr, coll


def first_gpu_kernels(step, state, batch, repeats: int = 5):
  """The ``benchmarks.common.kernel_summary.KernelSummary`` of ``step``'s kernels on the first GPU (with its
  collectives' kernels, which run on a stream of their own); None without a GPU."""
  run, _ = stepper(step, state, [batch])
  return gpu_kernels(lambda: jax.block_until_ready(run()), repeats)


ORDER_CASES = {
  "auto": ("auto", None),  # the trainer's default: leaves in backward order, XLA combines
  "tree": ("tree", None),  # leaves in tree order, XLA combines
  "buckets": ("auto", {"bucket_bytes": BUCKET_BYTES}),  # backward order, our own 30 MiB buckets
}
"""The all-reduce variants of the interleaved A/B: ``(sync_leaf_order, fp32 sync options)``."""


def interleaved_ab(task, n, batch, policy, steps, rounds):
  """``{variant: (median of the rounds' medians, min, max)}`` (s) of the ``ORDER_CASES`` steps,
  timed round-robin — ``rounds`` rounds of ``steps`` steps each — so that a drift of the machine
  during the run falls on every variant alike."""
  built = {
    k: build_case(task, n, batch, policy, "fp32", order, options)
    for k, (order, options) in ORDER_CASES.items()
  }
  state = {k: s for k, (_, s, _) in built.items()}
  meds = {k: [] for k in built}
  for _ in range(rounds):
    for k, (ts, _, batches) in built.items():
      med, _, state[k] = time_steps(ts.step, state[k], batches, steps)
      meds[k].append(med)
  return {k: (float(np.median(v)), min(v), max(v)) for k, v in meds.items()}


SELSYNC_CASES = {
  "selsync_local": {"warmup": 0, "delta": 1e30},  # never synchronizes: the local step
  "selsync_sync": {"warmup": 10**9},  # synchronizes every step (as during its warm-up)
}
"""SelSync timed at both ends: a training run's step time is a mix set by its sync fraction."""


BUILDER_SYNCS = (*SELSYNC_CASES, "qsdp")
SYNCS = ("fp32", "bf16", "fp16", "global_qsgd", *BUILDER_SYNCS)
"""The sync case's syncs (``--syncs``): the trainer's gradient syncs, then the strategies that
build their own step (``builder_case``)."""


def builder_case(task, n, batch, name, steps):
  devices = jax.devices()[:n]
  cluster = local_cluster(n, batch)
  ts = make_train_step(task, cluster, None, optax.adam(1e-4), devices=devices)
  initial = ts.init(0, next(task.train_batches(cluster.global_batch, 0))).params
  loss_fn = task_loss(task, PrecisionPolicy.uniform("bf16"), params_only=True)
  if name in SELSYNC_CASES:
    trainer = make_selsync_step(loss_fn, optax.adam(1e-4), ts.mesh, **SELSYNC_CASES[name])
  else:
    trainer = make_qsdp_step(loss_fn, optax.adam(1e-4), initial, ts.mesh)
  sharding = NamedSharding(ts.mesh, P("data"))
  host = task.train_batches(cluster.global_batch, 0)
  batches = [jax.device_put(next(host), sharding) for _ in range(3)]
  state = trainer.init(initial)
  key = jax.random.key(0)
  text = hlo.compiled_text(trainer.step, state, batches[0], key)
  med, iqr, _ = time_steps(trainer.step, state, batches, steps, key)
  if name == "qsdp":
    return med, iqr, hlo.summarize(hlo.collectives(text)), ""
  always = hlo.summarize(hlo.outside_conditionals(text))
  (branches,) = hlo.conditional_branches(text)
  synced = hlo.summarize(max(branches, key=len))
  return (
    med,
    iqr,
    always,
    f"sync step adds {synced['wire_bytes']:.0f} ring B in {synced['count']} collectives",
  )


def row(case, metric, value, baseline, device, **extra):
  return result_row("multigpu", case, metric, value, baseline, device, **extra)


def case_cluster(prof, n: int, batch: int, link=None) -> tuple[ClusterSpec, dict]:
  """``(cluster, predict kwargs)`` of ``n`` devices of ``prof``'s type at ``batch`` per device,
  with ``link`` (a ``benchmarks.common.link.LinkModel``, or anything with ``link_gbps`` and
  ``latency_us``) for ``n`` > 1."""
  group = DeviceGroup("gpus", prof.device_type, n, 1e3, batch)
  if link is None:
    return ClusterSpec((group,)), {}
  return ClusterSpec((dataclasses.replace(group, link_gbps=link.link_gbps),)), {"latency_us": link.latency_us}


def predict_case(prof, name: str, n: int, batch: int, link=None):
  """The replay's ``Prediction`` of scaling case ``name`` (``bf16``, ``mixed``, ``bf16-buckets``…)
  on ``n`` devices at ``batch`` per device (``case_cluster``). ``-buckets`` cases pack the
  buckets in backward order (explicit ``bucket_bytes``); the others as XLA's combiner does."""
  base, _, variant = name.partition("-")
  cluster, extra = case_cluster(prof, n, batch, link)
  return predict(
    cluster,
    {prof.device_type: prof},
    Plan(policies={"gpus": policies()[base]}),
    bucket_order="backward" if variant == "buckets" else "tree",
    **extra,
  )


def predictor_profile(task, args):
  """``(profile, precisions it covers)``: loaded from ``--profile-file`` if it exists, else
  measured on one device (and saved there)."""
  t0 = time.perf_counter()
  profiled = set(args.profile_precisions)
  say = lambda msg: print(f"  [{time.perf_counter() - t0:5.0f} s] profile: {msg}", flush=True)  # noqa: E731
  if args.profile_file and os.path.exists(args.profile_file):
    prof = Profile.load(args.profile_file)
    print(f"\npredictor: profile {args.profile_file} ({prof.meta.get('device_kind', prof.device_type)})")
    return prof, set(prof.meta.get("precisions", profiled))
  prof = measure_profile(
    task,
    args.batch,
    precisions=tuple(profiled),
    repeats=args.profile_repeats,
    step_repeats=args.steps,
    progress=say,
    checkpoint=f"{args.profile_file}.partial" if args.profile_file else None,
  )
  if args.profile_file:
    prof.save(args.profile_file)
  print(f"\npredictor: {len(prof.ops)} ops profiled on one device in {time.perf_counter() - t0:.0f} s")
  return prof, profiled


def predictor_rows(
  prof, profiled, links, measured, batch, device, label="predictor", fp32_one_device_s=None
) -> list[dict]:
  """Predicted vs measured step of every scaling case in ``measured`` (``{(case, devices):
  median s}``), three times: from the profile as it is (``<label>/…``); with its remainder
  refitted to the fp32 case on the same device count (``<label>-fit/…``,
  ``planners.profiler.fit.fit_remainder``); and refitted once, to the fp32 step on one device
  (``fp32_one_device_s``, default ``measured[("fp32", 1)]``; ``<label>-fit1/…``), so that the
  replay alone predicts what changes with the device count. fp32 is the fit, never evaluated.
  Prints a table, returns the JSON rows."""
  fitted = {}
  for (name, n), meas in measured.items():
    if name == "fp32":
      cluster, extra = case_cluster(prof, n, batch, links.get(n))
      fitted[n] = fit_remainder(prof, "fp32", meas * 1e3, cluster, **extra)
  one_s = fp32_one_device_s if fp32_one_device_s is not None else measured.get(("fp32", 1))
  fitted_one = None
  if one_s is not None:
    fitted_one = fit_remainder(prof, "fp32", one_s * 1e3, case_cluster(prof, 1, batch)[0])
  print(f"\n{label}: measured steps against the replay")
  for n, p in sorted(fitted.items()):
    print(
      f"  remainder refitted to the fp32 step on {n} device(s): {sum(p.remainder_ms.values()):.2f} ms "
      f"(profile: {sum(prof.remainder_ms.values()):.2f} ms)"
    )
  print(
    f"{'policy':<12} {'devices':>7} {'pred ms':>9} {'meas ms':>9} {'error':>7} {'fit ms':>8} {'error':>7} "
    f"{'fit1 ms':>8} {'error':>7} {'comm ms':>8}"
  )
  rows, errors = [], {label: [], f"{label}-fit": [], f"{label}-fit1": []}
  for (name, n), meas in sorted(measured.items()):
    base_name, _, variant = name.partition("-")
    if variant not in ("", "buckets") or base_name == "fp32":
      continue  # "-tree": the same collectives as the default (the compiled HLO); fp32: the fit
    policy = policies()[base_name]
    if (
      not {q for r in policy.rules for q in r.policy.precisions} | set(policy.default.precisions) <= profiled
    ):
      continue  # a policy using precisions the profile skipped (to save profiling time)
    pred = predict_case(prof, name, n, batch, links.get(n))
    cells = []
    for what, p in ((label, prof), (f"{label}-fit", fitted.get(n)), (f"{label}-fit1", fitted_one)):
      if p is None:
        cells.append((float("nan"), float("nan")))
        continue
      ms = pred.step_ms if p is prof else predict_case(p, name, n, batch, links.get(n)).step_ms
      err = (ms - meas * 1e3) / (meas * 1e3)
      errors[what].append(abs(err))
      cells.append((ms, err))
      rows.append(row(f"{what}/{name}/n{n}", "step_time_ms", ms, meas * 1e3, device))
    parts = {}
    for node in pred.nodes:
      parts[node.kind] = parts.get(node.kind, 0.0) + node.ms
    print(
      f"{name:<12} {n:>7} {cells[0][0]:>9.2f} {meas * 1e3:>9.2f} {100 * cells[0][1]:>+6.1f}% "
      + " ".join(f"{ms:>8.2f} {100 * err:>+6.1f}%" for ms, err in cells[1:])
      + f" {pred.comm_ms:>8.2f}  "
      + " ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items()))
    )
  for what, errs in errors.items():
    if errs:
      print(
        f"{what} mean |error| {100 * np.mean(errs):.1f} % over {len(errs)} cases (max {100 * max(errs):.1f} %)"
      )
      rows.append(row(f"{what}/all", "mean_abs_step_error", float(np.mean(errs)), None, device))
  return rows


def run_worker(args) -> int:
  """One ``jax.distributed`` process of a multi-process run: on process 0, prints one JSON line
  per scaling policy with its median step time."""
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.world, process_id=args.process_id
  )
  task = gpt(args.d_model, args.layers, args.heads, args.seq)
  n = jax.device_count()
  for name in args.policies:
    med, iqr, coll = trainer_case(task, n, args.batch, policies()[name], "fp32", args.steps)
    if jax.process_index() == 0:
      out = {"policy": name, "median_s": med, "iqr_s": iqr, "pipelined_s": coll["pipelined_s"], "devices": n}
      print(json.dumps(out), flush=True)
  jax.distributed.shutdown()
  return 0


def multiprocess_steps(args, n: int) -> dict[str, tuple[float, float, float]]:
  """``{policy: (median s, IQR s, pipelined s)}`` of the scaling policies run as ``n`` ``jax.distributed``
  processes of one GPU each (``CUDA_VISIBLE_DEVICES``); empty if the run fails or times out."""
  flags = ["--d-model", args.d_model, "--heads", args.heads, "--layers", args.layers, "--seq", args.seq]
  flags += ["--batch", args.batch, "--steps", args.steps, "--world", n, "--port", args.port + n]
  procs = [
    subprocess.Popen(
      [sys.executable, "-m", "benchmarks.multigpu", "--process-id", str(pid), *map(str, flags)]
      + ["--policies", *args.policies],
      cwd=ROOT,  # the children run from the repository root
      env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(pid)),
      stdout=subprocess.PIPE,
      text=True,
    )
    for pid in range(n)
  ]
  try:
    outs = [p.communicate(timeout=args.process_timeout)[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    print(f"{n}-process run killed after {args.process_timeout} s")
    return {}
  if any(p.returncode for p in procs):
    print(f"{n}-process run failed: return codes {[p.returncode for p in procs]}")
    return {}
  lines = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
  return {r["policy"]: (r["median_s"], r["iqr_s"], r["pipelined_s"]) for r in lines}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.multigpu", description=__doc__.splitlines()[0])
  parser.add_argument("--d-model", type=int, default=768)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=8, help="per-device batch")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument(
    "--processes",
    type=int,
    nargs="*",
    default=[],
    help="device counts to run also as that many jax.distributed processes of one GPU each",
  )
  parser.add_argument("--counts", type=int, nargs="*", help="device counts of the single-process runs")
  parser.add_argument("--process-id", type=int, default=-1, help=argparse.SUPPRESS)
  parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, default=12355, help=argparse.SUPPRESS)
  parser.add_argument("--no-save", action="store_true")
  parser.add_argument("--results", default=RESULTS, help=f"JSON lines file to append to (default {RESULTS})")
  parser.add_argument(
    "--cases",
    nargs="+",
    choices=CASES,
    default=list(CASES),
    help="cases to run (default all): scaling, all-reduce order, sync strategies (with SelSync and QSDP), "
    "the predictor against the scaling and order steps, the reduction / optimizer-update modes",
  )
  parser.add_argument(
    "--modes",
    nargs="+",
    choices=[mode_name(m) for m in MODES],
    help="the modes case's modes (default: every one the devices allow)",
  )
  parser.add_argument(
    "--policies",
    nargs="+",
    default=["fp32", "bf16", "mixed"],
    help="policies of the scaling cases (fp32 is the predictor's fit plan, never evaluated)",
  )
  parser.add_argument(
    "--syncs",
    nargs="+",
    choices=SYNCS,
    default=list(SYNCS),
    help="the sync case's gradient syncs (fp32, the baseline, always runs)",
  )
  parser.add_argument("--dump-dir", help="write each scaling and sync case's compiled HLO here")
  parser.add_argument(
    "--order-rounds",
    type=int,
    default=5,
    help="rounds of the order case's interleaved all-reduce A/B (bf16: leaves in backward or tree order, "
    "or our own 30 MiB buckets) on 2, 4… devices; 0: none",
  )
  parser.add_argument("--profile-repeats", type=int, default=10, help="repeats of each profiled op")
  parser.add_argument(
    "--profile-precisions",
    nargs="+",
    default=["fp32", "bf16", "fp16", "int8"],
    help="precisions the predictor's profile measures; it predicts the policies within them (the modes "
    "case needs bf16)",
  )
  parser.add_argument(
    "--profile-file",
    help="the predictor's op profile: loaded if the file exists (e.g. measured on a 1-GPU machine), "
    "else measured on one device and saved there",
  )
  parser.add_argument("--process-timeout", type=int, default=240, help="seconds for the multi-process run")
  args = parser.parse_args(argv)
  if args.process_id >= 0:
    return run_worker(args)
  if (
    "modes" in args.cases
    and "bf16" not in args.profile_precisions
    and not (args.profile_file and os.path.exists(args.profile_file))
  ):
    parser.error(
      f"the modes case predicts bf16 plans, but --profile-precisions {' '.join(args.profile_precisions)} "
      "has no bf16. Fix: add bf16 to --profile-precisions, or leave modes out of --cases."
    )

  task = gpt(args.d_model, args.layers, args.heads, args.seq)
  total = jax.device_count()
  device = f"{jax.devices()[0].device_kind} x{total}"
  allowed = [mode_name(m) for m in modes_of(mode_groups(total))]
  if "modes" in args.cases and (refused := [m for m in args.modes or () if m not in allowed]):
    parser.error(
      f"--modes {' '.join(refused)}: {total} device(s) run only {', '.join(allowed)} (the sharded update "
      "needs 2 devices, two-level 4). Fix: leave those modes out, or run on more devices."
    )
  if args.dump_dir:
    os.makedirs(args.dump_dir, exist_ok=True)
  rows = []

  def emit(r: dict) -> None:
    """Keeps a row and appends it to the results file at once (a run cut short keeps its rows)."""
    r = {**r, "model": f"LM d={args.d_model} L={args.layers} seq={args.seq}, batch {args.batch}/device"}
    rows.append(r)
    if not args.no_save:
      append_rows(args.results, [r])

  print(f"\nmultigpu: LM d={args.d_model} L={args.layers} seq={args.seq} batch/device={args.batch}, {device}")

  # 1. weak scaling per policy
  counts = [n for n in args.counts or (1, 2, 4, 8) if n <= total]
  measured = {}  # (policy, devices) -> median step s
  measured_pipelined = {}  # (policy, devices) -> step s dispatched back to back
  scaling = {k: v for k, v in policies().items() if k in args.policies and "scaling" in args.cases}
  if scaling:
    print(f"{'policy':<10} {'devices':>7} {'step ms (IQR)':>16} {'efficiency':>10}")
  for name, policy in scaling.items():
    base = None
    for n in counts:
      try:
        dump = os.path.join(args.dump_dir, f"scaling-{name}-n{n}.hlo.txt") if args.dump_dir else None
        med, iqr, coll = trainer_case(task, n, args.batch, policy, "fp32", args.steps, dump)
      except Exception as e:  # noqa: BLE001 - report it; the other cases still count
        print(f"{name:<8} {n:>7} failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      base = med if base is None else base
      measured[(name, n)] = med
      print(f"{name:<10} {n:>7} {med * 1e3:>9.2f} ({iqr * 1e3:>4.2f}) {base / med:>10.3f}")
      emit(
        row(f"scaling/{name}/n{n}", "step_time_ms_median", med * 1e3, base * 1e3, device, iqr_ms=iqr * 1e3)
      )
      emit(row(f"scaling/{name}/n{n}", "weak_scaling_efficiency", base / med, 1.0, device))
      pipelined = measured_pipelined[(name, n)] = coll["pipelined_s"]
      print(f"{'':<8} {'':>7} dispatched back to back: {pipelined * 1e3:.2f} ms/step")
      emit(row(f"scaling/{name}/n{n}", "step_time_ms_pipelined", pipelined * 1e3, med * 1e3, device))
      if n > 1:
        a = coll["async"]
        print(
          f"{'':<8} {'':>7} {coll['count']} collectives, {a['count']} async ({a['exposed']} exposed), "
          f"spanning {a['compute_spanned']} compute ops ({a['custom_calls_spanned']} custom calls)"
        )
        emit(row(f"scaling/{name}/n{n}", "async_collectives", a["count"], coll["count"], device, **a))
      k = coll["kernel"]
      if k is not None:
        # collectives run on their own stream: kernel ms less comm ms is the compute, which
        # grows with n where the all-reduce slows the kernels it overlaps
        print(
          f"{'':<8} {'':>7} GPU 0 kernels {k.ms:.2f} ms of the {med * 1e3:.2f} ms step "
          f"({k.kernels:.0f} kernels), of it collectives {k.comm_ms:.2f} ms, matrix products {k.gemm_ms:.2f} ms"
        )
        emit(
          row(
            f"scaling/{name}/n{n}",
            "gpu_kernel_ms",
            k.ms,
            med * 1e3,
            device,
            kernels=k.kernels,
            comm_ms=k.comm_ms,
            gemm_ms=k.gemm_ms,
            top=k.top[:10],
          )
        )

  # 1b. all-reduce leaf order and buckets, interleaved A/B (bf16 policy)
  if args.order_rounds and "order" in args.cases:
    print(f"\n{'all-reduce':<10} {'devices':>7} {'step ms (min-max of rounds)':>28} {'x auto':>7}")
    for n in (n for n in counts if n > 1):
      ab = interleaved_ab(task, n, args.batch, policies()["bf16"], args.steps, args.order_rounds)
      for k, (med, lo, hi) in ab.items():
        if k != "auto":
          measured[(f"bf16-{k}", n)] = med
        print(
          f"{k:<10} {n:>7} {med * 1e3:>9.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f}) {med / ab['auto'][0]:>14.3f}"
        )
        emit(
          row(
            f"order/bf16-{k}/n{n}",
            "step_time_ms_median",
            med * 1e3,
            ab["auto"][0] * 1e3,
            device,
            min_ms=lo * 1e3,
            max_ms=hi * 1e3,
            rounds=args.order_rounds,
          )
        )

  # 2. gradient sync strategies on all devices
  sync_cases = "sync" in args.cases
  if sync_cases:
    print(
      f"\n{'sync':<12} {'step ms (IQR)':>16} {'ratio':>6} {'ring B/step':>12} {'ratio':>6}  "
      f"{'+ms over fp32 meas/passes modeled':>34}  dtypes"
    )
  base_t = base_b = None
  device_type = device_type_of(jax.devices()[0])
  for sync in dict.fromkeys(("fp32", *args.syncs)) if sync_cases else ():
    if sync in BUILDER_SYNCS:
      continue
    dump = os.path.join(args.dump_dir, f"{sync}.hlo.txt") if args.dump_dir else None
    med, iqr, coll = trainer_case(task, total, args.batch, policies()["bf16"], sync, args.steps, dump)
    base_t, base_b = base_t or med, base_b or coll["wire_bytes"]
    dtypes = ",".join(sorted(coll["by_dtype"]))
    # what the replay charges the sync beyond fp32's on one device: its passes (on n > 1 also its
    # collectives and the overlap it gives up, not in this column)
    passes = sum(pass_ms(sync, device_type, coll["param_elements"], total))
    print(
      f"{sync:<12} {med * 1e3:>9.2f} ({iqr * 1e3:>4.2f}) {med / base_t:>6.3f} {coll['wire_bytes']:>12.0f} "
      f"{coll['wire_bytes'] / max(base_b, 1):>6.3f}  {(med - base_t) * 1e3:>+16.2f} / {passes:<15.2f}  "
      f"{dtypes} ({coll['source']})"
    )
    emit(row(f"sync/{sync}", "step_time_ms_median", med * 1e3, base_t * 1e3, device, iqr_ms=iqr * 1e3))
    emit(row(f"sync/{sync}", "ring_bytes_per_step", coll["wire_bytes"], base_b, device, dtypes=dtypes))
    emit(
      row(
        f"sync/{sync}",
        "ms_over_fp32_measured",
        (med - base_t) * 1e3,
        0.0,
        device,
        modeled_passes_ms=passes,
        param_elements=coll["param_elements"],
        devices=total,
      )
    )

  # 3. SelSync and QSDP
  for name in (n for n in args.syncs if n in BUILDER_SYNCS) if sync_cases else ():
    try:
      med, iqr, coll, note = builder_case(task, total, args.batch, name, args.steps)
    except Exception as e:  # noqa: BLE001 - report and go on: the other cases still count
      print(f"{name:<12} failed: {type(e).__name__}: {e}")
      continue
    dtypes = ",".join(sorted(coll["by_dtype"]))
    print(
      f"{name:<12} {med * 1e3:>9.2f} ({iqr * 1e3:>4.2f}) {med / base_t:>6.3f} {coll['wire_bytes']:>12.0f} "
      f"{coll['wire_bytes'] / max(base_b, 1):>6.3f}  {dtypes} {note}"
    )
    emit(row(f"sync/{name}", "step_time_ms_median", med * 1e3, base_t * 1e3, device, iqr_ms=iqr * 1e3))
    emit(
      row(f"sync/{name}", "ring_bytes_per_step", coll["wire_bytes"], base_b, device, dtypes=dtypes, note=note)
    )

  # 4. one process per device through jax.distributed
  measured_mp = {}  # (policy, devices) -> median step s, one process per device
  measured_mp_pipelined = {}
  for n in (n for n in args.processes if 1 < n <= total):
    for name, (med, iqr, pipelined) in multiprocess_steps(args, n).items():
      measured_mp[(name, n)] = med
      measured_mp_pipelined[(name, n)] = pipelined
      single = measured.get((name, n))
      print(
        f"{name:<10} {n} processes x 1 device: {med * 1e3:.2f} ({iqr * 1e3:.2f}) ms/step, back to back "
        f"{pipelined * 1e3:.2f}; single process: " + ("-" if single is None else f"{single * 1e3:.2f} ms")
      )
      emit(row(f"multiprocess/{name}/p{n}", "step_time_ms_pipelined", pipelined * 1e3, med * 1e3, device))
      emit(
        row(
          f"multiprocess/{name}/p{n}",
          "step_time_ms_median",
          med * 1e3,
          None if single is None else single * 1e3,
          device,
          iqr_ms=iqr * 1e3,
        )
      )

  profiles = []  # the one-device profile, measured (or loaded) once for the predictor and the modes

  def profile():
    if not profiles:
      profiles.append(predictor_profile(task, args))
    return profiles[0]

  links = {}  # device count -> its all-reduce line, measured once

  def link_of(n: int):
    if n not in links:
      links[n] = link = measure_link(jax.devices()[:n])
      print(
        f"  link fit on {n} devices: {link.link_gbps / 8:.0f} GB/s, {link.latency_us:.0f} us per all-reduce "
        f"(fit rel. RMS {100 * link.rel_rms:.1f} %)"
      )
    return links[n]

  # 5. the predictor against both
  if (measured or measured_mp) and "predictor" in args.cases:
    prof, profiled = profile()
    for n in sorted({n for _, n in (*measured, *measured_mp) if n > 1}):
      link_of(n)
    # against the steps waited for one by one, and against those dispatched back to back (as a
    # training loop runs them); each set fits its own fp32 steps
    for label, steps, single in (
      ("predictor", measured, measured),
      ("predictor-mp", measured_mp, measured),
      ("predictor-pipelined", measured_pipelined, measured_pipelined),
      ("predictor-mp-pipelined", measured_mp_pipelined, measured_pipelined),
    ):
      if steps:
        one = single.get(("fp32", 1))  # the one-process run's: the multi-process run has no n=1
        for r in predictor_rows(prof, profiled, links, steps, args.batch, device, label, one):
          emit(r)

  # 6. the reduction and optimizer-update modes on all devices, measured against the replay
  if "modes" in args.cases:
    prof, profiled = profile()  # first: a profile that cannot predict the modes fails before any timing
    if "bf16" not in profiled:
      raise ValueError(
        f"modes: the profile {args.profile_file} covers {sorted(profiled)}, not bf16. Fix: pass a "
        "profile measured with bf16 in --profile-precisions (or measure one: another --profile-file)."
      )
    sizes = mode_groups(total)
    link = link_of(total) if total >= 2 else None  # one device: no collective, no link
    measured_modes = time_modes(task, sizes, args.batch, args.steps, args.modes)
    if not measured_modes:
      raise RuntimeError("modes: every mode failed (printed above); nothing to compare with the replay.")
    predictions = {m: predict_mode(prof, sizes, args.batch, m, link) for m in measured_modes}
    for r in mode_rows(sizes, measured_modes, predictions, link, device):
      emit(r)

  if not args.no_save:
    print(f"appended {len(rows)} rows to {args.results}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
