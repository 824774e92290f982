"""Profiles calibrated to a training run's measured group speeds (``qsync plan --measured RUN``).

While ``qsync train`` re-plans (``--replan once|auto``), it measures each group's compute — one
device's training step of the group without collectives: forward, backward at the group's
policy and the optimizer update — at a few per-device batches, and logs every decision as a
line ``{"step": N, "replan": {"measured_ms": {group: {"<batch>": ms, ...}}, ...}}`` of
``RUN/metrics.jsonl`` (``qsync_jax.train.replan``). Here, over plain data:

* ``latest_measurements``: each group's points of the last ``replan`` record that measured it
  (and, where that record lifted the group's 8-bit legs to 16 bits, the lifted policy's points:
  the plan that ran holds the lifted policy unless the re-plan was undone);
* ``fit_scale``: the least-squares scale through the origin of modeled against measured times;
* ``calibrated_profile``: a group's profile scaled to its measurements. The model's equivalent
  of what was measured is ``planners.predictor.replay.one_device_compute_ms`` of the group at
  its policy at each measured batch, from the profile the planner costs it with
  (``profile_for``: its device type's, measured or modeled from the catalog); where the group
  was measured at two batches or more, that profile's fixed share refitted to them
  (``planners.profiler.fit.fit_fixed_share``), then one scale ``s`` per group, ``fit_scale`` over its points; the
  group's profile is that profile with every time times ``s`` (``Profile.times_scaled``: op
  legs, remainder, optimizer, cast models),
  ``group`` set (it wins over its device type's profile for that group alone),
  ``source="calibrated"`` and ``meta["calibration"]``: the run, the record's step, the
  measured and modeled points, the scale, the fixed share, the fit's RMS relative error and
  what it was calibrated from.

The scale and the fixed share fix the level of a group's costs and how they grow with its
batch, not their shape: how the time splits between ops and precisions stays the model's (a
group measured at one policy says nothing of another precision's relative speed). A time-sliced device, whose step
barely depends on its batch, is fit only on average (the RMS relative error says how well).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from planners.predictor.replay import base_profile, one_device_compute_ms, profile_for
from planners.profile import GroupCost, Profile, profile_key
from planners.profiler.fit import fit_fixed_share
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import PlanError, QsyncWarning
from qsync_jax.jsonio import read_json_lines, undecodable_warning
from qsync_jax.plan import Plan
from qsync_jax.precision import OpPolicy


class GroupMeasurement(NamedTuple):
  """One group's measured compute: the step of the ``replan`` record it comes from (-1 where
  the record has none) and ``{per-device batch: ms}`` at the policy the group ran; where that
  record lifted the group's 8-bit legs, ``lifted``: the lifted policy (its JSON) and its points."""

  step: int
  points: dict[int, float]
  lifted: tuple[Any, dict[int, float]] | None = None

  def at(self, policy_json: Any) -> dict[int, float]:
    """The points measured at ``policy_json`` (a ``PrecisionPolicy.to_json()``): the lifted
    policy's where the record lifted the group to it, else the running policy's."""
    if self.lifted is not None and self.lifted[0] == policy_json:
      return self.lifted[1]
    return self.points


def latest_measurements(records: Iterable[Any], source: str) -> dict[str, GroupMeasurement]:
  """``{group: GroupMeasurement}`` of every group measured in ``records`` (a run's metrics
  lines, parsed, in order): its points in the last ``replan`` record whose ``measured_ms`` has
  it. Other records are skipped. ``PlanError`` naming ``source`` for a measurement that is not
  ``{"<batch>": ms}`` with positive batches and times."""
  out: dict[str, GroupMeasurement] = {}
  for record in records:
    replan = record.get("replan") if isinstance(record, Mapping) else None
    measured = replan.get("measured_ms") if isinstance(replan, Mapping) else None
    if not isinstance(measured, Mapping):
      continue
    step = record.get("step")
    lifts = replan.get("lifted") if isinstance(replan.get("lifted"), Mapping) else {}
    for group, points in measured.items():
      lift = lifts.get(group)
      lifted = None
      if isinstance(lift, Mapping) and "new" in lift:
        lifted = (lift["new"], _points(lift.get("measured_ms"), group, source))
      out[group] = GroupMeasurement(
        step if isinstance(step, int) else -1, _points(points, group, source), lifted
      )
  return out


