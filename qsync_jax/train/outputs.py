"""Output paths, checked before any work starts: a command that would fail to write its result
fails first, with one error naming the path, what is wrong with it and the fix.

Three kinds of output:

* ``file`` — a file the command writes (an existing file is replaced): not a directory, in an
  existing, writable directory;
* ``dir`` — a directory the command fills: new (missing parents are created) or empty;
* ``run`` — the run directory of ``qsync train``: new or empty for a new run; one holding
  checkpoints to continue with ``resume``.

``TensorBoardWriter`` writes a run's metrics as TensorBoard events (optional: needs
``tensorboardX``, ``pip install "qsync-jax[tensorboard]"``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

from qsync_jax.errors import OutputPathError

KINDS = ("file", "dir", "run")


def _writable(directory: str) -> bool:
  """True when a file can be created in ``directory`` (tried: permission bits say nothing to root
  or on a read-only file system)."""
  try:
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".qsync-write-test-")
  except OSError:
    return False
  os.close(fd)
  os.remove(probe)
  return True


def _writable_ancestor(flag: str, path: str) -> None:
  """The nearest existing ancestor of ``path`` must be a writable directory (the command creates
  the missing ones)."""
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise OutputPathError(
      f"{flag} {path!r}: {parent!r} is a file, so no directory can be created under it. "
      "Fix: choose a path under a directory."
    )
  if not _writable(parent):
    raise OutputPathError(
      f"{flag} {path!r}: directory {parent!r} is not writable. Fix: choose a writable path."
    )


def _dir_writable(flag: str, path: str) -> None:
  """The directory ``path`` exists and is writable, or can be created."""
  _writable_ancestor(flag, path)
  if os.path.isdir(path) and not _writable(path):
    raise OutputPathError(f"{flag} {path!r} is not writable. Fix: choose a writable directory.")


def check_file(flag: str, path: str) -> None:
  """``path`` can be written as a file (replacing an existing file)."""
  if os.path.isdir(path):
    raise OutputPathError(
      f"{flag} {path!r} is a directory, not a file. Fix: name a file, e.g. {path}/out.json."
    )
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise OutputPathError(
      f"{flag} {path!r}: directory {os.path.dirname(path) or '.'!r} does not exist. "
      "Fix: create it, or choose another path."
    )
  if not _writable(parent) or (os.path.exists(path) and not os.access(path, os.W_OK)):
    raise OutputPathError(f"{flag} {path!r} is not writable. Fix: choose a writable path.")


def check_dir(flag: str, path: str) -> None:
  """``path`` is a new or empty directory (or can be created)."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputPathError(f"{flag} {path!r} is a file, not a directory. Fix: choose a new directory.")
  if os.path.isdir(path) and os.listdir(path):
    raise OutputPathError(
      f"{flag} {path!r} is a directory that is not empty; the command would overwrite what is there. "
      "Fix: choose a new directory, or empty that one."
    )
  _dir_writable(flag, path)


def has_checkpoints(run_dir: str) -> bool:
  """True when ``run_dir/checkpoints`` holds a finished checkpoint (a directory named by its step)."""
  directory = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def check_run_dir(flag: str, path: str, resume: bool) -> None:
  """``path`` can hold a training run: a new or empty directory, or (``resume``) one with checkpoints."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputPathError(f"{flag} {path!r} is a file, not a run directory. Fix: choose a new directory.")
  if resume:
    if not has_checkpoints(path):
      raise OutputPathError(
        f"--resume: {flag} {path!r} holds no checkpoint to resume from. Fix: drop --resume to start a new "
        "run, or point it at the directory of the run to continue."
      )
  elif has_checkpoints(path):
    raise OutputPathError(
      f"{flag} {path!r} already holds checkpoints. Fix: pass --resume to continue that run, or choose a new "
      f"{flag}."
    )
  elif os.path.isdir(path) and os.listdir(path):
    raise OutputPathError(
      f"{flag} {path!r} is a directory that is not empty and holds no run to resume. Fix: choose a new "
      "directory, or empty that one."
    )
  _dir_writable(flag, path)


def check_outputs(args, outputs: dict[str, str]) -> None:
  """Checks every output option of parsed ``args``: ``outputs`` maps an option's ``dest`` (e.g.
  ``"out"``) to its kind (``KINDS``); options left unset are skipped."""
  for dest, kind in outputs.items():
    path = getattr(args, dest, None)
    if path is None:
      continue
    flag = "--" + dest.replace("_", "-")
    if kind == "file":
      check_file(flag, path)
    elif kind == "dir":
      check_dir(flag, path)
    elif kind == "run":
      check_run_dir(flag, path, bool(getattr(args, "resume", False)))
    else:
      raise ValueError(f"output kind {kind!r} is not one of {KINDS}")


def check_write_target(flag: str, path: str, kind: str) -> None:
  """What a write would fail on only after the work, refused before it (a complement of the
  checks above): a symbolic link that leads nowhere (a loop, or a missing target: outputs are
  replaced by a rename, never written through a link), and for a ``file`` output a path ending in
  a separator (a directory's name) or an existing file that is not a regular one (a device such
  as ``/dev/full``)."""
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


def _scalars(record: Mapping, prefix: str = ""):
  """``(tag, value)`` for every number of ``record`` (bools as 0/1; nested mappings as
  ``outer/inner`` tags; strings, lists and ``None`` skipped)."""
  for key, value in record.items():
    tag = f"{prefix}{key}"
    if isinstance(value, Mapping):
      yield from _scalars(value, tag + "/")
    elif isinstance(value, (bool, int, float)):
      yield tag, float(value)


class TensorBoardWriter:
  """TensorBoard events in ``directory``: ``write(step, record)`` adds every number of ``record``
  (``_scalars``; its ``step`` key is the x-axis, not a scalar) at ``step`` and flushes, so a
  killed run keeps what it logged.

  Optional: the ``tensorboardX`` package is imported at the first write; without it nothing is
  written (no directory, no error). The event file opens at the first write with
  ``purge_step`` = that step, so a resumed run hides the events an earlier run logged from
  that step on (as ``metrics.jsonl`` drops them). ``close`` is idempotent.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self._writer = None
    self._unavailable = False

  @property
  def enabled(self) -> bool:
    """False once the first write found no ``tensorboardX``."""
    return not self._unavailable

  def write(self, step: int, record: Mapping, prefix: str = "") -> None:
    if self._unavailable:
      return
    if self._writer is None:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        self._unavailable = True
        return
      self._writer = SummaryWriter(self.directory, purge_step=int(step))
    for tag, value in _scalars({k: v for k, v in record.items() if k != "step"}, prefix):
      self._writer.add_scalar(tag, value, int(step))
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
