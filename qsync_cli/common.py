"""Helpers shared by ``qsync profile|predict|plan``: loading inputs, progress, tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qsync_jax.errors import PlanError, PolicyError
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


def load_profiles(paths: Sequence[str]) -> dict[str, Profile]:
  """``{device type: Profile}`` from ``qsync profile`` files; one per device type."""
  from planners.profile import Profile

  out: dict[str, Profile] = {}
  for path in paths:
    prof = Profile.load(path)
    if prof.device_type in out:
      raise PlanError(
        f"--profile {path!r}: a second profile for device type {prof.device_type!r}. "
        "Fix: pass one profile per device type."
      )
    out[prof.device_type] = prof
  return out


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
