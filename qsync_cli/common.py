"""Helpers shared by ``qsync profile|predict|plan``: loading inputs, progress, tables."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from qsync_jax.errors import OutputPathError, PlanError, PolicyError
from qsync_jax.jsonio import parse_json, read_text

if TYPE_CHECKING:
  from planners.profile import Profile


def add_model_argument(parser) -> None:
  """``--model``, as every command takes it."""
  parser.add_argument(
    "--model",
    required=True,
    help="a registered task name (the examples': vgg, resnet, lm, …) or package.module:attr, a Task or a "
    "function returning one",
  )


def progress(msg: str) -> None:
  """One progress line on stderr (stdout stays for results)."""
  print(f"  … {msg}", file=sys.stderr, flush=True)


def load_profiles(paths: Sequence[str], with_paths: bool = False):
  """``{profile_key: Profile}`` from ``qsync profile`` files (and the calibrated profiles of
  single groups ``qsync plan --measured`` writes): one per device type, and one per group. With
  ``with_paths``, ``(profiles, {profile_key: the file it came from})``."""
  from planners.profile import Profile

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
  return (out, files) if with_paths else out


CALIBRATED = "modeled, calibrated to measured"
"""How figures from a calibrated profile (``planners.calibrate``) are labelled."""


def cost_source_lines(cluster, profiles: dict[str, Profile], files: dict[str, str]) -> list[str]:
  """Where each group's costs come from, one line a group: for a profile of the group alone
  (``Profile.group``) ``modeled, calibrated to measured: FILE`` with its scale, fit and run;
  else for the ``--profile`` file of its device type ``measured: FILE`` / ``traced: FILE`` /
  ``modeled from the catalog: FILE`` (by that profile's source); else ``modeled from the
  catalog (based on FILE)`` with the file ``planners.predictor.base_profile`` (the first
  measured one given). Then one line per file that no group used: of a device type no group
  has, and not that base."""
  from planners.predictor import base_profile
  from planners.profile import profile_key

  base = base_profile(profiles).key if profiles else None
  used = set()
  lines = []
  for g in cluster.groups:
    own = profiles.get(profile_key(g.device_type, g.name))
    prof = profiles.get(g.device_type)
    if own is not None:
      used.add(own.key)
      where = f"{CALIBRATED}: {files[own.key]}{calibration_note(own)}"
    elif prof is None:
      used.add(base)
      where = f"modeled from the catalog (based on {files[base]})"
    else:
      used.add(g.device_type)
      label = "modeled from the catalog" if prof.source == "modeled" else prof.source
      where = f"{label}: {files[g.device_type]}"
    lines.append(f"  {g.name} ({g.device_type}): {where}")
  types = sorted({g.device_type for g in cluster.groups})
  for key, path in files.items():
    t = profiles[key].device_type
    if key not in used and t not in types and profiles[key].group is None:
      lines.append(
        f"  profile {path} (device type {t}) was not used: no group of the cluster is of type {t}. Fix: "
        f"profile on a host of one of the cluster's device types {types} and pass that file, or drop {path}."
      )
  return ["costs per group:", *lines]


def calibration_note(prof: Profile) -> str:
  """`` (×SCALE the costs of BASE, fit to N points measured at step S of RUN, RMS error E %)``
  from a calibrated profile's ``meta["calibration"]``; "" without one."""
  cal = prof.meta.get("calibration")
  if not isinstance(cal, dict):
    return ""
  return (
    f" (×{cal['scale']:.3g} the {cal['base']['source']} costs of {cal['base']['file']}, fit to "
    f"{len(cal['points'])} points measured at step {cal['step']} of {cal['run']}, RMS error "
    f"{100 * cal['rel_rms_error']:.0f} %)"
  )


def check_model(profiles: dict[str, Profile], task_name: str) -> None:
  for prof in profiles.values():
    if prof.model != task_name:
      raise PlanError(
        f"profile for {prof.device_type} was measured on model {prof.model!r}, not {task_name!r}. "
        "Fix: profile the same model (`qsync profile --model ...`)."
      )


def check_profiles_fit(profiles: dict[str, Profile], cluster, plan=None) -> None:
  """Each profile of one group (``Profile.group``) is of a group of the cluster, of that
  group's device type; each group's profile (its own, else its device type's) was measured at
  the group's per-device batch of the cluster spec (a plan's ``batch_per_device`` overrides are
  scaled from there); and every rule of a group's policy in ``plan`` matches an op of the
  profiled model; else ``PlanError``."""
  from planners.profile import profile_key

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


def load_json(path: str, what: str):
  return parse_json(read_text(path, what, PlanError), path, PlanError)


def check_write_target(flag: str, path: str, kind: str) -> None:
  """What a write would fail on only after the work, refused before it (a complement of
  ``qsync_jax.train.outputs``'s checks): a symbolic link that leads nowhere (a loop, or a missing
  target: outputs are replaced by a rename, never written through a link), and for a ``file``
  output a path ending in a separator (a directory's name) or an existing file that is not a
  regular one (a device such as ``/dev/full``)."""
  if os.path.islink(path) and not os.path.exists(path):
    raise OutputPathError(
      f"{flag} {path!r} is a symbolic link that leads nowhere (a loop, or a missing target). Fix: pass the "
      "path it should lead to, or remove the link."
    )
  if kind != "file":
    return
  if path.endswith(("/", os.sep)):
    raise OutputPathError(
      f"{flag} {path!r} ends in {path[-1]!r}, so it names a directory, not a file. Fix: name a file, e.g. "
      f"{os.path.join(path, 'out.json')}."
    )
  if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
    raise OutputPathError(
      f"{flag} {path!r} exists and is not a regular file (a device?). Fix: choose a file path."
    )


def check_write_targets(args, outputs: Mapping[str, str]) -> None:
  """``check_write_target`` for every output option of parsed ``args`` (``{dest: kind}``, as
  ``qsync_jax.train.outputs.check_outputs`` takes them); options left unset are skipped."""
  for dest, kind in outputs.items():
    path = getattr(args, dest, None)
    if path is not None:
      check_write_target("--" + dest.replace("_", "-"), path, kind)
