"""Checkpoints of a training run (orbax-checkpoint), checked before anything is restored.

A checkpoint holds every leaf of the ``TrainState`` (params, optimizer state, model state,
step, RNG key, loss-scale state, per-device sync state) and a JSON ``meta`` item: the data
position, the plan, the cluster, a signature (path, shape, dtype) of every state leaf and a
checksum of every leaf. Leaves are saved under their index in the flattened state, so any
pytree (optax's empty states, named tuples) round-trips exactly.

``restore`` checks, before touching any array: that the checkpoint is readable, that its
params have the model's paths and shapes, that its plan and cluster are the run's, and that
the rest of the state (optimizer) matches; after reading the arrays it verifies their
checksums. Any mismatch raises ``CheckpointError`` naming the difference and the fix; the
checkpoint directory and the caller's state are left untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from qsync_jax.errors import CheckpointError

FORMAT = 1


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


def _leaves(state) -> dict[str, Any]:
  return {f"{i:04d}": x for i, x in enumerate(jax.tree.leaves(state))}


class CheckpointStore:
  """The checkpoints of one run in ``directory`` (keeps the newest ``max_to_keep``)."""

  def __init__(self, directory: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self._max_to_keep = max_to_keep
    self._manager = None

  @property
  def manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      options = ocp.CheckpointManagerOptions(
        max_to_keep=self._max_to_keep, create=True, enable_async_checkpointing=False
      )
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    return self._manager

  def latest_step(self) -> int | None:
    if not os.path.isdir(self.directory):
      return None
    return self.manager.latest_step()

  def save(self, step: int, state, meta: Mapping[str, Any]) -> None:
    """Saves ``state`` and ``meta`` (JSON) as checkpoint ``step`` (atomically: a kill mid-save
    leaves no checkpoint ``step``)."""
    meta = dict(
      meta, format=FORMAT, state=signature(state), checksums=[_checksum(x) for x in jax.tree.leaves(state)]
    )
    self.manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(_leaves(state)), meta=ocp.args.JsonSave(meta)),
      force=True,
    )
    self.manager.wait_until_finished()

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
      self._manager = None

  def restore(self, like, expected: Mapping[str, Any], step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The state (shaped and sharded like ``like``) and meta of checkpoint ``step`` (default: latest).

    ``expected`` maps meta keys (e.g. ``"params"``, ``"plan_fingerprint"``, ``"cluster"``)
    to the values this run needs; a mismatch raises ``CheckpointError``.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(
        f"no checkpoint in {self.directory}. Fix: start without --resume, or point --out at the run's directory."
      )
    where = f"checkpoint {step} in {self.directory}"
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many types for unreadable files
      raise CheckpointError(
        f"{where} is corrupted: its metadata cannot be read ({type(e).__name__}: {_short(e)}). "
        "Fix: delete that step's directory to resume from an earlier checkpoint, or start fresh in a new --out."
      ) from None
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
      raise CheckpointError(
        f"{where} is corrupted or from another version: its metadata has no format {FORMAT}. "
        "Fix: delete that step's directory, or start fresh in a new --out."
      )
    _check(where, meta, expected)
    if meta.get("state") != signature(like):
      raise CheckpointError(
        f"{where} holds a different training state (optimizer or sync strategy) than this run: "
        f"{_first_difference(meta.get('state', []), signature(like))}. "
        "Fix: resume with the optimizer and --sync the run used, or start fresh in a new --out."
      )
    abstract = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in _leaves(like).items()
    }
    try:
      restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      )["state"]
    except Exception as e:
      raise CheckpointError(
        f"{where} is corrupted: its arrays cannot be read ({type(e).__name__}: {_short(e)}). "
        "Fix: delete that step's directory to resume from an earlier checkpoint, or start fresh in a new --out."
      ) from None
    leaves = [restored[k] for k in sorted(restored)]
    for i, (x, want) in enumerate(zip(leaves, meta.get("checksums", []))):
      got = _checksum(x)
      if want is not None and got is not None and got != want:
        raise CheckpointError(
          f"{where} is corrupted: leaf {meta['state'][i][0]} does not match its checksum. "
          "Fix: delete that step's directory to resume from an earlier checkpoint, or start fresh in a new --out."
        )
    return jax.tree.unflatten(jax.tree.structure(like), leaves), dict(meta)


_WHAT = {
  "task": ("a different task", "--model"),
  "params": ("a different model (parameter paths/shapes differ)", "--model"),
  "plan_fingerprint": ("a different plan", "--plan"),
  "cluster": ("a different cluster (groups, device counts or per-device batches differ)", "--cluster"),
  "seed": ("a different seed", "--seed"),
  "sync": ("a different sync strategy or options", "--sync and --sync-option"),
}


def _check(where: str, meta: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
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


def _short(e: Exception, limit: int = 200) -> str:
  text = " ".join(str(e).split())
  return text if len(text) <= limit else text[:limit] + "…"