def _points(points: Any, group: str, source: str) -> dict[int, float]:
  try:
    out = {int(b): float(ms) for b, ms in points.items()}
  except (AttributeError, TypeError, ValueError):
    out = {}
  if not out or any(b <= 0 or not ms > 0 or not math.isfinite(ms) for b, ms in out.items()):
    raise PlanError(
      f'{source}: the measured_ms of group {group!r}, {points!r}, is not {{"<per-device batch>": ms}} with '
      "positive batches and times. Fix: pass the metrics.jsonl `qsync train` wrote, unedited."
    )
  return out


def fit_scale(pairs: Sequence[tuple[float, float]]) -> float:
  """The ``s`` minimizing ``Σ (s · modeled − measured)²`` over ``(modeled, measured)`` pairs:
  ``Σ modeled · measured / Σ modeled²``. ``PlanError`` when there is none (no pair, or every
  modeled time 0)."""
  den = sum(x * x for x, _ in pairs)
  if not pairs or den <= 0:
    raise PlanError(
      f"cannot fit a scale to {list(pairs)} (modeled, measured) ms: no point with a modeled time above 0. "
      "Fix: measure the group at a batch of at least 1 with a profile of the model."
    )
  return sum(x * y for x, y in pairs) / den


def calibrated_profile(
  base: Profile,
  group: str,
  policies: Mapping[str, OpPolicy | None],
  measured: GroupMeasurement,
  run: str,
  based_on: str,
) -> Profile:
  """``base`` (the profile ``group`` is costed with) calibrated to ``measured``, its compute
  at ``policies`` (op name → OpPolicy; the policy it ran) measured in ``run``; ``based_on``
  names ``base`` (its file) in the record. See the module docstring."""
  batches = sorted(measured.points)
  if len(batches) > 1:  # how the time grows with the batch is measured too
    base = dataclasses.replace(base, fixed_share=fit_fixed_share(base, policies, measured.points, group))
  modeled = {b: one_device_compute_ms(GroupCost(group, base, policies, b)) for b in batches}
  scale = fit_scale([(modeled[b], measured.points[b]) for b in batches])
  if not scale > 0:  # a modeled time below 0 (a negative fitted remainder)
    raise PlanError(
      f"group {group!r}: its modeled times {modeled} ms fit its measured ones {measured.points} only at a "
      f"scale of {scale:.3g}, not above 0. Fix: re-profile the model (`qsync profile`) at the group's batch."
    )
  errors = [(scale * modeled[b] - measured.points[b]) / measured.points[b] for b in batches]
  calibration = {
    "run": run,
    "step": measured.step,
    "scale": scale,
    "fixed_share": base.fixed_share,
    "rel_rms_error": math.sqrt(sum(e * e for e in errors) / len(errors)),
    "points": [{"batch": b, "measured_ms": measured.points[b], "modeled_ms": modeled[b]} for b in batches],
    "base": {"source": base.source, "device_type": base.device_type, "file": based_on},
  }
  return dataclasses.replace(
    base.times_scaled(scale),
    source="calibrated",
    group=group,
    meta={**base.meta, "calibration": calibration},
  )


def check_run_groups(
  cluster: ClusterSpec,
  measured: Mapping[str, GroupMeasurement],
  run_groups: Sequence[Sequence[Any]],
  run: str,
  cluster_path: str,
) -> None:
  """``PlanError`` unless the run's groups (``run_groups``: its checkpoint's ``[name, count,
  per-device batch]`` of each) are ``cluster``'s, with as many devices each, and every group of
  ``cluster`` was measured."""
  ran = {str(name): int(count) for name, count, *_ in run_groups}
  spec = {g.name: g.count for g in cluster.groups}
  if ran != spec:
    raise PlanError(
      f"--measured {run!r} ran groups {ran} (name: devices), but --cluster {cluster_path!r} has {spec}. Fix: "
      "pass the cluster spec the run trained on."
    )
  missing = [name for name in cluster.group_names if name not in measured]
  if missing:
    raise PlanError(
      f"--measured {run!r}: its metrics.jsonl has no measurement of group(s) {missing} (measured: "
      f"{sorted(measured)}). Fix: pass a run that re-planned with every group running (`qsync train --replan "
      "once`)."
    )


