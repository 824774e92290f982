"""What a predicted step waits on: the straggling group, its exposed collectives, its optimizer.

``limits(prediction)`` reads a ``planners.predictor.replay.Prediction``'s nodes; ``qsync plan``
and ``qsync predict`` both name the limiting group from it, so they name the same one for a plan.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the predicted step waits on, from the plan's ``Prediction``:

  * ``straggler``: the running group whose last forward/backward node ends last (at
    ``backward_end_ms``, from the prediction's nodes and times); ``straggler_lead_ms``: how much
    later than the first group's it ends (0 with one group);
  * ``exposed_comm_ms``: the prediction's ``exposed_comm_ms`` of the straggler: the time
    collectives run while its devices compute nothing (not overlapped);
  * ``optimizer_ms``: the prediction's ``optimizer_tail_ms`` of the straggler: its optimizer
    update's time per device, after the collectives of each bucket.
  """

  straggler: str
  backward_end_ms: float
  straggler_lead_ms: float
  exposed_comm_ms: float
  optimizer_ms: float
  step_ms: float

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def line(self) -> str:
    """``limited by: straggler G (…), exposed all-reduce … ms, optimizer update … ms (step … ms)``."""
    return (
      f"limited by: straggler {self.straggler} (backward ends at {self.backward_end_ms:.3f} ms, "
      f"{self.straggler_lead_ms:.3f} ms after the first group's), exposed all-reduce "
      f"{self.exposed_comm_ms:.3f} ms (not overlapped with its compute), "
      f"optimizer update {self.optimizer_ms:.3f} ms (step {self.step_ms:.3f} ms)"
    )


def limits(prediction) -> Limits:
  """``Limits`` of a ``planners.predictor.replay.Prediction``."""
  if not prediction.nodes:
    raise ValueError("the prediction has no nodes: pass the one `planners.predictor.replay.predict` returns.")
  ends: dict[str, float] = {}
  for node, (_, end) in zip(prediction.nodes, prediction.times):
    if node.stream == "compute" and node.kind not in ("optimizer", "sync"):
      ends[node.group] = max(ends.get(node.group, end), end)
  straggler = max(ends, key=lambda g: ends[g])
  return Limits(
    straggler=straggler,
    backward_end_ms=ends[straggler],
    straggler_lead_ms=ends[straggler] - min(ends.values()),
    exposed_comm_ms=prediction.exposed_comm_ms[straggler],
    optimizer_ms=prediction.optimizer_tail_ms[straggler],
    step_ms=prediction.step_ms,
  )
