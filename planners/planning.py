"""``plan_cluster``: every group's per-device batch and per-op precisions for a cluster, from files.

What ``qsync plan`` runs, as one function over a ``PlanRequest`` (the paths and options of the
command): the inputs are read and checked against each other (``planners.inputs``), before the
model is built; with ``measured`` (a ``qsync train`` run directory), each group is costed from a
profile calibrated to its compute measured there (``planners.calibrate``); the training groups'
precision is chosen (``train_precision``; with ``"auto"``, 8 bits on the ops measured to pay,
``training_policies``); the joint batch × precision search runs
(``planners.allocator.joint_plan``) and the chosen plan is predicted (``planners.predictor``) and
summarized against the best baseline and the pool's bound (``planners.allocator.summary``).
``PlanResult.save`` writes the plan (and the calibrated profiles);
``planners.plan_report.plan_report`` says what was planned, each figure labelled.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from planners.allocator import joint_plan, make_problem, omega_table, plan_of
from planners.allocator.greedy import Problem, default_training_groups
from planners.allocator.modes import check_mode
from planners.allocator.payloads import payload_predictions
from planners.allocator.payoff import profile_paying_ops
from planners.allocator.search import Candidate, Search
from planners.allocator.summary import Summary, summarize
from planners.calibrate import calibrated_profile_paths, calibrated_profiles, check_run_groups, read_run
from planners.inputs import (
  check_indicator_model,
  check_model,
  check_outputs_are_not_inputs,
  check_profiles_fit,
  load_indicator,
  load_profiles,
)
from planners.predictor import Prediction, predict, resolve_profiles
from planners.predictor.payload import PRICED_SYNCS, check_sync
from planners.predictor.replay import profile_for
from planners.profile import Profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.devices import DEVICES, training_precision
from qsync_jax.errors import PlanError, QsyncError, UnsupportedPrecisionError
from qsync_jax.plan import Plan
from qsync_jax.precision import PRESETS


def train_precision(cluster: ClusterSpec, training: Sequence[str], preset: str | None) -> str:
  """The policy preset the ``training`` groups of ``cluster`` run: ``preset`` when given, after
  checking that it is a preset every training group's device type runs; else
  ``qsync_jax.devices.training_precision`` of their device types (bf16, else fp16, else fp32)."""
  types = sorted({cluster.group(name).device_type for name in training})
  if preset is None:
    return training_precision(types)
  if preset not in PRESETS:
    raise QsyncError(
      f"--train-precision {preset!r} is not a policy preset. Fix: use one of {list(PRESETS)}, or leave it "
      "out for the training devices' default (bf16, fp16 on a V100 or T4)."
    )
  for name in training:
    g = cluster.group(name)
    legs = PRESETS[preset]
    missing = sorted({legs.fwd, legs.dlhs, legs.drhs} - set(DEVICES[g.device_type].precisions))
    if missing:
      raise UnsupportedPrecisionError(
        f"--train-precision {preset!r}: training group {name!r} ({g.device_type}) cannot run {missing} (it "
        f"runs {list(DEVICES[g.device_type].precisions)}). Fix: pick a preset it runs, or leave "
        "--train-precision out for its default."
      )
  return preset


def training_policies(
  cluster: ClusterSpec, training: Sequence[str], profiles, preset: str, omega, budget: float
) -> dict[str, dict[str, str]]:
  """``{group: {op: 8-bit preset}}`` of ``--train-precision auto``: for each training group, the
  ops of the profile it is costed with (``profile_for``) whose measured 8-bit time is below
  their time at ``preset``, within ``budget`` of Ω (``planners.allocator.payoff.profile_paying_ops``).
  ``PlanError`` naming the group for a profile that is not measured or a device type without an
  8-bit kernel: auto refuses rather than fall back to ``preset`` unasked."""
  chosen = {}
  for name in training:
    g = cluster.group(name)
    try:
      chosen[name] = profile_paying_ops(profile_for(profiles, g.device_type, name), preset, omega, budget)
    except PlanError as e:
      raise PlanError(f"--train-precision auto: training group {name!r} ({g.device_type}): {e}") from None
  return chosen


@dataclasses.dataclass(frozen=True)
class PlanRequest:
  """What to plan: ``qsync plan``'s options (``qsync plan --help`` says what each means).
  ``profiles``: the ``--profile`` files; ``out``: where the plan will be written (its calibrated
  profiles beside it); ``train_precision`` ``"auto"``: the default preset, with 8 bits on the
  training groups' ops measured to pay."""

  model: str
  cluster: str
  indicator: str
  profiles: tuple[str, ...]
  out: str
  training_groups: tuple[str, ...] | None = None
  train_precision: str | None = None
  train_budget: float | None = None
  batch: str = "joint"
  int8_op: str | None = None  # None: int8_fwd, not asked for (an indicator without 8 bits is only said)
  slack: float = 0.02
  granularity: int = 1
  measured: str | None = None
  optimizer_update: str = "auto"
  sync: str = "fp32"

  @property
  def syncs(self) -> tuple[str, ...]:
    """The gradient syncs to search: ``sync``, or with ``"auto"`` every priced one, widest first
    (among plans of equal accuracy cost within the slack, the widest payload wins: ``joint_plan``'s
    tie order; a payload's measured accuracy cost is part of a plan's)."""
    return PRICED_SYNCS if self.sync == "auto" else (self.sync,)

  @property
  def auto(self) -> bool:
    return self.train_precision == "auto"

  @property
  def budget(self) -> float:
    """The share of Ω ``--train-precision auto`` may spend (1.0 unless given)."""
    return 1.0 if self.train_budget is None else self.train_budget

  def check(self) -> None:
    """``QsyncError`` naming an option whose value cannot be planned with, and the fix."""
    if self.slack < 0:
      raise QsyncError(f"--slack {self.slack} must be 0 or more. Fix: pass e.g. --slack 0.02.")
    if self.granularity < 1:
      raise QsyncError(
        f"--granularity {self.granularity} must be at least 1. Fix: pass e.g. --granularity 1."
      )
    if self.train_budget is not None and not self.auto:
      raise QsyncError(
        "--train-budget applies to --train-precision auto alone. Fix: pass --train-precision auto, or leave "
        "--train-budget out."
      )
    if not 0.0 <= self.budget <= 1.0:
      raise QsyncError(f"--train-budget {self.budget} is outside [0, 1]. Fix: pass a fraction, e.g. 0.5.")
    for sync in self.syncs:
      check_sync(sync)
      check_mode(self.optimizer_update, sync)


