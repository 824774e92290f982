"""Output paths, checked before any work starts: a command that would fail to write its result
fails first, with one error naming the path, what is wrong with it and the fix.

Three kinds of output:

* ``file`` — a file the command writes (an existing file is replaced): not a directory, in an
  existing, writable directory;
* ``dir`` — a directory the command fills: new (missing parents are created) or empty;
* ``run`` — the run directory of ``qsync train``: new or empty for a new run; one holding
  checkpoints to continue with ``resume``; and used by no other run.

A run holds its directory (``lock_run_dir``): ``fcntl.flock`` on ``DIR/.qsync.lock``, which names
the holder's pid and host. A second run into the same directory is refused at once, naming that
process; the lock goes with the run (``RunLock.release``, or the process's end); a lock file left by
a process that ended without releasing it is taken over, with a note.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile

from qsync_jax.errors import OutputPathError

LOCK_NAME = ".qsync.lock"
"""The lock file of a run directory (``lock_run_dir``), not part of the run's outputs."""

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


def checkpoint_steps(run_dir: str) -> list[int]:
  """The steps of the finished checkpoints in ``run_dir/checkpoints`` (directories named by their
  step), sorted."""
  directory = os.path.join(run_dir, "checkpoints")
  return (
    sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []
  )


def has_checkpoints(run_dir: str) -> bool:
  """True when ``run_dir/checkpoints`` holds a finished checkpoint (a directory named by its step)."""
  return bool(checkpoint_steps(run_dir))


def check_run_dir(flag: str, path: str, resume: bool, api: bool = False, holder: bool = True) -> None:
  """``path`` can hold a training run: no other run holds it, and it is a new or empty directory,
  or (``resume``) one with checkpoints. ``api``: the fixes name ``Trainer``'s arguments, not the
  command line's. ``holder=False``: a process of a multi-process job other than process 0, which
  holds the directory for all of them (its lock is not checked)."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputPathError(f"{flag} {path!r} is a file, not a run directory. Fix: choose a new directory.")
  if holder:
    _check_not_held(flag, path)
  if resume:
    if not has_checkpoints(path):
      asked, drop = ("resume=True", "pass resume=False") if api else ("--resume", "drop --resume")
      raise OutputPathError(
        f"{asked}: {flag} {path!r} holds no checkpoint to resume from. Fix: {drop} to start a new run, or "
        "point it at the directory of the run to continue."
      )
  elif has_checkpoints(path):
    fix = (
      "pass resume=True (the Trainer then continues that run from its latest checkpoint, as Trainer.resume() "
      "does)"
      if api
      else "pass --resume to continue that run"
    )
    raise OutputPathError(f"{flag} {path!r} already holds checkpoints. Fix: {fix}, or choose a new {flag}.")
  elif os.path.isdir(path) and set(os.listdir(path)) - {LOCK_NAME}:
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
      holder = getattr(args, "process_id", 0) == 0  # process 0 holds a multi-process job's run directory
      check_run_dir(flag, path, bool(getattr(args, "resume", False)), holder=holder)
    else:
      raise ValueError(f"output kind {kind!r} is not one of {KINDS}")


def _holder(lock_path: str) -> str:
  """What the lock file says of its holder: ``process PID on HOST`` (or that it says nothing)."""
  try:
    with open(lock_path) as f:
      pid, _, host = f.read().strip().partition(" ")
  except OSError:
    return "another process"
  return f"process {pid} on {host}" if pid.isdigit() else "another process"


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


def _check_not_held(flag: str, path: str) -> None:
  """Raises when a live process holds ``path``'s run lock (this process may hold it)."""
  lock_path = os.path.join(path, LOCK_NAME)
  if os.path.realpath(lock_path) in _HELD or not os.path.exists(lock_path):
    return
  try:
    fd = os.open(lock_path, os.O_RDONLY)
  except OSError:
    return
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    raise OutputPathError(
      f"{flag} {path!r} is in use by another training run ({_holder(lock_path)}). Fix: wait for that run to "
      f"end (or stop it), or choose another {flag}."
    ) from None
  finally:
    os.close(fd)


class RunLock:
  """This process's hold on a run directory (``lock_run_dir``); ``note``: what was said on taking
  it (a lock left by a process that ended), else None. ``created``: the directory was made for
  it (removed again on release when nothing else was written there)."""

  def __init__(self, path: str, fd: int, note: str | None, created: bool):
    self.path, self._fd, self.note, self.created, self._count = path, fd, note, created, 1

  def release(self) -> None:
    """Gives the directory up once every ``lock_run_dir`` of this process released it."""
    self._count -= 1
    if self._count > 0 or self._fd is None:
      return
    _HELD.pop(self.path, None)
    try:
      os.remove(self.path)
      if self.created and not os.listdir(os.path.dirname(self.path)):
        os.rmdir(os.path.dirname(self.path))
    except OSError:
      pass
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None


_HELD: dict[str, RunLock] = {}  # realpath of a lock file -> this process's hold on it


def lock_run_dir(flag: str, path: str) -> RunLock:
  """Holds run directory ``path`` (created if missing) for this process until ``release``:
  ``OutputPathError`` naming the holder when another live process holds it. Re-entrant: a process
  that holds it gets its hold again (released after as many ``release`` calls)."""
  created = not os.path.isdir(path)
  os.makedirs(path, exist_ok=True)
  lock_path = os.path.realpath(os.path.join(path, LOCK_NAME))
  held = _HELD.get(lock_path)
  if held is not None:
    held._count += 1
    return held
  for _ in range(3):  # a holder may remove the file between our open and our lock: open again
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise OutputPathError(
        f"{flag} {path!r} is in use by another training run ({_holder(lock_path)}). Fix: wait for that run "
        f"to end (or stop it), or choose another {flag}."
      ) from None
    if os.path.exists(lock_path) and os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
      break
    os.close(fd)
  else:
    raise OutputPathError(f"{flag} {path!r}: its lock file keeps changing. Fix: choose another {flag}.")
  previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
  note = None
  if previous:
    note = (
      f"{flag} {path!r}: took over the lock left by {_holder(lock_path)}, which ended without releasing it"
    )
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
  lock = RunLock(lock_path, fd, note, created)
  _HELD[lock_path] = lock
  return lock
