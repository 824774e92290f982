"""JSON files of plain data: reading them with errors that name the file, the position and the
fix (a key given twice in one object is refused: which of the two the user meant is unknown);
reading JSON-lines logs that a kill or a disk error may have damaged (``read_json_lines``);
writing them atomically with the permissions a plain ``open(path, "w")`` would give; and
``JsonFile``, the load/save scaffolding the cluster spec, the plan and the precision policy share."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar


class _DuplicateKey(Exception):
  def __init__(self, key: str, keys: list[str]):
    super().__init__(key)
    self.key, self.keys = key, keys


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """``dict(pairs)``; a key given twice raises ``_DuplicateKey`` (``json.loads`` keeps the last
  silently)."""
  out: dict[str, Any] = {}
  for key, value in pairs:
    if key in out:
      raise _DuplicateKey(key, [k for k, _ in pairs])
    out[key] = value
  return out


def parse_json(text: str, source: str, error: type[Exception]) -> Any:
  """``json.loads(text)``; an empty text, bad syntax or a key given twice in one object raises
  ``error`` naming ``source`` (and the position, or the key)."""
  if not text.strip():
    raise error(f"{source} is empty. Fix: pass the file the command that writes it wrote, or write it anew.")
  try:
    return json.loads(text, object_pairs_hook=_unique_keys)
  except json.JSONDecodeError as e:
    raise error(
      f"{source} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). "
      "Fix: correct the JSON syntax there."
    ) from None
  except _DuplicateKey as e:
    raise error(
      f"{source} gives key {e.key!r} twice in one object (its keys: {e.keys}); JSON readers keep one of "
      "the two silently. Fix: keep the one you mean and delete the other."
    ) from None


def read_text(path: str, what: str, error: type[Exception]) -> str:
  """The text of ``path`` (UTF-8, as JSON is); an unreadable file raises ``error`` naming it as
  ``what``."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise error(
      f"{what} {str(path)!r} cannot be read ({e.strerror}). Fix: pass the path of a {what} file."
    ) from None
  except UnicodeDecodeError as e:
    raise error(
      f"{what} {str(path)!r} is not UTF-8 text (byte {e.start} is {e.object[e.start : e.start + 1]!r}). "
      f"Fix: pass the {what} file itself, saved as UTF-8."
    ) from None


@dataclasses.dataclass(frozen=True)
class JsonLine:
  """One line of a JSON-lines file: its number (from 1), its bytes as written (with the newline,
  if it has one) and its value (``None`` when the line is not UTF-8 JSON)."""

  number: int
  raw: bytes
  value: Any

  @property
  def complete(self) -> bool:
    """False for a last line without its newline (a write cut short)."""
    return self.raw.endswith(b"\n")


def read_json_lines(path: str) -> tuple[list[JsonLine], list[int]]:
  """``(lines, undecodable)``: every line of the JSON-lines file ``path`` (``JsonLine``) and the
  numbers of those that are not UTF-8 text (a disk error, or bytes written into the file by
  something else). Such a line stays in ``lines`` with value ``None``, as does a line of text that
  is not JSON (a line a kill cut short): a reader skips them, a rewrite keeps their bytes."""
  with open(path, "rb") as f:
    parts = f.read().split(b"\n")
  raws = [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
  lines, undecodable = [], []
  for number, raw in enumerate(raws, 1):
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError:
      undecodable.append(number)
      lines.append(JsonLine(number, raw, None))
      continue
    try:
      value = json.loads(text)
    except json.JSONDecodeError:
      value = None
    lines.append(JsonLine(number, raw, value))
  return lines, undecodable


def undecodable_warning(path: str, numbers: list[int], action: str) -> str:
  """One line naming the lines ``numbers`` of ``path`` that are not UTF-8 and what was done with
  them (``action``, e.g. "skipped")."""
  shown = ", ".join(map(str, numbers[:5])) + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")
  return (
    f"{path}: line(s) {shown} are not UTF-8 text (a disk error, or bytes another program wrote); {action}. "
    "Fix: nothing needed; delete those lines to silence this."
  )


def _new_temporary(directory: str, base: str, suffix: str) -> tuple[int, str]:
  """An open descriptor of a new file ``directory/.base.RANDOM{suffix}`` and its path, created as
  ``open(path, "w")`` creates a file (mode ``0o666`` less the umask and what the directory's
  default ACL removes) but with ``O_EXCL``: never an existing file."""
  while True:
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(4)}{suffix}")
    try:
      return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
    except FileExistsError:
      continue


def write_atomic(
  path: str | os.PathLike,
  write: Callable[[str], None],
  what: str,
  error: type[Exception],
  suffix: str = ".tmp",
) -> None:
  """Calls ``write(tmp)`` on a temporary file (ending in ``suffix``) in ``path``'s directory,
  flushes it to disk and renames it over ``path``: ``path`` holds either its old content or all
  of the new, never part of it, with the permissions ``open(path, "w")`` would give it (an
  existing file keeps its mode; a new one gets ``0o666`` less the umask). A failure (no such
  directory, no space, a read-only file system, ``path`` a directory or a device) raises
  ``error`` naming ``path`` as ``what``, with ``path`` untouched."""
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
    fd, tmp = _new_temporary(directory, os.path.basename(path), suffix)
    os.close(fd)
    write(tmp)
    if mode is not None:
      os.chmod(tmp, stat.S_IMODE(mode))
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
    with open(tmp, "w", encoding="utf-8") as f:
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