@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """A request's files, read and checked: the cluster, its training groups and their preset,
  the profiles as given (``given``, ``files``: key → path; ``reported``: those and the calibrated
  ones, each with its file in ``files``) and completed for the cluster (``profiles``: calibrated
  ones included, modeled device types resolved once), the indicator, and, with ``--measured``,
  the calibrated profiles to write (``calibrated``: path → Profile)."""

  cluster: ClusterSpec
  training: tuple[str, ...]
  preset: str
  given: dict[str, Profile]
  files: dict[str, str]
  profiles: dict[str, Profile]
  indicator: dict[str, Any]
  calibrated: dict[str, Profile]
  reported: dict[str, Profile]


def check_indicator_scores_8bit(indicator, request: PlanRequest, cluster: ClusterSpec, training) -> None:
  """Raises ``PlanError`` when the request asks for 8-bit ops — ``--int8-op`` given (of the
  inference groups), ``--train-precision auto`` (of the training groups) — and the indicator scores
  no op at an 8-bit precision those groups' devices run: the planner could not plan one. Else
  warns (``planners.indicator.coverage.warn_unscored``) of inference groups left without 8 bits."""
  from planners.indicator.coverage import unscored_eight_bit, unscored_line, warn_unscored

  omega = omega_table(indicator)
  inference = [g for g in cluster.group_names if g not in training]
  for flag, groups in (
    (f"--int8-op {request.int8_op}", inference if request.int8_op else []),
    ("--train-precision auto", list(training) if request.auto else []),
  ):
    unscored = unscored_eight_bit(omega, cluster, groups)
    if unscored:
      raise PlanError(
        f"{flag} asks for 8-bit ops, but --indicator {request.indicator!r}: {unscored_line(unscored, omega)}"
      )
  warn_unscored(omega, cluster, inference)


def read_inputs(request: PlanRequest) -> PlanInputs:
  """The ``PlanInputs`` of ``request``; every file is read and checked before the model is built
  (``planners.inputs``, ``planners.calibrate``)."""
  from qsync_jax.train.outputs import check_file, check_write_target
  from qsync_jax.train.task import load_task

  request.check()
  inputs = {"--cluster": [request.cluster], "--indicator": [request.indicator], "--profile": request.profiles}
  check_outputs_are_not_inputs({"--out": request.out}, inputs)
  cluster = ClusterSpec.load(request.cluster)
  training = request.training_groups or default_training_groups(cluster)
  unknown = [name for name in training if name not in cluster.group_names]
  if unknown:
    raise PlanError(
      f"--training-groups names {unknown}, which cluster {cluster.name!r} ({request.cluster}) does not have. "
      f"Fix: use some of its groups {list(cluster.group_names)}, comma-separated."
    )
  preset = train_precision(cluster, training, None if request.auto else request.train_precision)
  if request.measured is not None:
    measured, ran, run_meta = read_run(request.measured)
    check_run_groups(cluster, measured, run_meta.get("cluster", []), request.measured, request.cluster)
    profile_paths = calibrated_profile_paths(cluster, request.out)
    outputs = {f"--out's calibrated profile of group {g!r}": path for g, path in profile_paths.items()}
    check_outputs_are_not_inputs(outputs, {**inputs, "--out": [request.out]})
    for path in profile_paths.values():
      check_file("--out (its calibrated profiles)", path)
      check_write_target("--out (its calibrated profiles)", path, "file")
  given, files = load_profiles(request.profiles)
  check_profiles_fit(given, cluster)
  indicator = load_indicator(request.indicator)
  check_indicator_scores_8bit(indicator, request, cluster, training)
  task = load_task(request.model)
  check_model(given, task.name)
  check_indicator_model(indicator, request.indicator, task.name, request.model)
  profiles, calibrated = resolve_profiles(cluster, given), {}
  if request.measured is not None:
    if run_meta.get("task") != task.name:
      raise PlanError(
        f"--measured {request.measured!r} trained model {run_meta.get('task')!r}, not {task.name!r} (--model "
        f"{request.model}); its measurements say nothing of this model's costs. Fix: pass a run of --model "
        f"{request.model}."
      )
    check_profiles_fit(given, cluster, ran)
    own = calibrated_profiles(cluster, profiles, ran, measured, os.path.abspath(request.measured), files)
    profiles = {**profiles, **own}
    calibrated = {profile_paths[p.group]: p for p in own.values()}
    files = {**files, **{p.key: profile_paths[p.group] for p in own.values()}}
  reported = {**given, **{p.key: p for p in calibrated.values()}}
  return PlanInputs(cluster, tuple(training), preset, given, files, profiles, indicator, calibrated, reported)


