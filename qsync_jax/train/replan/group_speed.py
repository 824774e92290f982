"""A group's measured compute as a function of its per-device batch, and the split of a global
batch that balances the groups: pure functions over measured ``(batch, ms)`` points.

``GroupSpeed`` goes through the measured points (made non-decreasing), linear between them, and
beyond them along the least-squares line of all of them. ``balance`` splits the same global
batch so that the slowest group finishes first: ``min over batches of max_g ms_g(b_g)`` with
``Σ_g count_g · b_g = global batch`` (exact, over multiples of a granularity).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping

import numpy as np

from qsync_jax.errors import QsyncError


@dataclasses.dataclass(frozen=True)
class GroupSpeed:
  """A group's measured compute per step at a per-device batch: through the measured
  ``points`` ((batch, ms), non-decreasing) and linear between them; beyond them, and without
  two points, along ``intercept_ms + slope_ms · batch`` (its slope, from the last point)."""

  intercept_ms: float
  slope_ms: float
  points: tuple[tuple[int, float], ...] = ()

  def ms(self, batch_per_device: int) -> float:
    pts = self.points
    if len(pts) < 2:
      return self.intercept_ms + self.slope_ms * batch_per_device
    if batch_per_device <= pts[0][0]:
      return max(0.0, pts[0][1] - self.slope_ms * (pts[0][0] - batch_per_device))
    if batch_per_device >= pts[-1][0]:
      return pts[-1][1] + self.slope_ms * (batch_per_device - pts[-1][0])
    i = bisect.bisect_left([b for b, _ in pts], batch_per_device)
    (b0, m0), (b1, m1) = pts[i - 1], pts[i]
    return m1 if b1 == batch_per_device else m0 + (m1 - m0) * (batch_per_device - b0) / (b1 - b0)

  @classmethod
  def fit(cls, ms_at: Mapping[int, float]) -> GroupSpeed:
    """From the measured ``{batch: ms}``: the points themselves and their least-squares line
    (one point: the line through 0, no points)."""
    sizes = sorted(ms_at)
    if len(sizes) == 1:
      return cls(0.0, ms_at[sizes[0]] / sizes[0])
    x, y = np.asarray(sizes, float), np.asarray([ms_at[b] for b in sizes], float)
    slope, intercept = np.polyfit(x, y, 1)
    slope = max(float(slope), 1e-9)  # more examples never take less time
    intercept = max(float(intercept), 0.0)
    points, top = [], 0.0
    for b in sizes:  # non-decreasing: a smaller time at a larger batch is noise
      top = max(top, float(ms_at[b]))
      points.append((int(b), top))
    return cls(intercept, slope, tuple(points))


def balance(
  counts: Mapping[str, int], speeds: Mapping[str, GroupSpeed], global_batch: int, granularity: int = 1
) -> dict[str, int]:
  """Per-device batch of each group (multiples of ``granularity``, at least one multiple each)
  with ``Σ counts[g] · b[g] == global_batch`` that minimizes ``max_g speeds[g].ms(b[g])``.
  ``QsyncError`` when no such split exists.

  Exact: the least step time ``T`` (among the groups' times at each batch) for which batches
  with ``ms_g(b_g) <= T`` can add up to the global batch (a subset sum over the groups, as bit
  sets), then one such split."""
  names = list(counts)
  units = global_batch // granularity if global_batch % granularity == 0 else -1
  top = {g: units // counts[g] for g in names} if units > 0 else {}
  times = sorted({speeds[g].ms(k * granularity) for g in names for k in range(1, top.get(g, 0) + 1)})
  split = None
  lo, hi = 0, len(times) - 1
  while lo <= hi:  # the least feasible time: feasibility only grows with the time allowed
    mid = (lo + hi) // 2
    found = _split_within(names, counts, speeds, units, granularity, times[mid])
    if found is None:
      lo = mid + 1
    else:
      split, hi = found, mid - 1
  if split is None:
    raise QsyncError(
      f"the global batch {global_batch} cannot be split over groups {dict(counts)} in multiples of "
      f"{granularity} per device, at least one each. Fix: choose a global batch that these device "
      "counts can add up to, or another granularity."
    )
  return {g: k * granularity for g, k in split.items()}


def _split_within(names, counts, speeds, units, granularity, limit) -> dict[str, int] | None:
  """Per-device batches (in units of ``granularity``) adding up to ``units`` with every group's
  time at most ``limit``; None if there are none."""
  allowed = {
    g: [k for k in range(1, units // counts[g] + 1) if speeds[g].ms(k * granularity) <= limit] for g in names
  }
  reach = [1]  # reach[i]: bit s set when the first i groups can take s units
  for g in names:
    mask = 0
    for k in allowed[g]:
      mask |= reach[-1] << (counts[g] * k)
    reach.append(mask & ((1 << (units + 1)) - 1))
  if not (reach[-1] >> units) & 1:
    return None
  out, left = {}, units
  for i in range(len(names) - 1, -1, -1):  # walk back, the largest batch that still fits first
    g = names[i]
    k = next(
      k for k in reversed(allowed[g]) if left >= counts[g] * k and (reach[i] >> (left - counts[g] * k)) & 1
    )
    out[g], left = k, left - counts[g] * k
  return {g: out[g] for g in names}


def predicted_ms(speeds: Mapping[str, GroupSpeed], batches: Mapping[str, int]) -> float:
  """The synchronous step's compute: the slowest group's."""
  return max(speeds[g].ms(b) for g, b in batches.items())
