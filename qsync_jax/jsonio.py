"""JSON files of plain data: reading them with errors that name the file, the position and the
fix; writing them atomically; and ``JsonFile``, the load/save scaffolding the cluster spec, the
plan and the precision policy share."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar


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


def write_atomic(
  path: str | os.PathLike,
  write: Callable[[str], None],
  what: str,
  error: type[Exception],
  suffix: str = ".tmp",
) -> None:
  """Calls ``write(tmp)`` on a temporary file (ending in ``suffix``) in ``path``'s directory,
  flushes it to disk and renames it over ``path``: ``path`` holds either its old content or all
  of the new, never part of it. A failure (no such directory, no space, a read-only file system, ``path`` a directory
  or a device) raises ``error`` naming ``path`` as ``what``, with ``path`` untouched."""
  path = os.fspath(path)
  try:
    mode = os.stat(path).st_mode
  except OSError:
    mode = None
  if mode is not None and not stat.S_ISREG(mode):
    raise error(f"{what} {path!r} exists and is not a regular file. Fix: choose a file path.")
  directory = os.path.dirname(os.path.abspath(path))
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=suffix)
    os.close(fd)
    write(tmp)
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
    tmp = None
  except OSError as e:
    raise error(
      f"{what} {path!r} cannot be written ({e.strerror or e}); nothing was changed there. "
      "Fix: choose a path in an existing, writable directory with free space."
    ) from None
  finally:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.unlink(tmp)


def write_text_atomic(path: str | os.PathLike, text: str, what: str, error: type[Exception]) -> None:
  """``text`` written to ``path`` by ``write_atomic``."""

  def write(tmp: str) -> None:
    with open(tmp, "w") as f:
      f.write(text)

  write_atomic(path, write, what, error)


def reject_unknown_keys(
  obj: Mapping[str, Any], allowed: Iterable[str], where: str, error: type[Exception], allowed_text: str = ""
) -> None:
  """Raises ``error`` naming ``where`` and every key of ``obj`` outside ``allowed`` (sorted),
  with the fix: use only ``allowed_text`` (default: the sorted allowed keys)."""
  allowed = list(allowed)
  unknown = sorted(set(obj) - set(allowed))
  if unknown:
    raise error(f"{where}: unknown key(s) {unknown}. Fix: use only {allowed_text or sorted(allowed)}.")


class JsonFile:
  """``dumps`` / ``save`` / ``loads`` / ``load`` for a class with ``to_json()`` and
  ``from_json(obj)``. A subclass names its file (``JSON_WHAT``, e.g. ``"plan"``) and its error
  class (``JSON_ERROR``); errors from ``from_json`` come back prefixed with the source."""

  JSON_WHAT: ClassVar[str]
  JSON_ERROR: ClassVar[type[Exception]]

  def to_json(self) -> Any:
    raise NotImplementedError

  @classmethod
  def from_json(cls, obj: Any):
    raise NotImplementedError

  def dumps(self) -> str:
    return json.dumps(self.to_json(), indent=2, default=str)

  def save(self, path: str | os.PathLike) -> None:
    """Writes ``dumps()`` to ``path`` atomically (``write_text_atomic``)."""
    write_text_atomic(path, self.dumps() + "\n", self.JSON_WHAT, self.JSON_ERROR)

  @classmethod
  def parse(cls, text: str, source: str) -> Any:
    """The plain data in ``text`` (JSON)."""
    return parse_json(text, source, cls.JSON_ERROR)

  @classmethod
  def loads(cls, text: str, source: str = "<string>"):
    obj = cls.parse(text, source)
    try:
      return cls.from_json(obj)
    except cls.JSON_ERROR as e:
      raise cls.JSON_ERROR(f"{source}: {e}") from None

  @classmethod
  def load(cls, path: str | os.PathLike):
    return cls.loads(read_text(path, cls.JSON_WHAT, cls.JSON_ERROR), source=str(path))