@dataclasses.dataclass(frozen=True)
class PlanResult:
  """What ``plan_cluster`` planned: the ``plan`` (its ``predictions`` hold the figures), the
  request and its inputs, the search (``problem``, every ``candidates``, the chosen mode's ``search``), the chosen
  candidate's ``prediction`` and ``summary``, the training groups' 8-bit ops (``eight_bit``), and
  how long the search took (``seconds``)."""

  plan: Plan
  request: PlanRequest
  inputs: PlanInputs
  problem: Problem
  chosen: Candidate
  candidates: list[Candidate]
  search: Search
  prediction: Prediction
  summary: Summary
  eight_bit: dict[str, dict[str, str]]
  seconds: float

  def save(self, out: str) -> None:
    """The plan to ``out``, and each calibrated profile to its path beside it, atomically."""
    self.plan.save(out)
    for path, prof in self.inputs.calibrated.items():
      prof.save(path)


def plan_cluster(request: PlanRequest, progress: Callable[[str], None] | None = None) -> PlanResult:
  """The plan of ``request``; see the module docstring. ``progress`` gets one line before the
  search (what is searched)."""
  inputs = read_inputs(request)
  cluster, preset = inputs.cluster, inputs.preset
  eight_bit = {}
  if request.auto:
    omega = omega_table(inputs.indicator)
    eight_bit = training_policies(cluster, inputs.training, inputs.profiles, preset, omega, request.budget)
  problem = make_problem(
    cluster,
    inputs.profiles,
    inputs.indicator,
    inputs.training,
    preset,
    int8_op=request.int8_op or "int8_fwd",
    train_ops=eight_bit,
  )
  if progress is not None:
    progress(
      f"{len(problem.op_names)} ops, {len(cluster.groups)} groups, global batch {cluster.global_batch}: "
      f"{request.batch} batch × precision search; training group(s) {', '.join(inputs.training)} at {preset}"
      + (" with 8 bits where measured to pay" if request.auto else "")
    )
  t0 = time.perf_counter()
  chosen, cands, search = joint_plan(
    problem, request.granularity, request.slack, request.batch, request.optimizer_update, request.syncs
  )
  seconds = time.perf_counter() - t0
  pred = predict(cluster, inputs.profiles, plan_of(problem, chosen))
  summary = summarize(chosen, cands, search, pred)
  running = [g.name for g, b in zip(cluster.groups, chosen.batches) if b > 0]
  predictions = {
    **pred.to_json(),
    "chosen": chosen.name,
    "samples_per_s": chosen.samples_per_s,
    "accuracy_cost": chosen.cost,
    "payload_accuracy_cost": chosen.payload_cost,
    **payload_predictions(problem, cands),
    "alternatives": [c.to_json(problem) for c in cands],
    **summary.to_json(),
    "replays": search.replays,
    "planning_s": seconds,
    "figures": figures_label(pred.sources, running),
  }
  plan = plan_of(problem, chosen, predictions)
  return PlanResult(plan, request, inputs, problem, chosen, cands, search, pred, summary, eight_bit, seconds)


CALIBRATED = "modeled, calibrated to measured"
"""How figures from a calibrated profile (``planners.calibrate``) are labelled."""


def figures_label(sources: Mapping[str, str], groups: Sequence[str]) -> str:
  """How the plan's figures are labelled: ``modeled``, or ``CALIBRATED`` when every running
  group in ``groups`` is costed from a calibrated profile (``Prediction.sources``), or
  ``CALIBRATED for G, …`` when some are."""
  calibrated = [g for g in groups if sources[g].startswith("calibrated")]
  if not calibrated:
    return "modeled"
  return CALIBRATED if len(calibrated) == len(groups) else f"{CALIBRATED} for {', '.join(calibrated)}"


__all__ = [
  "CALIBRATED",
  "PlanInputs",
  "PlanRequest",
  "PlanResult",
  "figures_label",
  "plan_cluster",
  "read_inputs",
  "train_precision",
  "training_policies",
]
