"""What the trainer does with re-planning's results: a ``ReplanEvent`` per decision and per
measured re-plan — its log line, its ``metrics.jsonl`` record and the split to run from the next
step, if any — so the trainer does not read decision records itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ReplanEvent:
  """At ``step``: ``record`` goes to ``metrics.jsonl`` as ``{"step": step, key: record}`` (``key``
  ``"replan"`` for a decision, ``"replan_measured"`` for a re-planned split's measured step),
  ``line`` to the progress stream; ``switch_to``: ``(per-device batches, {group: policy JSON})``
  to run from the next step (the other groups' batches and policies stay), or None."""

  step: int
  key: str
  record: dict
  line: str
  switch_to: tuple[dict[str, int], dict[str, Any]] | None = None


def decision_event(record: Mapping) -> ReplanEvent:
  """The event of a decision ``record`` (``Replanner.decide``)."""
  switch = None
  if record["replanned"]:
    switch = (dict(record["new"]), {g: lift["new"] for g, lift in record.get("lifted", {}).items()})
  return ReplanEvent(record["step"], "replan", dict(record), "replan: " + describe(record), switch)


def measured_event(note: Mapping) -> ReplanEvent:
  """The event of a note of ``Replanner.take_notes`` (an undone re-plan switches back)."""
  measured = {k: v for k, v in note.items() if k != "step"}
  if note.get("undone"):
    line, switch = describe_undone(note), (dict(note["restored"]), dict(note.get("restored_policies", {})))
  else:
    line, switch = describe_measured(note), None
  return ReplanEvent(note["step"], "replan_measured", measured, "replan: " + line, switch)


def describe(record: Mapping) -> str:
  """One log line for a decision ``record`` of ``Replanner.decide``."""
  speeds = ", ".join(f"{g} {ms:.3g}" for g, ms in record["ms_per_example"].items())
  split = "/".join(str(b) for b in record["old"].values())
  new = "/".join(str(b) for b in record["new"].values())
  verdict = "re-planned" if record["replanned"] else "kept the plan"
  if record.get("lifted"):
    groups = ", ".join(record["lifted"])
    lift = "lifted to 16 bits" if record["replanned"] else "faster at 16 bits, not lifted"
    verdict += f" ({groups}: 8-bit legs {lift})"
  if "undone_replan" in record:
    undone = record["undone_replan"]
    verdict += f" (its split is that of the re-plan at step {undone}, undone; no group's speed moved since)"
  measured = f", measured {record['measured_ms_old']:.3g} ms" if "measured_ms_old" in record else ""
  return (
    f"step {record['step']}: measured ms per example {speeds}; split {split} -> {new} "
    f"(predicted {record['predicted_ms_old']:.3g}{measured} -> {record['predicted_ms_new']:.3g} ms): {verdict}"
  )


def describe_measured(note: Mapping) -> str:
  """One log line for a note of ``Replanner.take_notes``: the step a re-plan made, measured."""
  before = f", {note['measured_ms_old']:.3g} ms before" if "measured_ms_old" in note else ""
  return (
    f"step {note['step']}: the split of the re-plan at step {note['decision_step']} measured "
    f"{note['measured_ms']:.3g} ms per step (predicted {note['predicted_ms']:.3g} ms compute{before}): kept"
  )


def describe_undone(note: Mapping) -> str:
  """One log line for an undone note of ``Replanner.take_notes``."""
  return (
    f"step {note['step']}: the split of the re-plan at step {note['decision_step']} measured "
    f"{note['measured_ms']:.3g} ms, slower than {note['measured_ms_old']:.3g} ms before: undone"
  )
