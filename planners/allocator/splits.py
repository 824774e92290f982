"""Batch splits under affine step models: pure functions of the joint planner's search.

A group's modeled step at per-device batch ``b`` is ``a + s·b`` (``Affine``, up to the largest
batch that fits its memory). ``water_level`` is the continuous step at which the groups take the
whole global batch; ``splits_within`` / ``fastest_splits`` enumerate the splits at the
granularity under a step bound and rank them; ``hull_cost`` and ``cheapest_split`` price a
split by the lower convex hull of a group's (step, cost) configurations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Affine:
  """A group's modeled step at per-device batch ``b``: ``a + s·b`` ms, for ``b ≤ cap`` (the
  largest batch that fits its memory, a multiple of the granularity; 0 if none does)."""

  a: float
  s: float
  cap: int

  def step_ms(self, b: float) -> float:
    return self.a + self.s * b

  def largest_batch(self, t_ms: float, q: int) -> int:
    """The largest multiple of ``q`` that is ≤ cap and whose step is ≤ ``t_ms`` (0 if none)."""
    if self.s <= 0:
      return self.cap if self.a <= t_ms else 0
    if t_ms == math.inf:
      return self.cap
    b = math.floor((t_ms - self.a) / self.s / q + 1e-9) * q
    return max(0, min(self.cap, b))


def largest_true(ok: Callable[[int], bool], lo: int, hi: int, q: int) -> int:
  """The largest multiple of ``q`` in ``[lo, hi]`` where ``ok`` holds, ``ok`` true up to some
  batch and false above it (bisection, ``hi`` tried first), or 0 if it holds nowhere."""
  lo_k, hi_k = -(-lo // q), hi // q
  if hi_k < lo_k:
    return 0
  if ok(hi_k * q):
    return hi_k * q
  if not ok(lo_k * q):
    return 0
  while hi_k - lo_k > 1:  # ok(lo_k·q), not ok(hi_k·q)
    mid = (lo_k + hi_k) // 2
    if ok(mid * q):
      lo_k = mid
    else:
      hi_k = mid
  return lo_k * q


def water_level(total: int, counts: Sequence[int], models: Sequence[Affine], q: int) -> float:
  """The least ``T`` with ``Σ_i counts[i]·min(cap_i, max(q, (T − a_i)/s_i)) ≥ total`` and every
  ``a_i + s_i·q ≤ T`` (batches continuous): a lower bound of the affine step ``max_i a_i + s_i·b_i``
  of every split at granularity ``q``; inf if none fits (``Σ counts·cap < total`` or
  ``Σ counts·q > total``)."""
  if sum(c * m.cap for c, m in zip(counts, models)) < total or q * sum(counts) > total:
    return math.inf

  def taken(t):
    return sum(
      c * (m.cap if m.s <= 0 else min(m.cap, max(q, (t - m.a) / m.s))) for c, m in zip(counts, models)
    )

  lo = max(m.step_ms(q) for m in models)
  hi = max(m.step_ms(m.cap) for m in models)
  if taken(lo) >= total:
    return lo
  for _ in range(100):
    mid = (lo + hi) / 2
    if taken(mid) >= total:
      hi = mid
    else:
      lo = mid
  return hi


def splits_within(total: int, counts: Sequence[int], lows: Sequence[int], highs: Sequence[int], q: int):
  """Every ``(b_0, …)``, multiples of q with lows[i] ≤ b_i ≤ highs[i] and Σ counts[i]·b_i = total
  (lows multiples of q); a prefix is extended only where the rest can still reach the total."""
  if not counts:
    if total == 0:
      yield ()
    return
  rest_lo = sum(c * b for c, b in zip(counts[1:], lows[1:]))
  rest_hi = sum(c * b for c, b in zip(counts[1:], highs[1:]))
  first = max(lows[0], -(-(total - rest_hi) // (counts[0] * q)) * q)
  for b in range(first, highs[0] + 1, q):
    rem = total - counts[0] * b
    if rem < rest_lo:
      return
    yield from ((b, *rest) for rest in splits_within(rem, counts[1:], lows[1:], highs[1:], q))


def fastest_splits(
  total: int, counts: Sequence[int], models: Sequence[Affine], q: int, keep: int
) -> list[tuple[int, ...]]:
  """The ``keep`` splits of ``total`` (multiples of q in ``[q, cap_i]``, ``Σ counts·b = total``)
  of least affine step ``max_i a_i + s_i·b_i``, least first (ties: the smaller split), as a full
  enumeration ranks them: every split with step ≤ T, for T rising from the water level (its
  excess doubling) until ``keep`` are found or every cap is reached."""
  level = water_level(total, counts, models, q)
  if level == math.inf:
    return []
  caps = [m.cap for m in models]
  excess = 1e-3 * max(abs(level), 1e-9)
  while True:
    highs = [m.largest_batch(level + excess, q) for m in models]
    lows = [q] * len(models)
    found = sorted(
      (max(m.step_ms(b) for m, b in zip(models, split)), split)
      for split in splits_within(total, counts, lows, highs, q)
    )
    if len(found) >= keep or highs == caps:
      return [split for _, split in found[:keep]]
    excess *= 2


def hull_cost(points: Sequence[tuple[float, float]], t_ms: float) -> float:
  """The lower convex hull of ``points`` (step ms, cost) at step ``t_ms``: the least cost of a
  point no slower than ``t_ms``, or of a faster and a slower point interpolated linearly in the
  step; inf if every point is slower than ``t_ms``."""
  faster = [(t, c) for t, c in points if t <= t_ms]
  best = min((c for _, c in faster), default=math.inf)
  for t1, c1 in faster:
    for t2, c2 in points:
      if t2 > t_ms and c2 < c1:
        best = min(best, c1 + (c2 - c1) * (t_ms - t1) / (t2 - t1))
  return best


def cheapest_split(
  total: int, counts: Sequence[int], tables: Sequence[Sequence[float]], q: int
) -> tuple[float, tuple[int, ...]] | None:
  """The split of ``total`` (``b_i = k_i·q``, ``k_i ≥ 1``, ``Σ counts·b = total``) of least
  ``Σ_i tables[i][k_i]`` (an inf entry: not allowed; k beyond a table: not allowed), as (that
  sum, split), or None if none is finite. Dynamic programming over the groups: ``best[r]`` is
  the least sum of the groups so far over their splits of ``r·q`` examples."""
  units = total // q
  best = np.full(units + 1, np.inf)
  best[0] = 0.0
  picks = []
  for c, table in zip(counts, tables):
    new, pick = np.full(units + 1, np.inf), np.zeros(units + 1, dtype=np.int64)
    for k in range(1, min(len(table), units // c + 1)):
      if math.isfinite(table[k]):
        shift = c * k
        cand = best[: units + 1 - shift] + table[k]
        better = cand < new[shift:]
        new[shift:][better] = cand[better]
        pick[shift:][better] = k
    best = new
    picks.append(pick)
  if not math.isfinite(best[units]):
    return None
  split, r = [], units
  for c, pick in zip(reversed(counts), reversed(picks)):
    k = int(pick[r])
    split.append(k * q)
    r -= c * k
  return float(best[units]), tuple(reversed(split))
