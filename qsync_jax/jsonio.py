"""Reading user JSON files with errors that name the file, the position and the fix."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def parse_json(text: str, source: str, error: type[Exception]) -> Any:
  """``json.loads(text)``; an empty text or bad syntax raises ``error`` naming ``source`` (and the
  position)."""
  if not text.strip():
    raise error(f"{source} is empty. Fix: pass the file the command that writes it wrote, or write it anew.")
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise error(
      f"{source} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). "
      "Fix: correct the JSON syntax there."
    ) from None


def read_text(path: str, what: str, error: type[Exception]) -> str:
  """The text of ``path``; an unreadable file raises ``error`` naming it as ``what``."""
  try:
    with open(path) as f:
      return f.read()
  except OSError as e:
    raise error(
      f"{what} {str(path)!r} cannot be read ({e.strerror}). Fix: pass the path of a {what} file."
    ) from None


def reject_unknown_keys(
  obj: Mapping[str, Any], allowed: Iterable[str], where: str, error: type[Exception], allowed_text: str = ""
) -> None:
  """Raises ``error`` naming ``where`` and every key of ``obj`` outside ``allowed`` (sorted),
  with the fix: use only ``allowed_text`` (default: the sorted allowed keys)."""
  allowed = list(allowed)
  unknown = sorted(set(obj) - set(allowed))
  if unknown:
    raise error(f"{where}: unknown key(s) {unknown}. Fix: use only {allowed_text or sorted(allowed)}.")
