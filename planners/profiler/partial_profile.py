"""A profile measured so far: the op timings ``measure_profile`` has taken, kept in a JSON file
after every op, so that an interrupted profile resumes where it stopped. The file holds the
measurement settings next to the timings and is only read back under the same settings; writes
replace it atomically, so a kill mid-write leaves the previous version.
"""

from __future__ import annotations

import json
import os
from typing import Any

from qsync_jax.errors import CheckpointError
from qsync_jax.jsonio import write_text_atomic

FORMAT = "qsync-profile-partial/1"


def load_partial(path: str | None, settings: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
  """``(op_ms, unrunnable)`` saved in ``path`` under ``settings``; empty if there is no file.
  Raises ``CheckpointError`` for a file that is not a partial profile or was written under
  other settings."""
  if not path or not os.path.exists(path):
    return {}, []
  try:
    with open(path) as f:
      data = json.load(f)
    if data.get("format") != FORMAT:
      raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
    op_ms, unrunnable, saved = dict(data["op_ms"]), list(data["unrunnable"]), data["settings"]
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(
      f"profile checkpoint {path} cannot be read ({type(e).__name__}: {e}). "
      "Fix: delete it to measure the profile from the start."
    ) from None
  detail = "; ".join(
    f"{k}: saved {saved.get(k)!r}, now {settings.get(k)!r}"
    for k in sorted({*settings, *saved})
    if saved.get(k) != settings.get(k)
  )
  if detail:
    raise CheckpointError(
      f"profile checkpoint {path} was measured under other settings ({detail}). "
      "Fix: rerun with the saved settings, or delete the file to measure from the start."
    )
  return op_ms, unrunnable


def save_partial(
  path: str | None, settings: dict[str, Any], op_ms: dict[str, dict], unrunnable: list[str]
) -> None:
  """Writes the op timings so far to ``path`` (atomically, creating its folder); nothing without a
  path."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  data = {"format": FORMAT, "settings": settings, "op_ms": op_ms, "unrunnable": unrunnable}
  write_text_atomic(path, json.dumps(data), "profile checkpoint", CheckpointError)


def remove_partial(path: str | None) -> None:
  """Removes the checkpoint once the profile is complete."""
  if path and os.path.exists(path):
    os.remove(path)
