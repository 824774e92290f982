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
  """``{device type: Profile}`` from ``qsync profile`` files; one per device type. With
  ``with_paths``, ``(profiles, {device type: the file it came from})``."""
  from planners.profile import Profile

  out: dict[str, Profile] = {}
  files: dict[str, str] = {}
  for path in paths:
    prof = Profile.load(path)
    if prof.device_type in out:
      raise PlanError(
        f"--profile {path!r}: a second profile for device type {prof.device_type!r}. "
        "Fix: pass one profile per device type."
      )
    out[prof.device_type] = prof
    files[prof.device_type] = path
  return (out, files) if with_paths else out


def cost_source_lines(cluster, profiles: dict[str, Profile], files: dict[str, str]) -> list[str]:
  """Where each group's costs come from, one line a group: ``measured: FILE`` / ``traced: FILE`` /
  ``modeled from the catalog: FILE`` for the ``--profile`` file of its device type (by that
  profile's source), else ``modeled from the catalog (based on FILE)`` with the file
  ``planners.predictor.base_profile`` (the first measured one given). Then
  one line per file that no group used: of a device type no group has, and not that base."""
  from planners.predictor import base_profile

  base = base_profile(profiles).device_type if profiles else None
  used = set()
  lines = []
  for g in cluster.groups:
    prof = profiles.get(g.device_type)
    if prof is None:
      used.add(base)
      where = f"modeled from the catalog (based on {files[base]})"
    else:
      used.add(g.device_type)
      label = "modeled from the catalog" if prof.source == "modeled" else prof.source
      where = f"{label}: {files[g.device_type]}"
    lines.append(f"  {g.name} ({g.device_type}): {where}")
  types = sorted({g.device_type for g in cluster.groups})
  for t, path in files.items():
    if t not in used:
      lines.append(
        f"  profile {path} (device type {t}) was not used: no group of the cluster is of type {t}. Fix: "
        f"profile on a host of one of the cluster's device types {types} and pass that file, or drop {path}."
      )
  return ["costs per group:", *lines]


def check_model(profiles: dict[str, Profile], task_name: str) -> None:
  for prof in profiles.values():
    if prof.model != task_name:
      raise PlanError(
        f"profile for {prof.device_type} was measured on model {prof.model!r}, not {task_name!r}. "
        "Fix: profile the same model (`qsync profile --model ...`)."
      )


def check_profiles_fit(profiles: dict[str, Profile], cluster, plan=None) -> None:
  """Each group's profile was measured at the group's per-device batch of the cluster spec (a
  plan's ``batch_per_device`` overrides are scaled from there), and every rule of a group's policy
  in ``plan`` matches an op of the profiled model; else ``PlanError``."""
  for g in cluster.groups:
    prof = profiles.get(g.device_type)
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
