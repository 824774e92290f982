"""The modes case of ``benchmarks.multigpu``: the trainer's gradient reductions, optimizer
updates and micro-steps (``MODES``) on the local devices, each step's GPU kernels summarized per
collective kind (``step_kernels``), against the replay of the same plan (``mode_rows``)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from benchmarks.common.kernel_summary import COMM_KERNEL_MARKS
from benchmarks.common.result_rows import result_row
from benchmarks.common.train_steps import build_program, stepper
from planners.predictor.graph import DEFAULT_LATENCY_US
from planners.predictor.replay import exposed_length, predict
from planners.profiler.timing import default_step_clock, profiler_events, timed_ms, xla_peak_bytes
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import device_type_of
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync.common import STEP_COMPILER_OPTIONS

MODES = (
  ("flat", "replicated", 1),
  ("flat", "sharded", 1),
  ("flat", "replicated", 2),
  ("two_level", "replicated", 1),
)
"""``(Plan.reduction, Plan.optimizer_update, micro-steps of every group)`` of the modes case, the
first the ratios' baseline; 2 micro-steps: each device's batch in two halves, the gradients
accumulated before the one all-reduce (``Plan.micro_steps``)."""
MODE_ROUNDS = 4
"""Rounds of the modes case's round-robin timing, each of ``--steps`` steps per mode."""
MODE_OPTIMIZER = optax.adamw(1e-4)
"""The modes case's optimizer (elementwise, as the sharded update needs)."""
COLLECTIVE_KINDS = {
  "all-reduce": ("allreduce", "all-reduce"),
  "reduce-scatter": ("reducescatter", "reduce-scatter"),
  "all-gather": ("allgather", "all-gather"),
  "collective-permute": ("sendrecv", "collective-permute", "send", "recv"),
}
"""Collective kind → substrings (lower case) of its kernels' names (NCCL's
``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, ``…_SendRecv``…) or of the HLO instruction they run
(``hlo_op``: ``all-reduce-start.3``); the first kind that matches is the kernel's."""
COLLECTIVE_OPCODES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
"""HLO opcodes (prefixes of ``hlo_op``) whose kernels are collectives whatever their names."""
PHASE_KINDS = {
  "all-reduce": "all-reduce",
  "reduce-scatter": "reduce-scatter",
  "all-gather": "all-gather",
  "intra reduce": "collective-permute",
  "inter all-reduce": "collective-permute",
  "intra broadcast": "collective-permute",
}
"""The replay's ``Node.phase`` → the collective kind whose kernels run it: the two-level stages
are ``lax.ppermute`` rounds (collective-permutes, ``qsync_jax.sync.two_level``)."""