def calibrated_profiles(
  cluster: ClusterSpec,
  profiles: Mapping[str, Profile],
  plan: Plan,
  measured: Mapping[str, GroupMeasurement],
  run: str,
  files: Mapping[str, str],
) -> dict[str, Profile]:
  """``{profile_key(device type, group): calibrated profile}`` of every group of ``cluster``:
  the profile it is costed with (``profile_for``) at its policy in ``plan`` (the plan that ran)
  calibrated to ``measured[group]`` (``calibrated_profile``); ``files`` names the given
  profiles by key (a group modeled from the catalog: ``modeled from FILE``)."""
  out = {}
  for g in cluster.groups:
    base = profile_for(profiles, g.device_type, g.name)
    based_on = files.get(base.key) or f"modeled from the catalog (based on {_base_file(profiles, files)})"
    policy = plan.policy_for(g.name)
    taken = measured[g.name]
    at_policy = GroupMeasurement(taken.step, taken.at(policy.to_json()))  # a lifted group: its lifted points
    out[profile_key(g.device_type, g.name)] = calibrated_profile(
      base, g.name, base.policies(plan.policy_on(g)), at_policy, run, based_on
    )
  return out


def _base_file(profiles: Mapping[str, Profile], files: Mapping[str, str]) -> str:
  return files.get(base_profile(profiles).key, "?")


def read_run(run: str):
  """``(each group's latest measurement, the plan the run ran, its checkpoint's meta)`` of the
  ``qsync train`` directory ``run``: the measurements from its ``metrics.jsonl``
  (``latest_measurements``; lines that are not JSON, such as one a kill cut short, are skipped as
  the trainer skips them, and lines that are not UTF-8 with a ``QsyncWarning`` naming them), the plan and the groups from its latest checkpoint (re-planning
  changes only batches, so that plan's policies are the ones measured). ``PlanError`` naming
  what is missing, before any model is built."""
  from qsync_jax.train.checkpoint import CheckpointStore

  fix = "Fix: pass the --out directory of a `qsync train --replan once` (or auto) run."
  if not os.path.isdir(run):
    raise PlanError(f"--measured {run!r} is not a directory. {fix}")
  metrics = os.path.join(run, "metrics.jsonl")
  if not os.path.isfile(metrics):
    raise PlanError(f"--measured {run!r} has no metrics.jsonl, so no measurements. {fix}")
  lines, undecodable = read_json_lines(metrics)
  if undecodable:
    warnings.warn(undecodable_warning(metrics, undecodable, "skipped"), QsyncWarning, stacklevel=2)
  measured = latest_measurements([line.value for line in lines if line.value is not None], metrics)
  if not measured:
    raise PlanError(
      f"--measured {run!r}: {metrics} has no measurement of the groups' speeds (no `replan` line with "
      "`measured_ms`). Fix: train with `qsync train --replan once` (the default on GPUs) or `--replan auto`, "
      "and pass that run."
    )
  store = CheckpointStore(os.path.join(run, "checkpoints"))
  try:
    if store.latest_step() is None:
      raise PlanError(
        f"--measured {run!r} holds no checkpoint, so the plan it ran (each group's policy, at which the "
        "groups were measured) is unknown. Fix: let the run checkpoint (it does at its end and every "
        "--checkpoint-every steps; `qsync train ... --resume` with more --steps continues it), then pass it."
      )
    _, meta = store.read_meta()
  finally:
    store.close()
  return measured, Plan.from_json(meta["plan"]), meta


GROUP_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""Group names a ``profile-GROUP.json`` file can carry."""


def calibrated_profile_paths(cluster: ClusterSpec, out: str) -> dict[str, str]:
  """``{group: DIR/profile-GROUP.json}``, ``DIR`` the directory of the plan ``out``;
  ``PlanError`` for a group name that cannot be part of a file name."""
  paths = {}
  for name in cluster.group_names:
    if not GROUP_FILE_NAME.fullmatch(name):
      raise PlanError(
        f"--measured: group {name!r}'s calibrated profile would be written to profile-{name}.json, which is no "
        "plain file name. Fix: name the group with letters, digits, '.', '_' and '-' only (in the cluster spec "
        "and the run)."
      )
    paths[name] = os.path.join(os.path.dirname(out), f"profile-{name}.json")
  return paths
