"""The planner's input files, read and checked against each other before any work.

``qsync predict`` and ``qsync plan`` read a cluster spec, cost profiles (``qsync profile``; one
per device type, and the calibrated profiles of single groups ``qsync plan --measured`` writes), a
plan or an indicator table (``qsync indicator``), and a model. Each check here raises
``PlanError`` naming the file, the constraint and the fix, so a bad input is refused before a
model is built or a plan searched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from planners.profile import Profile, profile_key
from qsync_jax.errors import OutputPathError, PlanError, PolicyError
from qsync_jax.jsonio import parse_json, read_text


def load_profiles(paths: Sequence[str]) -> tuple[dict[str, Profile], dict[str, str]]:
  """``({profile_key: Profile}, {profile_key: the file it came from})`` of ``qsync profile``
  files (and the calibrated profiles of single groups ``qsync plan --measured`` writes): one per
  device type, and one per group."""
  out: dict[str, Profile] = {}
  files: dict[str, str] = {}
  for path in paths:
    prof = Profile.load(path)
    if prof.key in out:
      what = f"device type {prof.device_type!r}" if prof.group is None else f"group {prof.group!r}"
      raise PlanError(
        f"--profile {path!r}: a second profile for {what} (the first: {files[prof.key]!r}). "
        "Fix: pass one profile per device type and at most one per group."
      )
    out[prof.key] = prof
    files[prof.key] = path
  return out, files


def load_indicator(path: str) -> dict[str, Any]:
  """The indicator table at ``path`` (``qsync indicator``'s JSON), every Ω a finite number
  (``planners.indicator.check_values``)."""
  from planners.indicator import check_values

  table = parse_json(read_text(path, "indicator", PlanError), path, PlanError)
  check_values(table, path)
  return table


def check_model(profiles: Mapping[str, Profile], task_name: str) -> None:
  """``PlanError`` for a profile measured on another model than ``task_name``."""
  for prof in profiles.values():
    if prof.model != task_name:
      raise PlanError(
        f"profile for {prof.device_type} was measured on model {prof.model!r}, not {task_name!r}. "
        "Fix: profile the same model (`qsync profile --model ...`)."
      )


def check_indicator_model(indicator, path: str, task_name: str, model: str) -> None:
  """``PlanError`` when the indicator table at ``path`` says it was computed on another model
  than ``task_name`` (its ``metadata.task``; a hand-written table without one passes)."""
  metadata = indicator.get("metadata") if isinstance(indicator, dict) else None
  scored = metadata.get("task") if isinstance(metadata, dict) else None
  if scored is not None and scored != task_name:
    raise PlanError(
      f"--indicator {path!r} was computed on model {scored!r}, not on {task_name!r} (--model {model}); "
      "another model's sensitivities say nothing about this one's ops. Fix: run `qsync indicator "
      f"--model {model} --out FILE` and pass that FILE."
    )


def check_profiles_fit(profiles: Mapping[str, Profile], cluster, plan=None) -> None:
  """Each profile of one group (``Profile.group``) is of a group of the cluster, of that
  group's device type; each group's profile (its own, else its device type's) was measured at
  the group's per-device batch of the cluster spec (a plan's ``batch_per_device`` overrides are
  scaled from there); and every rule of a group's policy in ``plan`` matches an op of the
  profiled model; else ``PlanError``."""
  for prof in profiles.values():
    if prof.group is None:
      continue
    if prof.group not in cluster.group_names:
      raise PlanError(
        f"a --profile is calibrated for group {prof.group!r}, which cluster {cluster.name!r} does not have "
        f"(it has {list(cluster.group_names)}). Fix: pass the cluster spec it was planned for, or drop that "
        "profile."
      )
    if cluster.group(prof.group).device_type != prof.device_type:
      raise PlanError(
        f"the --profile of group {prof.group!r} is of device type {prof.device_type!r}, but the cluster's group "
        f"{prof.group!r} is a {cluster.group(prof.group).device_type!r} group. Fix: pass the cluster spec it "
        "was planned for, or drop that profile."
      )
  for g in cluster.groups:
    prof = profiles.get(profile_key(g.device_type, g.name)) or profiles.get(g.device_type)
    if prof is None:
      continue  # the replay names the missing profile
    if prof.batch_per_device != g.batch_per_device:
      raise PlanError(
        f"the {g.device_type} profile was measured at batch {prof.batch_per_device} per device, but group "
        f"{g.name!r} runs {g.batch_per_device}; op costs do not scale linearly with the batch. Fix: "
        f"profile at that batch (`qsync profile --batch {g.batch_per_device} ...`)."
      )
    if plan is not None:
      try:
        plan.policy_for(g.name).check_rules_match(prof.op_names, f"plan: group {g.name!r}")
      except PolicyError as e:
        raise PlanError(str(e)) from None


def check_outputs_are_not_inputs(outputs: Mapping[str, str], inputs: Mapping[str, Sequence[str]]) -> None:
  """``OutputPathError`` when an output (``{what: path}``) is one of the command's input files
  (``{flag: paths}``): writing it would replace an input the command reads, or read next time.
  Paths are compared as files (``os.path.realpath``: a link or a ``./`` spelling of an input is
  that input)."""
  given = {os.path.realpath(p): (flag, p) for flag, paths in inputs.items() for p in paths if p}
  for what, path in outputs.items():
    hit = given.get(os.path.realpath(path))
    if hit is not None:
      raise OutputPathError(
        f"{what} {path!r} is the {hit[0]} file {hit[1]!r} this command reads; writing it would replace that "
        "input. Fix: write the output to another path."
      )
