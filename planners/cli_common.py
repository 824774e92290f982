"""Helpers shared by ``qsync profile|predict|plan``: loading inputs, progress, tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from planners.profiler import Profile
from qsync_jax.errors import PlanError


def progress(msg: str) -> None:
  """One progress line on stderr (stdout stays for results)."""
  print(f"  … {msg}", file=sys.stderr, flush=True)


def load_profiles(paths: Sequence[str]) -> dict[str, Profile]:
  """``{device type: Profile}`` from ``qsync profile`` files; one per device type."""
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


CALIBRATE_HELP = (
  "GROUP=MS: the median fp32 step (ms) measured on that group's devices alone (uniform fp32 policy, "
  "its batch per device); refits the remainder of the group's profile to it (repeatable)"
)


def parse_calibration(items: Sequence[str]) -> dict[str, float]:
  """``{group: ms}`` of ``--calibrate GROUP=MS`` arguments."""
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    try:
      ms = float(value)
    except ValueError:
      ms = None
    if not sep or not name or ms is None:
      raise PlanError(f"--calibrate {item!r} is not GROUP=MS. Fix: write e.g. --calibrate train=15.4.")
    out[name] = ms
  return out


CALIBRATE_DEVICES_HELP = (
  "where the --calibrate steps were measured: 'group' (default) on each group's devices, 'one' on one "
  "device of it, leaving the all-reduce and the growth with the device count to the replay"
)


def calibrated_profiles(
  cluster, profiles: dict[str, Profile], items: Sequence[str], devices: str = "group"
) -> dict[str, Profile]:
  """``profiles`` refitted to the ``--calibrate GROUP=MS`` steps (``replay.calibrate``, measured
  on ``devices``), each refit reported on stderr."""
  from planners.replay import calibrate  # replay builds on the profiler this module loads

  steps = parse_calibration(items)
  out = calibrate(cluster, profiles, steps, devices)
  for g in cluster.groups:
    if g.name in steps:
      before = sum(profiles[g.device_type].remainder_ms.values()) if g.device_type in profiles else None
      after = sum(out[g.device_type].remainder_ms.values())
      was = "modeled" if before is None else f"{before:.3f} ms"
      progress(
        f"calibrated {g.name} ({g.device_type}) to its fp32 step {steps[g.name]} ms: remainder {was} -> {after:.3f} ms"
      )
  return out


def check_model(profiles: dict[str, Profile], task_name: str) -> None:
  for prof in profiles.values():
    if prof.model != task_name:
      raise PlanError(
        f"profile for {prof.device_type} was measured on model {prof.model!r}, not {task_name!r}. "
        "Fix: profile the same model (`qsync profile --model ...`)."
      )


def load_json(path: str, what: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise PlanError(f"{what} {path!r} cannot be read ({e}). Fix: pass a valid JSON file.") from None


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A plain-text table with right-aligned numbers."""

  def fmt(x):
    return f"{x:.3f}" if isinstance(x, float) else str(x)

  cells = [[fmt(c) for c in r] for r in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
  lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
  lines.append("  ".join("-" * w for w in widths))
  for r in cells:
    lines.append(
      "  ".join(c.rjust(w) if c[:1].isdigit() or c[:1] == "-" else c.ljust(w) for c, w in zip(r, widths))
    )
  return "\n".join(lines)
