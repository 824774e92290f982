"""Helpers shared by ``qsync profile|predict|plan``: loading inputs, progress, tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from planners.profile import Profile
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