def mode_groups(n: int) -> tuple[int, ...]:
  """Device counts of the modes case's groups on ``n`` devices: two (``n - n // 2``, ``n // 2``)
  from 4 devices on, so that the two-level reduction has two groups with a tree each; else one."""
  return (n - n // 2, n // 2) if n >= 4 else (n,)


def modes_of(sizes: tuple[int, ...]) -> tuple[tuple[str, str, int], ...]:
  """The ``MODES`` the groups ``sizes`` allow: two-level needs at least two groups; one device
  has the replicated update only (sharded over one device, it is the same program)."""
  return tuple(
    m for m in MODES if (m[0] == "flat" or len(sizes) >= 2) and (m[1] == "replicated" or sum(sizes) >= 2)
  )


def mode_cluster(device_type: str, sizes: tuple[int, ...], batch: int, link=None) -> ClusterSpec:
  """Groups ``g0``, ``g1``… of ``sizes`` devices of ``device_type`` at ``batch`` per device; with
  ``link`` (a ``benchmarks.common.link.LinkModel``) every group's ``link_gbps`` and
  ``intra_link_gbps`` are its ``link_gbps``: one host, the same link (NVLink) between any two devices."""
  gbps = {} if link is None else {"link_gbps": link.link_gbps, "intra_link_gbps": link.link_gbps}
  return ClusterSpec(
    tuple(DeviceGroup(f"g{i}", device_type, k, 80, batch, **gbps) for i, k in enumerate(sizes))
  )


def mode_name(mode: tuple[str, str, int]) -> str:
  """``reduction/optimizer_update``, with ``/micro<k>`` for k > 1 micro-steps."""
  reduction, update, micro = mode
  return f"{reduction}/{update}" + (f"/micro{micro}" if micro > 1 else "")


def mode_plan(sizes: tuple[int, ...], reduction: str, optimizer_update: str, micro_steps: int = 1) -> Plan:
  """bf16 on every group of ``sizes``, with the mode's reduction, optimizer update and
  micro-steps (every group's)."""
  bf16 = PrecisionPolicy.uniform("bf16")
  groups = [f"g{i}" for i in range(len(sizes))]
  return Plan(
    policies={g: bf16 for g in groups},
    reduction=reduction,
    optimizer_update=optimizer_update,
    micro_steps={g: micro_steps for g in groups} if micro_steps > 1 else {},
  )


def collective_kind(event: dict) -> str | None:
  """The ``COLLECTIVE_KINDS`` kind of a GPU kernel event (``"other collective"`` for a collective
  of none of them), None for a kernel that is no collective (compute, copies)."""
  name = event["name"].lower()
  op = str(event.get("args", {}).get("hlo_op", "")).lower()
  if not any(m in name for m in COMM_KERNEL_MARKS) and not op.startswith(COLLECTIVE_OPCODES):
    return None
  text = f"{name} {op}"
  return next(
    (k for k, marks in COLLECTIVE_KINDS.items() if any(m in text for m in marks)), "other collective"
  )


@dataclasses.dataclass(frozen=True)
class StepKernels:
  """A step's kernels on one GPU, measured: ms per step (means over the traced steps).

  ``collective_ms``: the collective kernels' time per kind (``collective_kind``); ``compute_ms``:
  every other kernel's; ``exposed_ms``: the time at least one collective kernel runs and no other
  kernel does (from the kernels' start and end times). A collective kernel's time includes its
  wait for the other devices to join it."""

  collective_ms: dict[str, float]
  compute_ms: float
  exposed_ms: float


def step_kernels(events: list[dict], repeats: int, device: str = "/device:GPU:0") -> StepKernels | None:
  """The ``StepKernels`` of ``planners.profiler.timing.profiler_events`` of ``repeats`` steps on
  the trace process ``device`` (the first GPU); None where it has no kernel (e.g. on a CPU)."""
  mine = [e for e in events if e["process"].startswith(device)]
  if not mine:
    return None
  by_kind: dict[str, float] = {}
  comm, compute, compute_us = [], [], 0.0
  for e in mine:
    start, us, kind = float(e["ts"]), float(e["dur"]), collective_kind(e)
    if kind is None:
      compute.append((start, start + us))
      compute_us += us
    else:
      comm.append((start, start + us))
      by_kind[kind] = by_kind.get(kind, 0.0) + us
  per_step = 1e3 * repeats  # µs over the trace → ms per step
  return StepKernels(
    {k: us / per_step for k, us in sorted(by_kind.items())},
    compute_us / per_step,
    exposed_length(comm, compute) / per_step,
  )


def build_mode(task, sizes: tuple[int, ...], batch: int, mode: tuple[str, str, int]):
  """``(train step, first state, 3 sharded batches)`` of ``mode_plan`` on the first
  ``sum(sizes)`` devices, with ``MODE_OPTIMIZER`` and the plan's own reduction."""
  # the trainer reads no link: the cluster's are left unset
  cluster = mode_cluster(device_type_of(jax.devices()[0]), sizes, batch)
  return build_program(task, cluster, mode_plan(sizes, *mode), MODE_OPTIMIZER)


@dataclasses.dataclass(frozen=True)
class MeasuredMode:
  """One mode's step as ``time_modes`` measured it: ``samples_ms`` (step times), ``kernels`` (the
  first GPU's ``StepKernels``, None without a GPU) and ``peak_bytes``: one device's peak of the
  compiled step, arguments + outputs − donated + temporaries (``xla_peak_bytes``: XLA's buffer
  assignment, which is what the GPU allocates for the step)."""

  samples_ms: list[float]
  kernels: StepKernels | None
  peak_bytes: int | None


def time_modes(task, sizes: tuple[int, ...], batch: int, steps: int, names=None, trace_steps: int = 5):
  """``{mode: MeasuredMode}`` of every ``modes_of(sizes)`` (of ``names``, ``mode_name``s, where
  given) that builds and runs (a failure is printed, the mode left out): ``MODE_ROUNDS`` rounds of
  ``steps`` steps each (one warm-up step per round; on a GPU queued back to back as a training loop
  runs them, a sample per window of ``PIPELINE_WINDOW`` steps: ``default_step_clock``), the modes
  timed round-robin so that a drift of the machine falls on all alike; then ``trace_steps`` steps of
  each traced (``step_kernels``). The peak is the compiled step's (``ts.step.lower(…).compile()``)."""
  runs, peaks = {}, {}
  for m in modes_of(sizes):
    if names and mode_name(m) not in names:
      continue
    try:  # built and compiled (its first step) one by one: a mode that fails leaves the others
      ts, state, batches = build_mode(task, sizes, batch, m)
      peaks[m] = xla_peak_bytes(ts.step.lower(state, batches[0]).compile())
      runs[m] = stepper(ts.step, state, batches)
      jax.block_until_ready(runs[m][0]())
    except Exception as e:  # noqa: BLE001 - report it; the other modes still count
      runs.pop(m, None)
      print(f"modes: {mode_name(m)} failed: {type(e).__name__}: {str(e)[:300]}")
  samples: dict[tuple[str, str, int], list[float]] = {m: [] for m in runs}
  for _ in range(MODE_ROUNDS):
    for m, (run, _) in runs.items():
      samples[m] += timed_ms(run, steps, warmup=1, clock=default_step_clock())[1]
  out = {}
  for m, (run, _) in runs.items():
    events = profiler_events(lambda run=run: jax.block_until_ready(run()), trace_steps)
    out[m] = MeasuredMode(samples[m], step_kernels(events, trace_steps), peaks[m])
  return out


def modeled_kinds(by_phase: dict[str, float]) -> dict[str, float]:
  """The replay's ``comm_ms_by_phase`` summed per collective kind (``PHASE_KINDS``)."""
  out: dict[str, float] = {}
  for phase, ms in by_phase.items():
    kind = PHASE_KINDS.get(phase, phase)
    out[kind] = out.get(kind, 0.0) + ms
  return out


def predict_mode(prof, sizes: tuple[int, ...], batch: int, mode: tuple[str, str, int], link):
  """The replay's ``Prediction`` of ``mode`` on groups of ``sizes`` devices of ``prof``'s type
  joined by ``link``'s bandwidth (``mode_cluster``), each collective at the predictor's own
  latency (``DEFAULT_LATENCY_US``, as ``qsync plan`` prices it). Not the link fit's intercept:
  that is the host's round trip per timed ``psum`` call (dispatch and wait), which a collective
  queued inside a step does not pay; these rows compare the model with kernel times."""
  cluster = mode_cluster(prof.device_type, sizes, batch, link)
  return predict(cluster, {prof.device_type: prof}, mode_plan(sizes, *mode), latency_us=DEFAULT_LATENCY_US)


def pair(measured, modeled, digits: int, width: int) -> str:
  """``measured/modeled`` right-aligned in ``width``, each with ``digits`` decimals (``-`` for None)."""
  text = "/".join("-" if v is None else f"{v:.{digits}f}" for v in (measured, modeled))
  return f"{text:>{width}}"


def mode_rows(sizes, measured, predictions, link, device) -> list[dict]:
  """Measured against modeled per mode: ``measured`` ``{mode: MeasuredMode}`` (``time_modes``),
  ``predictions`` ``{mode: Prediction}`` (``predict_mode``), ``link`` the measured ``LinkModel``
  (None on one device). One ``step_ms`` row per mode (the
  measured median; baseline the measured flat/replicated step of the same run, None where it did
  not run) with the measured and modeled phase fields and memory; prints the table
  (``measured/modeled`` per cell: the step's ratio to flat/replicated's, then ms; compute: the
  other kernels' time against the replay's forward, backward and optimizer; memory: the first
  device's compiled peak against the memory model's, GB; opt tail: modeled only)."""
  n, first = sum(sizes), "g0"  # the kernels are the first GPU's, of group g0
  base = float(np.median(measured[MODES[0]].samples_ms)) if MODES[0] in measured else None
  model_base = predictions[MODES[0]].step_ms if MODES[0] in predictions else None
  kinds = sorted(
    {k for run in measured.values() if run.kernels for k in run.kernels.collective_ms}
    | {k for p in predictions.values() for k in modeled_kinds(p.comm_ms_by_phase)}
  )
  link_text = (
    "no link"
    if link is None
    else f"link {link.link_gbps / 8:.0f} GB/s (fit: {link.latency_us:.0f} us per psum queued back to "
    f"back; modeled at {DEFAULT_LATENCY_US:g} us per collective)"
  )
  print(
    f"\nmodes on {n} devices (groups {list(sizes)}), {link_text}: "
    "measured (GPU 0 kernels) / modeled (replay) ms per step"
  )
  print(
    f"{'mode':<22} {'step meas (IQR)':>17} {'model':>7} {'x flat meas/model':>17} "
    + " ".join(f"{k:>22}" for k in kinds)
    + f" {'exposed comm':>14} {'compute':>14} {'memory GB':>11} {'opt tail':>8}"
  )
  rows = []
  for mode, run in measured.items():
    samples, kern = run.samples_ms, run.kernels
    pred = predictions[mode]
    med = float(np.median(samples))
    q1, q3 = np.percentile(samples, [25, 75])
    model_kinds = modeled_kinds(pred.comm_ms_by_phase)
    meas_kinds = kern.collective_ms if kern else {}
    meas_ratio = None if base is None else med / base
    model_ratio = None if model_base is None else pred.step_ms / model_base
    cells = [
      pair(meas_ratio, model_ratio, 3, 17),
      *(pair(meas_kinds.get(k, 0.0) if kern else None, model_kinds.get(k, 0.0), 2, 22) for k in kinds),
      pair(kern.exposed_ms if kern else None, pred.exposed_comm_ms[first], 2, 14),
      pair(kern.compute_ms if kern else None, pred.group_compute_ms[first], 2, 14),
      pair(None if run.peak_bytes is None else run.peak_bytes / 1e9, pred.memory_bytes[first] / 1e9, 2, 11),
    ]
    print(
      f"{mode_name(mode):<22} {med:>9.2f} ({q3 - q1:>5.2f}) {pred.step_ms:>7.2f} "
      + " ".join(cells)
      + f" {pred.optimizer_tail_ms[first]:>8.2f}"
    )
    rows.append(
      result_row(
        "multigpu",
        f"modes/{n}dev/{mode_name(mode)}",
        "step_ms",
        med,
        base,
        device,
        iqr_ms=float(q3 - q1),
        timed_samples=len(samples),
        groups=list(sizes),
        measured_collective_ms=meas_kinds if kern else None,
        measured_compute_ms=kern.compute_ms if kern else None,
        measured_exposed_comm_ms=kern.exposed_ms if kern else None,
        exposed_from="GPU 0 kernel intervals (a collective kernel runs, no other kernel does)",
        modeled_step_ms=pred.step_ms,
        modeled_ratio=model_ratio,
        modeled_comm_ms_by_phase=pred.comm_ms_by_phase,
        modeled_collective_ms=model_kinds,
        modeled_exposed_comm_ms=pred.exposed_comm_ms[first],
        modeled_optimizer_tail_ms=pred.optimizer_tail_ms[first],
        modeled_compute_ms=pred.group_compute_ms[first],
        peak_bytes=run.peak_bytes,
        peak_from="the first device's compiled step: arguments + outputs - donated + temporaries",
        modeled_peak_bytes=pred.memory_bytes[first],
        link_gbps=None if link is None else link.link_gbps,
        link_fit_latency_us=None if link is None else link.latency_us,
        modeled_latency_us=DEFAULT_LATENCY_US,
        step_compiler_options=STEP_COMPILER_OPTIONS,
      )
    )
  if not any(run.kernels for run in measured.values()):
    print("(no GPU kernels traced: the measured collective and exposed times need a GPU)")
  return rows
