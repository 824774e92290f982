"""Joint planner: every group's per-device batch and every op's precision, chosen together.

The global batch ``B`` is the cluster spec's. A group's per-device batch is a multiple of the
granularity ``q`` (0 leaves an inference group out of the job; training groups always run);
``Σ count·batch = B``. Training groups run the training precision; an inference group runs
one ladder level per op (``planners.allocator.greedy``).

**Accuracy cost** of a plan: ``Σ_groups (count·batch / B) · Σ_ops Ω(op, its precision)``, Ω
the indicator's per-op score above that of the training precision (so 0 at it, and on
training groups). The step averages
per-example gradients over the global batch, so a group's quantization error enters the
averaged gradient scaled by its share ``count·batch / B``; Ω scores an op's error on a whole
batch, and independent per-example errors add linearly in the share. So the cost is
comparable across batch splits, 0 for a plan at the training precision, and with equal
batches it is QSync's Σ Ω scaled by the inference groups' share.

**Objective**: the highest predicted throughput (``B / step``), within ``slack`` of the best;
among those, the least accuracy cost. Search:

1. *Configurations* of an inference group: every op at its fastest ladder level, and every
   uniform level (one precision on every op, fp32 included).
2. *Fastest split* of each set of participating groups and each combination of their
   configurations: a group's predicted step is affine in its batch (two replays fit it);
   every split at granularity that fits memory is scored on the affine steps, the best few
   are replayed. ``T_best``: the fastest of all.
3. *Least cost at* ``T = T_best·(1 + slack)``: for each set of participating inference
   groups, the training groups take the largest batch whose step keeps pace with ``T``; the
   inference groups share the rest, each group's precisions set by the allocator's greedy
   at its batch (fastest first, then the most sensitive ops recovered while its step ≤ T),
   the split of least cost kept. The whole plan is then replayed.
4. *Alternatives*, predicted the same way: the training groups alone, the spec's batches at
   the training precision, dynamic batching (the fastest split at the training precision),
   uniform low precision (the spec's batches, inference groups at their lowest-bit
   precision), QSync's precision-only plan (the spec's batches, the allocator's greedy).
   The plan is the least-cost candidate within ``slack`` of the fastest of all, so it is
   never predicted slower than an alternative by more than ``slack``.

``batch="equal"`` keeps the spec's batches (for models whose semantics need them, e.g.
BatchNorm statistics): the plan is QSync's, the alternatives those of the same batches.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from planners.allocator.greedy import Evaluator, Problem, fastest_levels, greedy, to_plan, uniform_levels
from planners.predictor.memory_model import memory_bytes
from planners.predictor.replay import comm_for, sync_step_ms
from planners.profile import GroupCost
from qsync_jax.errors import PlanError
from qsync_jax.precision import PRECISION_BITS

Row = tuple[int, ...] | None
"""Ladder level of every op of an inference group (None: a training group)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan: per-device batch of every group (0: out), levels of every inference group
  (None where out), its predicted step and accuracy cost."""

  name: str
  batches: tuple[int, ...]
  rows: tuple[Row, ...]
  step_ms: float
  cost: float
  global_batch: int
  fits: bool = True

  @property
  def samples_per_s(self) -> float:
    return self.global_batch / self.step_ms * 1e3

  def to_json(self, problem: Problem) -> dict:
    return {
      "name": self.name,
      "batch_per_device": {g.name: b for g, b in zip(problem.groups, self.batches)},
      "precisions": precision_counts(problem, self),
      "step_ms": self.step_ms,
      "samples_per_s": self.samples_per_s,
      "accuracy_cost": self.cost,
      "fits_memory": self.fits,
    }


def precision_counts(problem: Problem, cand: Candidate) -> dict[str, dict[str, int]]:
  """``{group: {precision: number of ops}}`` of the groups that run."""
  out = {}
  for gi, (g, b, row) in enumerate(zip(problem.groups, cand.batches, cand.rows)):
    if b == 0:
      continue
    if row is None:
      out[g.name] = {problem.train_policy: len(problem.op_names)}
      continue
    j = problem.inference.index(gi)
    counts: dict[str, int] = {}
    for i, lv in enumerate(row):
      p = problem.ladders[j][i][lv][0]
      counts[p] = counts.get(p, 0) + 1
    out[g.name] = counts
  return out


class Search:
  """Replays candidate plans of ``problem`` (memoized op costs)."""

  def __init__(self, problem: Problem, granularity: int):
    self.p, self.q = problem, granularity
    self.ev = Evaluator(problem)
    self.B = problem.cluster.global_batch
    self.replays = 0
    self._comm: dict = {}
    train = problem.train_policy if problem.train_policy in PRECISION_BITS else "fp32"
    self.base = [uniform_levels(problem, j, train) for j in range(len(problem.inference))]

  def group_at(self, gi: int, b: int, row: Row) -> GroupCost:
    g = self.p.groups[gi]
    if row is None:
      return dataclasses.replace(g, batch_per_device=b)
    j = self.p.inference.index(gi)
    pols = {n: self.p.ladders[j][i][lv][1] for i, (n, lv) in enumerate(zip(self.p.op_names, row))}
    return dataclasses.replace(g, op_policies=pols, batch_per_device=b)

  def comm(self, batches: Sequence[int]):
    key = tuple(b > 0 for b in batches)
    if key not in self._comm:
      cluster = self.p.cluster.with_batch_per_device({g.name: b for g, b in zip(self.p.groups, batches)})
      self._comm[key] = comm_for(cluster, self.p.bucket_bytes)
    return self._comm[key]

  def step(
    self, batches: Sequence[int], rows: Sequence[Row], comm_batches: Sequence[int] | None = None
  ) -> float:
    """The predicted synchronous step of the groups that run (with the all-reduce of the
    groups that run in ``comm_batches``, default ``batches``)."""
    self.replays += 1
    groups = [self.group_at(gi, b, r) for gi, (b, r) in enumerate(zip(batches, rows)) if b > 0]
    return sync_step_ms(groups, self.comm(batches if comm_batches is None else comm_batches), self.ev.cost)

  def max_batch(self, gi: int, row: Row) -> int:
    """The largest per-device batch (multiple of q, ≤ B / count) that fits the group's memory."""
    cap = self.B // self.p.cluster.groups[gi].count
    lo, hi = 0, cap // self.q
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if self.fits(gi, mid * self.q, row):
        lo = mid
      else:
        hi = mid - 1
    return lo * self.q

  def cost(self, batches: Sequence[int], rows: Sequence[Row]) -> float:
    """The accuracy cost (module docstring); Ω counts above the training precision's."""
    total = 0.0
    for gi, (b, row) in enumerate(zip(batches, rows)):
      if b and row is not None:
        j = self.p.inference.index(gi)
        share = self.p.cluster.groups[gi].count * b / self.B
        om, base = self.p.omega[j], self.base[j]
        total += share * sum(max(0.0, om[i][lv] - om[i][base[i]]) for i, lv in enumerate(row))
    return total

  def fits(self, gi: int, b: int, row: Row) -> bool:
    limit = self.p.cluster.groups[gi].memory_gb * 1e9
    return memory_bytes(self.group_at(gi, b, row), self.ev.op_memory) <= limit

  def candidate(self, name: str, batches: Sequence[int], rows: Sequence[Row]) -> Candidate:
    rows = tuple(r if b else None for b, r in zip(batches, rows))
    fits = all(self.fits(gi, b, r) for gi, (b, r) in enumerate(zip(batches, rows)) if b)
    return Candidate(
      name, tuple(batches), rows, self.step(batches, rows), self.cost(batches, rows), self.B, fits
    )

  def fastest_split(
    self, members: Sequence[int], rows: Sequence[Row], keep: int = 3
  ) -> tuple[int, ...] | None:
    """The split of B over ``members`` (group indices; the others get 0) with the least
    predicted step under ``rows``, or None if no split fits."""
    counts = [self.p.cluster.groups[gi].count for gi in members]
    caps = [self.max_batch(gi, rows[gi]) for gi in members]
    if any(c < self.q for c in caps):
      return None
    affine = []
    for gi, cap in zip(members, caps):
      lo, hi = self.q, max(cap, 2 * self.q)
      t_lo, t_hi = self._alone(gi, lo, rows[gi]), self._alone(gi, hi, rows[gi])
      slope = (t_hi - t_lo) / (hi - lo)
      affine.append((t_lo - slope * lo, slope))
    scored = []
    for split in _splits(self.B, counts, caps, self.q):
      scored.append((max(a + s * b for (a, s), b in zip(affine, split)), split))
    if not scored:
      return None
    best, best_ms = None, math.inf
    for _, split in sorted(scored)[:keep]:
      batches = [0] * len(self.p.groups)
      for gi, b in zip(members, split):
        batches[gi] = b
      ms = self.step(batches, rows)
      if ms < best_ms:
        best, best_ms = tuple(batches), ms
    return best

  def _alone(self, gi: int, b: int, row: Row) -> float:
    self.replays += 1
    return sync_step_ms([self.group_at(gi, b, row)], self.comm([1] * len(self.p.groups)), self.ev.cost)


