"""One re-planning decision, a pure function over measurements: ``decide(measured, running,
undone) -> Decision``.

From each group's measured ``{batch: ms}`` (of its running policy, and of its lifted policy for
the groups in ``lifted``), ``decide`` balances the running split's global batch
(``group_speed.balance``) and re-plans when the balanced split — with the lifted policies — is
predicted at least ``threshold`` faster than the running split with the running policies, unless
it is the split of an undone re-plan (``Undone``) under speeds that have not moved by more than
``threshold`` since (such a block is dropped once they have).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from qsync_jax.cluster import ClusterSpec
from qsync_jax.train.replan.group_speed import GroupSpeed, balance, predicted_ms
from qsync_jax.train.replan.lift import Lift


@dataclasses.dataclass(frozen=True)
class Running:
  """The running split: each group's device ``counts`` and per-device ``batches``."""

  counts: dict[str, int]
  batches: dict[str, int]

  @classmethod
  def of(cls, cluster: ClusterSpec) -> Running:
    return cls(
      {g.name: g.count for g in cluster.groups}, {g.name: g.batch_per_device for g in cluster.groups}
    )

  @property
  def global_batch(self) -> int:
    return sum(self.counts[g] * b for g, b in self.batches.items())


@dataclasses.dataclass(frozen=True)
class Undone:
  """An undone re-plan (at ``step``) to ``split`` with the ``lifted`` policies (``{group: policy
  JSON text}``), and the groups' ``speeds`` from its measurements: what blocks it."""

  step: int
  split: dict[str, int]
  lifted: dict[str, str]
  speeds: dict[str, GroupSpeed]

  @classmethod
  def of_record(cls, record: Mapping) -> Undone:
    """What blocks the re-plan of a decision ``record``: its step, split, lifted policies and the
    groups' speeds from its measurements (of the lifted policies, for lifted groups)."""
    points = {
      **record["measured_ms"],
      **{g: lift["measured_ms"] for g, lift in record.get("lifted", {}).items()},
    }
    speeds = {g: GroupSpeed.fit({int(b): ms for b, ms in p.items()}) for g, p in points.items()}
    return cls(record["step"], dict(record["new"]), lift_key(record), speeds)


@dataclasses.dataclass(frozen=True)
class Decision:
  """``batches``: the new per-device batches, None when the running split stays. ``record``:
  what was measured and predicted (``ms_per_example`` and ``measured_ms`` of the running
  policies, the ``old`` and ``new`` (balanced) split, ``predicted_ms_old`` / ``_new``, and
  ``lifted``: each lifted group's old and new policy and its measurements). ``blocked_by``: the
  step of the undone re-plan whose split the balanced one is (None if none); ``undone``: the
  blocks that remain."""

  batches: dict[str, int] | None
  record: dict
  blocked_by: int | None
  undone: tuple[Undone, ...]


def decide(
  measured: Mapping[str, Mapping[int, float]],
  running: Running,
  undone: Sequence[Undone] = (),
  *,
  lifted: Mapping[str, Lift] | None = None,
  threshold: float = 0.05,
  granularity: int = 1,
) -> Decision:
  """The decision from the measurements (see the module docstring)."""
  lifted = dict(lifted or {})
  speeds = {g: GroupSpeed.fit(measured[g]) for g in running.batches}
  new_speeds = {**speeds, **{g: GroupSpeed.fit(lift.measured) for g, lift in lifted.items()}}
  balanced = balance(running.counts, new_speeds, running.global_batch, granularity)
  before, after = predicted_ms(speeds, running.batches), predicted_ms(new_speeds, balanced)
  record = {
    "ms_per_example": {g: round(s.slope_ms, 4) for g, s in speeds.items()},  # the running policies
    "measured_ms": {g: rounded(measured[g]) for g in running.batches},
    "old": dict(running.batches),
    "new": balanced,
    "predicted_ms_old": round(before, 3),
    "predicted_ms_new": round(after, 3),
  }
  if lifted:
    record["lifted"] = {
      g: {"old": lift.running.to_json(), "new": lift.lifted.to_json(), "measured_ms": rounded(lift.measured)}
      for g, lift in sorted(lifted.items())
    }
  blocked_by, remaining = _blocking(undone, balanced, lift_key(record), new_speeds, threshold)
  keep = (balanced == running.batches and not lifted) or after > before * (1 - threshold)
  return Decision(None if keep or blocked_by is not None else balanced, record, blocked_by, remaining)


def _blocking(
  undone: Sequence[Undone],
  split: Mapping[str, int],
  lifted: Mapping[str, str],
  speeds: Mapping[str, GroupSpeed],
  threshold: float,
) -> tuple[int | None, tuple[Undone, ...]]:
  """``(step of the undone re-plan to split with the lifted policies, the blocks that remain)``:
  the first undone re-plan of that split blocks it while no group's time at its batch of
  ``split`` moved by more than ``threshold`` between that re-plan's measurements and ``speeds``;
  one whose speeds moved is dropped (None: nothing blocks)."""
  for i, entry in enumerate(undone):
    if entry.split != dict(split) or entry.lifted != dict(lifted):
      continue
    then = entry.speeds
    moved = any(abs(speeds[g].ms(b) - then[g].ms(b)) > threshold * then[g].ms(b) for g, b in split.items())
    if moved:
      return None, tuple(undone[:i]) + tuple(undone[i + 1 :])
    return entry.step, tuple(undone)
  return None, tuple(undone)


def rounded(points: Mapping[int, float]) -> dict[str, float]:
  """``{batch: ms}`` as a record holds it: ``{"<batch>": ms to 1 µs}``, by batch."""
  return {str(b): round(float(ms), 3) for b, ms in sorted(points.items())}


def lift_key(record: Mapping) -> dict[str, str]:
  """``{group: lifted policy as JSON text}`` of a decision record."""
  return {g: json.dumps(lift["new"], sort_keys=True) for g, lift in record.get("lifted", {}).items()}
