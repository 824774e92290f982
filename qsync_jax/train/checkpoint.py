"""Checkpoints of a training run (orbax-checkpoint), checked before anything is restored.

Checkpoint ``STEP`` of a run is the directory ``OUT/checkpoints/STEP`` with three items::

  params/   the model's parameters (the trainer's ``params``) as the model's own pytree: linen
            module names ({"Dense_0": {"kernel": ...}}), or the nnx graph's (list items "0", "1"…)
  state/    the whole training state, for resume, as a tree of named fields: the hybrid
            trainer's {"step", "params", "opt_state", "model_state", "rng", "loss_scale",
            "sync_state"}, optax states by field ({"count", "mu", "nu"}); a step-builder
            strategy's {"strategy": {...}, "rng"}. The hybrid trainer's optimizer state is stored
            whole (``TrainStep.full_state``) whatever the plan's ``optimizer_update``: a sharded
            update's shards are gathered on save and cut again on restore, so a run resumes from
            a checkpoint of either kind
  meta/     JSON: the plan, its fingerprint, the cluster, the task, seed and data position, and
            a signature (path, shape, dtype) and checksum of every leaf

Arrays replicated over the devices are written host-local (as numpy arrays), so ``params/`` —
and all of ``state/`` but per-device arrays (a sync strategy's per-device state, SelSync's and
QSDP's working copies, which keep their sharding) — restore with a plain orbax call, in any
process, on any devices, without qsync::

  import orbax.checkpoint as ocp
  params = ocp.StandardCheckpointer().restore("OUT/checkpoints/200/params")

``restore`` checks, before touching any array: that the checkpoint is readable and of this
format, that its params have the model's paths and shapes, that its plan and cluster are the
run's, and that the rest of the state (optimizer) matches; after reading the arrays it verifies
their checksums. Any mismatch raises ``CheckpointError`` naming the difference and the fix; the
checkpoint directory and the caller's state are left untouched.

A save that cannot be written (a full disk, a file-size limit, a read-only directory) raises
``CheckpointWriteError`` with the system's reason, after removing what it had written of that step:
the earlier checkpoints stay as they were, and the next save starts afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from qsync_jax.errors import CheckpointError

FORMAT = 2
"""Version of the layout above (format 1 stored the state as numbered leaves "0000"…)."""

FIX_CORRUPTED = (
  "Fix: delete that step's directory to resume from an earlier checkpoint, or start fresh in a new --out."
)


class CheckpointWriteError(CheckpointError):
  """A checkpoint could not be written; ``step`` and ``reason`` (the system's, e.g. "No space left
  on device")."""

  def __init__(self, step: int, directory: str, reason: str):
    super().__init__(f"checkpoint {step} could not be written in {directory}: {reason}")
    self.step, self.reason = step, reason


# tensorstore (orbax's writer) reports a failed write as a ValueError carrying the errno.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def write_failure_reason(e: BaseException) -> str | None:
  """The system's reason when ``e`` is a failed write (an ``OSError``, or tensorstore's error
  carrying one); None for any other error."""
  if isinstance(e, OSError):
    return (e.strerror or os.strerror(e.errno)) if e.errno else str(e)
  match = _OS_ERROR_CODE.search(str(e))
  if match:
    code = int(match.group(1))
    return os.strerror(code) if code in errno.errorcode else f"error {code}"
  return None


@contextlib.contextmanager
def _orbax_logs_held():
  """Holds back what orbax logs (through absl's logger) within, and logs it at the end, unless the
  caller cleared the list it gets."""
  held: list[logging.LogRecord] = []
  logger = logging.getLogger("absl")

  def hold(record: logging.LogRecord) -> bool:
    held.append(record)
    return False

  logger.addFilter(hold)
  try:
    yield held
  finally:
    logger.removeFilter(hold)
    for record in held:
      logger.handle(record)


def signature(tree) -> list[list[str]]:
  """``[path, shape, dtype]`` of every leaf, in flattening order."""
  return [
    [jax.tree_util.keystr(p), str(tuple(np.shape(x))), str(x.dtype)]
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def fingerprint(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _checksum(x) -> str | None:
  """sha256 of a leaf's bytes; None for arrays this process cannot see whole (multi-process)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.is_fully_replicated:
      return None
    x = x.addressable_data(0)
  return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()[:16]


def _host_local(x):
  """A replicated array as a numpy array (restorable anywhere); a sharded one as it is."""
  if isinstance(x, jax.Array) and x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return x


def as_saved(tree) -> dict:
  """``tree`` as a checkpoint item stores it: named fields (``flax.serialization.to_state_dict``:
  NamedTuple fields by name, tuple items and int keys as "0", "1"…), replicated arrays host-local."""
  return jax.tree.map(_host_local, serialization.to_state_dict(tree))


def _manager_options(max_to_keep: int) -> ocp.CheckpointManagerOptions:
  options = dict(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
  # Steps are kept by number: the manager needs no step metadata (times, metrics). Not reading
  # it also keeps orbax from logging errors about that file in the step directories a killed
  # run leaves (one being deleted, one whose metadata write was cut short).
  if "lightweight_initialize" in {f.name for f in dataclasses.fields(ocp.CheckpointManagerOptions)}:
    options["lightweight_initialize"] = True
  return ocp.CheckpointManagerOptions(**options)


class CheckpointStore:
  """The checkpoints of one run in ``directory`` (keeps the newest ``max_to_keep``)."""

  def __init__(self, directory: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self._max_to_keep = max_to_keep
    self._manager = None

  @property
  def manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      self._manager = ocp.CheckpointManager(self.directory, options=_manager_options(self._max_to_keep))
    return self._manager

  def latest_step(self) -> int | None:
    if not os.path.isdir(self.directory):
      return None
    return self.manager.latest_step()

  def save(self, step: int, state, params, meta: Mapping[str, Any]) -> None:
    """Saves ``state`` (the whole training state), ``params`` (the model's parameters) and
    ``meta`` (JSON) as checkpoint ``step`` (atomically: a kill mid-save leaves no checkpoint
    ``step``)."""
    state, params = as_saved(state), as_saved(params)
    meta = dict(
      meta,
      format=FORMAT,
      state=signature(state),
      checksums={
        "state": [_checksum(x) for x in jax.tree.leaves(state)],
        "params": [_checksum(x) for x in jax.tree.leaves(params)],
      },
    )
    with _orbax_logs_held() as held:
      try:
        self.manager.save(
          step,
          args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave(meta),
          ),
          force=True,
        )
        self.manager.wait_until_finished()
      except Exception as e:
        reason = write_failure_reason(e)
        if reason is None:
          raise
        held.clear()  # orbax's tracebacks of the failed write: the error below says it in one line
        self._discard(step)
        raise CheckpointWriteError(step, self.directory, reason) from None

  def _discard(self, step: int) -> None:
    """Removes what a failed save of ``step`` wrote (its temporary directory) and starts a new
    manager, so that the next save begins afresh."""
    try:
      self.close()
    except Exception:  # noqa: BLE001 - a manager whose save failed may fail to close too
      self._manager = None
    if os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if name.startswith(f"{step}.orbax-checkpoint-tmp"):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
      self._manager = None

  def _step(self, step: int | None) -> int:
    """``step``, or the latest step for None; ``CheckpointError`` when there is no such checkpoint
    (naming the steps there are)."""
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(
          f"no checkpoint in {self.directory}. Fix: start without --resume, or point --out at the run's directory."
        )
      return step
    saved = sorted(self.manager.all_steps(read=True)) if os.path.isdir(self.directory) else []  # another run may have saved
    if step not in saved:
      there = f"its checkpoints are of steps {saved}" if saved else "it holds no checkpoint"
      fix = (
        f"pass one of those steps, or none for the latest ({saved[-1]})"
        if saved
        else "pass the directory of a run that checkpointed"
      )
      raise CheckpointError(
        f"there is no checkpoint of step {step} in {self.directory}: {there}. Fix: {fix}."
      )
    return step

  def read_meta(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """``(step, meta)`` of checkpoint ``step`` (default: latest), checked to be of this format."""
    step = self._step(step)
    where = f"checkpoint {step} in {self.directory}"
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # orbax raises many types for unreadable files
      raise CheckpointError(f"{where} is corrupted: its metadata cannot be read. {FIX_CORRUPTED}") from None
    if isinstance(meta, Mapping) and meta.get("format") == 1:
      raise CheckpointError(
        f"{where} was written by an older qsync-jax (checkpoint format 1, its state stored as numbered "
        f"leaves), which this version (format {FORMAT}) cannot read. Fix: start a new run in a new --out, "
        "or resume or export that run with the qsync-jax version that wrote it."
      )
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
      raise CheckpointError(
        f"{where} is corrupted or from another version: its metadata has no format {FORMAT}. "
        "Fix: delete that step's directory, or start fresh in a new --out."
      )
    return step, dict(meta)

  def _read(self, step: int, item: str, abstract, checksums: list) -> dict:
    """Item ``item`` of checkpoint ``step`` (``abstract``: its target, or None for a plain
    restore), checked against ``checksums``."""
    where = f"checkpoint {step} in {self.directory}"
    restore = ocp.args.StandardRestore(abstract) if abstract is not None else ocp.args.StandardRestore()
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**{item: restore}))[item]
    except Exception:
      raise CheckpointError(
        f"{where} is corrupted: its {item} arrays cannot be read. {FIX_CORRUPTED}"
      ) from None
    leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    if len(leaves) != len(checksums):
      raise CheckpointError(f"{where} is corrupted: its {item} item has missing arrays. {FIX_CORRUPTED}")
    for (path, x), want in zip(leaves, checksums):
      got = _checksum(x)
      if want is not None and got is not None and got != want:
        raise CheckpointError(
          f"{where} is corrupted: {item}{jax.tree_util.keystr(path)} does not match its checksum. {FIX_CORRUPTED}"
        )
    return restored

  def restore(self, like, expected: Mapping[str, Any], step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The state (shaped and sharded like ``like``) and meta of checkpoint ``step`` (default: latest).

    ``expected`` maps meta keys (e.g. ``"params"``, ``"plan_fingerprint"``, ``"cluster"``)
    to the values this run needs; a mismatch raises ``CheckpointError``.
    """
    step, meta = self.read_meta(step)
    where = f"checkpoint {step} in {self.directory}"
    check_meta(where, meta, expected)
    target = serialization.to_state_dict(like)
    if meta.get("state") != signature(target):
      raise CheckpointError(
        f"{where} holds a different training state (optimizer or sync strategy) than this run: "
        f"{_first_difference(meta.get('state', []), signature(target))}. "
        "Fix: resume with the optimizer and --sync the run used, or start fresh in a new --out."
      )
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), target
    )
    restored = self._read(step, "state", abstract, meta["checksums"]["state"])
    return serialization.from_state_dict(like, restored), meta

  def read_params(self, step: int | None = None) -> tuple[dict, dict[str, Any]]:
    """``(params, meta)`` of checkpoint ``step`` (default: latest): the model's parameters as the
    checkpoint stores them (a plain restore, checked against their checksums)."""
    step, meta = self.read_meta(step)
    return self._read(step, "params", None, meta["checksums"]["params"]), meta


_WHAT = {
  "task": ("a different task", "--model"),
  "params": ("a different model (parameter paths/shapes differ)", "--model"),
  "plan_fingerprint": ("a different plan", "--plan"),
  "cluster": ("a different cluster (groups, device counts or per-device batches differ)", "--cluster"),
  "seed": ("a different seed", "--seed"),
  "sync": ("a different sync strategy or options", "--sync and --sync-option"),
}


def check_meta(where: str, meta: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
  """``CheckpointError`` naming the first key of ``expected`` whose value ``meta`` (of the
  checkpoint ``where``) does not have, and the flag that fixes it."""
  for key, want in expected.items():
    got = meta.get(key)
    if got == want:
      continue
    what, flag = _WHAT.get(key, (f"a different {key}", key))
    detail = _first_difference(got, want) if isinstance(want, list) else f"it has {got!r}, this run {want!r}"
    raise CheckpointError(
      f"{where} was written by {what}: {detail}. "
      f"Fix: resume with the {flag} the run used, or start fresh in a new --out directory."
    )


def _first_difference(got, want) -> str:
  got, want = list(got or []), list(want or [])
  for a, b in zip(got, want):
    if a != b:
      return f"checkpoint has {a}, this run has {b}"
  if len(got) != len(want):
    return f"checkpoint has {len(got)} entries, this run {len(want)}"
  return "no difference found"