def _splits(total: int, counts: Sequence[int], caps: Sequence[int], q: int):
  """Every ``(b_0, …)``, multiples of q with q ≤ b_i ≤ caps[i], with Σ counts[i]·b_i = total."""
  if len(counts) == 1:
    b, rem = divmod(total, counts[0])
    if rem == 0 and b % q == 0 and q <= b <= caps[0]:
      yield (b,)
    return
  for b in range(q, min(caps[0], total // counts[0]) + 1, q):
    for rest in _splits(total - counts[0] * b, counts[1:], caps[1:], q):
      yield (b, *rest)


def _subsets(items: Sequence[int]):
  return itertools.chain.from_iterable(itertools.combinations(items, r) for r in range(len(items) + 1))


def check_granularity(problem: Problem, granularity: int) -> None:
  """``PlanError`` unless the global batch splits at ``granularity`` and every group fits one step."""
  B = problem.cluster.global_batch
  if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
    raise PlanError(f"granularity={granularity!r} must be a positive integer. Fix: pass e.g. 1 or 8.")
  if B % granularity:
    raise PlanError(
      f"the global batch {B} (cluster {problem.cluster.name!r}) is not a multiple of the granularity "
      f"{granularity}. Fix: change the groups' batch_per_device so they sum to a multiple of {granularity}, "
      "or lower --granularity."
    )


def joint_plan(problem: Problem, granularity: int = 1, slack: float = 0.02, batch: str = "joint"):
  """``(chosen Candidate, every Candidate, Search)``; see the module docstring."""
  if batch not in ("joint", "equal"):
    raise PlanError(f"batch={batch!r} is not a batch mode. Fix: use 'joint' or 'equal'.")
  if not (isinstance(slack, (int, float)) and 0 <= slack < 1):
    raise PlanError(f"slack={slack!r} must be a fraction in [0, 1). Fix: pass e.g. 0.02.")
  check_granularity(problem, granularity)
  s = Search(problem, granularity)
  n = len(problem.groups)
  train_idx = [gi for gi in range(n) if gi not in problem.inference]
  spec = tuple(g.batch_per_device for g in problem.groups)
  train_rows: list[Row] = [None] * n
  for j, gi in enumerate(problem.inference):
    train_rows[gi] = s.base[j]
  fastest = dict(zip(problem.inference, fastest_levels(problem, fit_memory=False)))
  configs = {}
  for j, gi in enumerate(problem.inference):
    names = {p for lad in problem.ladders[j] for p, _ in lad}
    rows = {fastest[gi]} | {uniform_levels(problem, j, p) for p in names}
    configs[gi] = sorted(rows)
  lowest = {}
  for j, gi in enumerate(problem.inference):
    names = sorted({p for lad in problem.ladders[j] for p, _ in lad}, key=lambda p: (PRECISION_BITS[p], p))
    lowest[gi] = uniform_levels(problem, j, names[0])

  for gi in range(n):
    rows = [train_rows[gi]] if gi in train_idx else configs[gi]
    if all(not s.fits(gi, granularity, r) for r in rows):
      g = problem.cluster.groups[gi]
      need = min(memory_bytes(s.group_at(gi, granularity, r)) for r in rows)
      raise PlanError(
        f"device group {g.name!r} ({g.device_type}) cannot fit even {granularity} example(s) per device: it "
        f"needs {math.ceil(need / 1e7) / 100:.2f} GB, and has memory_gb={g.memory_gb:g}. Fix: set memory_gb ≥ "
        f"{math.ceil(need / 1e7) / 100:.2f} if the device has it, or remove the group from the cluster spec."
      )
  cands = [s.candidate("equal batches, training precision", spec, train_rows)]
  cands.append(s.candidate("uniform low precision", spec, [lowest.get(gi) for gi in range(n)]))
  try:
    qsync = greedy(problem)
    cands.append(s.candidate("QSync (precision only)", spec, _rows_of(problem, qsync.assignment)))
  except PlanError:
    if batch == "equal":
      raise
  if batch == "joint":
    if train_idx:
      split = s.fastest_split(train_idx, train_rows)
      if split is not None:
        cands.append(s.candidate("training groups only", split, train_rows))
    split = s.fastest_split(range(n), train_rows)
    if split is not None:
      cands.append(s.candidate("dynamic batching", split, train_rows))
    cands += _joint(problem, s, train_idx, configs, slack, cands)
  fitting = [c for c in cands if c.fits]
  if not fitting:
    raise PlanError(
      f"no plan of cluster {problem.cluster.name!r} fits its groups' memory. Fix: raise memory_gb where the "
      "devices have more, lower the global batch, or use --batch joint."
    )
  best_ms = min(c.step_ms for c in fitting)
  within = [c for c in fitting if c.step_ms <= best_ms * (1 + slack) + 1e-12]
  chosen = min(within, key=lambda c: (c.cost, c.step_ms))
  return chosen, cands, s


def _rows_of(problem: Problem, assignment) -> list[Row]:
  rows: list[Row] = [None] * len(problem.groups)
  for j, gi in enumerate(problem.inference):
    rows[gi] = assignment[j]
  return rows


def _joint(problem: Problem, s: Search, train_idx, configs, slack, alternatives) -> list[Candidate]:
  """Steps 2 and 3 of the module docstring: the fastest plans of every participating set and
  configuration, then the least-cost plan at ``T_best·(1 + slack)``."""
  n = len(problem.groups)
  fastest: list[Candidate] = []
  for members_inf in _subsets(problem.inference):
    if not train_idx and not members_inf:
      continue
    for combo in itertools.product(*(configs[gi] for gi in members_inf)):
      rows = [None] * n
      for gi, row in zip(members_inf, combo):
        rows[gi] = row
      split = s.fastest_split(sorted(train_idx + list(members_inf)), rows)
      if split is not None:
        fastest.append(s.candidate("fastest", split, rows))
  if not fastest:
    return []
  t_best = min(c.step_ms for c in fastest + [a for a in alternatives if a.fits])
  target = t_best * (1 + slack)
  out = [min(fastest, key=lambda c: c.step_ms)]
  for members_inf in _subsets(problem.inference):
    if not train_idx:
      break
    cand = _least_cost(problem, s, train_idx, list(members_inf), target)
    if cand is not None:
      out.append(cand)
  best = min((c for c in out if c.step_ms <= target * (1 + 1e-9)), key=lambda c: c.cost, default=None)
  return [dataclasses.replace(best, name="joint")] + out[:1] if best is not None else out[:1]


def _least_cost(problem, s: Search, train_idx, members_inf, target) -> Candidate | None:
  """Training groups at the largest batch that keeps pace with ``target``; the inference
  groups of ``members_inf`` share the rest at their greedy precisions (least cost split)."""
  n, q, B = len(problem.groups), s.q, s.B
  counts = {gi: problem.cluster.groups[gi].count for gi in range(n)}
  caps = {gi: s.max_batch(gi, None) for gi in train_idx}
  for b_train in range(min(caps.values()) // q * q, 0, -q):  # one batch for all training groups
    batches = [0] * n
    for gi in train_idx:
      batches[gi] = b_train
    running = [b_train if gi in train_idx or gi in members_inf else 0 for gi in range(n)]
    if s.step(batches, [None] * n, running) > target * (1 + 1e-9):
      continue
    rest = B - sum(counts[gi] * b_train for gi in train_idx)
    if not members_inf:
      return s.candidate("training groups only", batches, [None] * n) if rest == 0 else None
    if rest <= 0:
      return None
    best, straggled = None, False
    caps_inf = [B // counts[gi] for gi in members_inf]
    for split in _splits(rest, [counts[gi] for gi in members_inf], caps_inf, q):
      rows = [None] * n
      for gi, b in zip(members_inf, split):
        rows[gi] = _greedy_at(problem, s, gi, b, batches, split, members_inf, target)
      if any(rows[gi] is None for gi in members_inf):
        straggled = True
        continue
      full = list(batches)
      for gi, b in zip(members_inf, split):
        full[gi] = b
      cand = s.candidate("joint", full, rows)
      if cand.step_ms <= target * (1 + 1e-9) and (best is None or cand.cost < best.cost):
        best = cand
    if best is not None or straggled:  # a smaller training batch leaves the inference groups more
      return best
  return None


def _greedy_at(problem, s: Search, gi, b, train_batches, split, members_inf, target) -> Row:
  """The allocator's greedy for inference group ``gi`` alone at batch ``b`` (the comm of
  every group that runs), against ``target``; None if it cannot keep pace or fit."""
  j = problem.inference.index(gi)
  batches = list(train_batches)
  for g, bb in zip(members_inf, split):
    batches[g] = bb
  cluster = problem.cluster.with_batch_per_device({g.name: bb for g, bb in zip(problem.groups, batches)})
  group = dataclasses.replace(problem.groups[gi], batch_per_device=b)
  sub = dataclasses.replace(
    problem,
    cluster=cluster,
    groups=(group,),
    inference=(0,),
    ladders=(problem.ladders[j],),
    omega=(problem.omega[j],),
    limits=(problem.limits[j],),
  )
  try:
    alloc = greedy(sub, target_ms=target)
  except PlanError:
    return None
  s.replays += alloc.replays
  return None if alloc.straggles else alloc.assignment[0]


def plan_of(problem: Problem, cand: Candidate, predictions=None):
  """The ``Plan`` of a candidate: per-op rules on inference groups that run, the training
  precision on the others, every group's per-device batch (0: out)."""
  rows = tuple(
    cand.rows[gi] if cand.rows[gi] is not None else uniform_levels(problem, j, "fp32")
    for j, gi in enumerate(problem.inference)
  )
  plan = to_plan(problem, rows, predictions)
  return dataclasses.replace(plan, batch_per_device={g.name: b for g, b in zip(problem.groups, cand.batches)})
