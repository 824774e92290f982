"""Each gradient payload a plan searched: its fastest plan's step (modeled) beside its accuracy cost
(measured by ``qsync indicator``: ``planners.indicator.payload_cost``), as ``qsync plan`` prints and
writes them (``predictions["payloads"]``, ``predictions["payload_accuracy"]``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from planners.allocator.greedy import Problem
from planners.allocator.search import Candidate, running_devices

NOT_MEASURED = (
  "not measured: the indicator holds no payload measurement (`qsync indicator` measures it with the "
  "gradient method); among plans within the slack the widest payload wins"
)


def payload_accuracy(section: Mapping[str, Any] | None) -> str:
  """How the payloads' accuracy costs were obtained, in one clause: measured (on how many batches,
  at which device counts, on which scale), or ``NOT_MEASURED``."""
  if section is None:
    return NOT_MEASURED
  devices = ", ".join(str(n) for n in section.get("devices", []))
  return (
    f"measured by `qsync indicator` on its {section.get('batches', '?')} batches at {devices} devices (Ω: "
    f"the squared loss change of the update the payload's error makes, {section.get('optimizer', 'adam')} "
    f"at lr {section.get('lr', '?')}; fp32 is the reference, 0)"
  )


def payload_rows(problem: Problem, candidates: Sequence[Candidate]) -> dict[str, dict[str, Any]]:
  """``{sync: {"plan", "step_ms", "samples_per_s", "devices", "accuracy_cost"}}`` per sync of the
  plan's own search (``candidates`` not references), in search order: its fastest fitting
  candidate, the devices that run it and its payload's accuracy cost there (None: not measured)."""
  fastest: dict[str, Candidate] = {}
  for c in candidates:
    if c.fits and not c.reference and (c.sync not in fastest or c.step_ms < fastest[c.sync].step_ms):
      fastest[c.sync] = c
  return {
    sync: {
      "plan": c.name,
      "step_ms": c.step_ms,
      "samples_per_s": c.samples_per_s,
      "devices": running_devices(problem, c.batches),
      "accuracy_cost": c.payload_cost,
    }
    for sync, c in fastest.items()
  }


def payload_predictions(problem: Problem, candidates: Sequence[Candidate]) -> dict[str, Any]:
  """The keys ``qsync plan`` writes under the plan's ``predictions`` of the payloads searched:
  ``payload_accuracy`` (``payload_accuracy``) and ``payloads`` (``payload_rows``)."""
  return {
    "payload_accuracy": payload_accuracy(problem.payload),
    "payloads": payload_rows(problem, candidates),
  }


def payload_lines(rows: Mapping[str, Mapping[str, Any]], accuracy: str, section) -> list[str]:
  """The lines ``qsync plan`` prints for ``payload_rows``: a header saying how the figures were
  obtained (the step modeled; the accuracy cost ``accuracy``), then one line per sync."""
  lines = [f"gradient payloads (the fastest plan at each; step modeled; accuracy cost {accuracy}):"]
  measured = ", ".join(str(n) for n in (section or {}).get("devices", []))
  for sync, row in rows.items():
    cost = row["accuracy_cost"]
    if sync == "fp32":
      what = "accuracy cost 0 (the reference)"
    elif cost is not None:
      what = f"accuracy cost {cost:.3g}"
    elif section is None:
      what = "accuracy cost not measured"
    else:
      what = (
        f"accuracy cost not measured at {row['devices']} devices (the indicator measured {measured}; Fix: "
        f"qsync indicator --payload-devices {row['devices']})"
      )
    lines.append(
      f"  {sync:<12s} {row['step_ms']:.3f} ms, {row['samples_per_s']:.1f} samples/s on {row['devices']} "
      f"devices ({row['plan']}): {what}"
    )
  return lines


__all__ = ["NOT_MEASURED", "payload_accuracy", "payload_lines", "payload_predictions", "payload_rows"]
