"""Joint planner: every group's per-device batch and every op's precision, chosen together.

The global batch ``B`` is the cluster spec's. A group's per-device batch is a multiple of the
granularity ``q`` (0 leaves an inference group out of the job; training groups always run);
``Σ count·batch = B``. Training groups run the training precision; an inference group runs
one ladder level per op (``planners.allocator.greedy``).

**Accuracy cost** of a plan: ``Σ_groups (count·batch / B) · Σ_ops Ω(op, its precision)``, Ω
the indicator's per-op score above that of the training precision (so 0 at it, and on a
training group's ops but those it runs at 8 bits: ``Problem.train_cost``). The step averages
per-example gradients over the global batch, so a group's quantization error enters the
averaged gradient scaled by its share ``count·batch / B``; Ω scores an op's error on a whole
batch, and independent per-example errors add linearly in the share. So the cost is
comparable across batch splits, 0 for a plan at the training precision, and with equal
batches it is QSync's Σ Ω scaled by the inference groups' share.

**Objective**: the highest predicted throughput (``B / step``), within ``slack`` of the best;
among those, the least accuracy cost.

**Affine step model.** A group's predicted step alone under one configuration is modeled as
``t(b) = a + s·b`` for ``b ≤ cap`` (the largest batch that fits memory): the line through its
replays at ``cap/2`` and ``cap`` with the whole cluster's all-reduce, two replays per group and
configuration; for a set of running groups ``a`` moves by the difference of one replay with
that set's all-reduce (``Search.affine``). The replayed step is convex in the batch (flat where
the all-reduce dominates, then linear in the compute), so below ``cap/2`` the line lies under
it. The search prunes with this model and replays what survives; a split is dropped only when
its affine step exceeds the step it is tested against by more than ``MARGIN``.

Search:

1. *Configurations* of an inference group: every op at its fastest ladder level, and every
   uniform level (one precision on every op, fp32 included).
2. *Fastest split* of a set of running groups under one configuration each: the ``keep``
   splits of least affine step are replayed, the fastest kept (``fastest_splits`` finds them
   as a full enumeration ranks them, enumerating only the splits under a step that rises from
   the continuous water-filling level ``water_level``). ``T_best``: the fastest over every set
   of running inference groups and combination of their configurations, restricted to the
   configurations no other one of the group beats at every batch (``a`` and ``s`` no larger,
   ``cap`` no smaller); the combinations are visited in order of water level, a lower bound of
   their affine step, until it exceeds the fastest replayed step (beyond ``MARGIN``).
3. *Least cost at* ``T = T_best·(1 + slack)``. The training groups alone, where they take
   ``B`` within ``T`` and run no op at 8 bits, cost 0 and end the search (with 8-bit ops they
   cost their share's Ω and are one plan among the search's). Else, for each set of running
   inference groups, the training groups take the largest batch (one for all) whose replayed
   step keeps pace with ``T``, and the inference groups share the rest: a group's batch is
   bounded by its affine steps at ``T``, its cost at a batch estimated from its configurations
   (its share times the lower convex hull of their (affine step, cost) points at ``T``), and the
   split of least estimated cost found by dynamic programming over the groups
   (``cheapest_split``). Training groups with 8-bit ops take part in that split as one group
   (any batch up to theirs, costing their share times their 8-bit ops' Ω).
   Splits go to the allocator's greedy in order of estimated cost over every set, each group's
   precisions at its batch (fastest first, then the most sensitive ops recovered while its
   step alone ≤ T), at most ``GREEDY_RUNS`` runs in all; the least-cost plan whose replayed
   step keeps pace is kept. What a split teaches is used before the next: a group whose
   configurations are all slower than ``T`` alone at its batch (replayed; then no greedy runs)
   or whose greedy straggles is bounded below that batch and the set re-split; a plan slower
   than ``T`` when replayed whole (the groups' all-reduces wait on each other) re-plans its
   set against ``T`` lowered by twice that overhead; a plan that keeps pace adds its
   neighbours (one granule moved between two groups).
4. *Alternatives*, predicted the same way: the training groups alone, the spec's batches at
   the training precision, dynamic batching (the fastest split at the training precision),
   uniform low precision (the spec's batches, inference groups at their lowest-bit
   precision), QSync's precision-only plan (the spec's batches, the allocator's greedy).
   The plan is the least-cost candidate within ``slack`` of the fastest of all, so it is
   never predicted slower than an alternative by more than ``slack``.

**Modes and syncs.** Steps 1-4 run once per gradient sync asked for (``syncs``: fp32, and the
syncs whose payload is priced, ``planners.predictor.payload``) and per way the trainer can
combine gradients and update the optimizer with it (``modes_for``): the flat all-reduce with
every device updating every parameter, the optimizer sharded over the devices (the fp32 sync
only), and the two-level reduction where the cluster has fast links inside groups (likewise).
Every candidate carries its mode and sync (``Candidate.mode``, ``Candidate.sync``, written into
the plan's ``reduction`` / ``optimizer_update`` / ``sync``), alternatives included, so dynamic
batching and the training groups alone are compared at their own best mode and sync too
(QSync's precision-only alternative is computed in the default mode only). Before the choice,
each candidate's cost adds its payload's accuracy cost as the indicator measured it
(``planners.allocator.search.with_payload_cost``), so a narrower payload competes with precisions
on one scale; the search within one sync ranks by the ops' cost. Memory counts the optimizer
state where each mode keeps it (sharded: ``1/N`` on each of the ``N`` devices that run,
``Search.optimizer_shards``).

``batch="equal"`` keeps the spec's batches (for models whose semantics need them, e.g.
BatchNorm statistics): the plan is QSync's, the alternatives those of the same batches, and
the training groups alone, accumulating (``planners.allocator.baselines.equal_accumulating``): each keeps its spec batch as its
micro-batch and runs ``k = B / (the training devices' spec batches)`` micro-steps (where that
divides exactly), the inference groups sit out.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence

from planners.allocator.baselines import (
  accumulating_baselines,
  accumulating_plans,
  eight_bit_baselines,
  equal_accumulating,
  payload_baselines,
)
from planners.allocator.greedy import Problem, fastest_levels, greedy, to_plan, uniform_levels
from planners.allocator.modes import MODES, modes_for
from planners.allocator.search import Candidate, Row, Search, with_payload_cost
from planners.allocator.splits import (
  cheapest_split,
  hull_cost,
  largest_true,
  water_level,
)
from planners.predictor.memory_model import memory_bytes
from qsync_jax.errors import PlanError
from qsync_jax.precision import PRECISION_BITS

MARGIN = 0.005
"""Relative error allowed to the affine step model where it prunes (module docstring)."""

GREEDY_RUNS = 6
"""Runs of the allocator's greedy in step 3 of the search, at most (the first split's always run)."""


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


def joint_plan(
  problem: Problem,
  granularity: int = 1,
  slack: float = 0.02,
  batch: str = "joint",
  optimizer_update: str = "auto",
  syncs: Sequence[str] = ("fp32",),
):
  """``(chosen Candidate, every Candidate, the chosen mode's Search)``; see the module docstring.

  The search runs once per sync of ``syncs`` and mode of ``modes_for`` (the problem's
  ``reduction``, ``optimizer_update`` and ``sync`` replaced); every candidate carries its mode and
  sync, and the choice is made over all of them: the least accuracy cost within ``slack`` of the
  fastest (ties: the earlier sync of ``syncs``, the faster, then the earlier mode)."""
  if batch not in ("joint", "equal"):
    raise PlanError(f"batch={batch!r} is not a batch mode. Fix: use 'joint' or 'equal'.")
  if not (isinstance(slack, (int, float)) and 0 <= slack < 1):
    raise PlanError(f"slack={slack!r} must be a fraction in [0, 1). Fix: pass e.g. 0.02.")
  check_granularity(problem, granularity)
  cands, searches, refused = [], {}, []
  for sync in syncs:
    for mode in modes_for(problem.cluster, optimizer_update, sync):
      moded = dataclasses.replace(problem, reduction=mode[0], optimizer_update=mode[1], sync=sync)
      try:  # a group that fits no example in one mode (its optimizer state whole) may in another
        found, searches[mode, sync] = _search_mode(moded, granularity, slack, batch)
      except PlanError as e:
        refused.append(e)
        continue
      cands += found
  if not searches:
    raise refused[-1]
  if batch == "joint":
    cands += payload_baselines(problem, granularity, syncs)
  cands = [with_payload_cost(problem, c) for c in cands]
  # references (``Candidate.reference``): baselines outside the plan's own space, not plans to choose
  fitting = [c for c in cands if c.fits and not c.reference]
  if not fitting:
    hint = ", or use --batch joint" if batch == "equal" else ""
    raise PlanError(
      f"no plan of cluster {problem.cluster.name!r} fits its groups' memory. Fix: raise memory_gb where the "
      f"devices have more, or lower the global batch{hint}."
    )
  best_ms = min(c.step_ms for c in fitting)
  within = [c for c in fitting if c.step_ms <= best_ms * (1 + slack) + 1e-12]
  chosen = min(within, key=lambda c: (c.cost, list(syncs).index(c.sync), c.step_ms, MODES.index(c.mode)))
  return chosen, cands, searches[chosen.mode, chosen.sync]


def _search_mode(
  problem: Problem, granularity: int, slack: float, batch: str
) -> tuple[list[Candidate], Search]:
  """Every candidate of ``problem`` under its own mode (module docstring, steps 1-4)."""
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
      need = min(memory_bytes(s.group_at(gi, granularity, r), **s.layout()) for r in rows)
      raise PlanError(
        f"device group {g.name!r} ({g.device_type}) cannot fit even {granularity} example(s) per device: it "
        f"needs {math.ceil(need / 1e7) / 100:.2f} GB, and has memory_gb={g.memory_gb:g}. Fix: set memory_gb ≥ "
        f"{math.ceil(need / 1e7) / 100:.2f} if the device has it, or remove the group from the cluster spec."
      )
  cands = [s.candidate("equal batches, training precision", spec, train_rows)]
  cands.append(s.candidate("uniform low precision", spec, [lowest.get(gi) for gi in range(n)]))
  # QSync's precision-only plan (its greedy is most of a joint search's time) in the default mode
  # only: under batch="joint" it is an alternative, under "equal" the plan itself (every mode).
  if batch == "equal" or (problem.reduction, problem.optimizer_update) == MODES[0]:
    try:
      qsync = greedy(problem)
      cands.append(s.candidate("QSync (precision only)", spec, _rows_of(problem, qsync.assignment)))
    except PlanError:
      if batch == "equal":
        raise
  if batch == "equal" and problem.inference and train_idx:
    accumulating = equal_accumulating(problem, s, train_idx)
    if accumulating is not None:
      cands.append(accumulating)
  if batch == "joint":
    if train_idx:
      split = s.fastest_split(train_idx, train_rows)
      if split is not None:
        cands.append(s.candidate("training groups only", split, train_rows))
    split = s.fastest_split(range(n), train_rows)
    if split is not None:
      cands.append(s.candidate("dynamic batching", split, train_rows))
    cands += accumulating_baselines(s, train_idx, train_rows, cands)
    cands += eight_bit_baselines(problem, granularity, train_idx, train_rows)
    cands += _joint(problem, s, train_idx, configs, slack, cands)
    cands += accumulating_plans(problem, s, train_rows, configs, slack, cands)
  return cands, s


def _rows_of(problem: Problem, assignment) -> list[Row]:
  rows: list[Row] = [None] * len(problem.groups)
  for j, gi in enumerate(problem.inference):
    rows[gi] = assignment[j]
  return rows


def _joint(problem: Problem, s: Search, train_idx, configs, slack, alternatives) -> list[Candidate]:
  """Steps 2 and 3 of the module docstring: the fastest plan, then the least-cost plan at
  ``T_best·(1 + slack)``."""
  fastest = _fastest(problem, s, train_idx, configs)
  if fastest is None:
    return []
  t_best = min(c.step_ms for c in [fastest] + [a for a in alternatives if a.fits and not a.reference])
  target = t_best * (1 + slack)
  out = [fastest]
  if train_idx:
    out += _least_cost(problem, s, train_idx, configs, target)
  best = min((c for c in out if c.step_ms <= target * (1 + 1e-9)), key=lambda c: c.cost, default=None)
  return [dataclasses.replace(best, name="joint")] + out[:1] if best is not None else out[:1]


def _fast_configs(s: Search, gi: int, rows: Sequence[Row]) -> list[Row]:
  """The configurations of group ``gi`` that no other one beats at every batch: another with
  ``a`` and ``s`` no larger and ``cap`` no smaller (identical models: the first kept)."""
  models = [s.affine(gi, r) for r in rows]

  def beats(k, i):
    m, o = models[k], models[i]
    return m.a <= o.a and m.s <= o.s and m.cap >= o.cap and (m != o or k < i)

  return [r for i, r in enumerate(rows) if not any(beats(k, i) for k in range(len(rows)) if k != i)]


def _fastest(problem: Problem, s: Search, train_idx, configs) -> Candidate | None:
  """Step 2 of the module docstring: the fastest replayed plan over every set of participating
  inference groups and combination of their fast configurations, visited in order of water
  level and cut off once the level exceeds the fastest replayed step (beyond ``MARGIN``)."""
  n = len(problem.groups)
  counts = [g.count for g in problem.cluster.groups]
  fast = {gi: _fast_configs(s, gi, configs[gi]) for gi in problem.inference}
  options = []
  for members_inf in _subsets(problem.inference):
    members = sorted(train_idx + list(members_inf))
    if not members:
      continue
    for combo in itertools.product(*(fast[gi] for gi in members_inf)):
      rows: list[Row] = [None] * n
      for gi, row in zip(members_inf, combo):
        rows[gi] = row
      running = [gi in members for gi in range(n)]
      models = [s.affine(gi, rows[gi], running) for gi in members]
      level = water_level(s.B, [counts[gi] for gi in members], models, s.q)
      if level < math.inf:
        options.append((level, members, rows))
  best = None
  for level, members, rows in sorted(options, key=lambda o: o[0]):
    if best is not None and level > best.step_ms * (1 + MARGIN):
      break
    split = s.fastest_split(members, rows)
    if split is not None:
      cand = s.candidate("fastest", split, rows)
      if best is None or cand.step_ms < best.step_ms:
        best = cand
  return best


def _least_cost(problem: Problem, s: Search, train_idx, configs, target) -> list[Candidate]:
  """Step 3 of the module docstring: the plans at ``target`` that the greedy was run for and
  that keep pace, and the training groups alone if they can take the whole batch (only they,
  if that costs 0)."""
  alone = _training_only(problem, s, train_idx, target)
  if alone is not None and alone.cost == 0:
    return [alone]
  order = itertools.count()
  queue = []  # (estimated cost, order, batches, Share)

  def push(share):
    found = share.cheapest(s, configs) if share is not None else None
    if found is not None:
      heapq.heappush(queue, (found[0], next(order), found[1], share))

  for members in _subsets(problem.inference):
    if members:
      push(_share(problem, s, train_idx, members, configs, target, target))
  out, runs, seen = [] if alone is None else [alone], 0, set()
  while queue and (runs == 0 or runs < GREEDY_RUNS) and not any(c.cost == 0 for c in out):
    _, _, batches, share = heapq.heappop(queue)
    if (tuple(batches), share.goal) in seen:
      continue
    seen.add((tuple(batches), share.goal))
    cand, runs, goal, highest = _greedy_split(problem, s, share, batches, configs, target, runs)
    if cand is not None:
      out.append(cand)
      for est, near in share.neighbours(s, configs, batches):
        heapq.heappush(queue, (est, next(order), near, share))
    else:
      push(_share(problem, s, train_idx, share.members, configs, target, goal, highest))
  return out


@dataclasses.dataclass(frozen=True)
class Share:
  """The inference groups ``members`` sharing what the training groups leave (step 3 of the
  module docstring): ``batches`` has the training groups' batch (0 elsewhere); each member's
  greedy targets ``goal``, and member ``gi`` takes a batch of at most ``highest[gi]``. Where the
  training groups cost something (8-bit ops: ``Search.training_cost``), their batch is at most
  that of ``batches`` and is chosen with the members' (``cheapest``)."""

  batches: tuple[int, ...]
  members: tuple[int, ...]
  goal: float
  highest: dict[int, int]

  def training_table(self, s: Search) -> list[float] | None:
    """``[the training groups' cost at batch k·q for k = 0 … their batch in batches / q]`` (k = 0:
    inf; every batch up to theirs keeps pace, the step rising with the batch), or None where they
    cost nothing (then they take their batch in ``batches``)."""
    if s.training_cost(self.batches) == 0:
      return None
    top = max(self.batches) // s.q
    train = [b > 0 for b in self.batches]
    return [math.inf] + [s.training_cost([k * s.q if t else 0 for t in train]) for k in range(1, top + 1)]

  def tables(self, s: Search, configs) -> list[list[float]]:
    """Each member's ``_cost_table`` at ``goal`` (affine steps within ``goal·(1 + MARGIN)``)."""
    running = [b > 0 or gi in self.members for gi, b in enumerate(self.batches)]
    limit = self.goal * (1 + MARGIN)
    out = []
    for gi in self.members:
      high = max(s.affine(gi, r, running).largest_batch(limit, s.q) for r in configs[gi])
      out.append(_cost_table(s, gi, configs[gi], running, min(high, self.highest[gi]), limit))
    return out

  def cheapest(self, s: Search, configs) -> tuple[float, list[int]] | None:
    """(estimated cost, batches) of the split of the rest of least estimated cost, or None; where
    the training groups cost something, of the whole batch over them (one batch for all, up to
    theirs in ``batches``: ``training_table``) and the members."""
    counts = [g.count for g in s.p.cluster.groups]
    training = self.training_table(s)
    if training is None:
      rest = s.B - sum(c * b for c, b in zip(counts, self.batches))
      found = cheapest_split(rest, [counts[gi] for gi in self.members], self.tables(s, configs), s.q)
      if found is None:
        return None
      batches = list(self.batches)
      for gi, b in zip(self.members, found[1]):
        batches[gi] = b
      return found[0], batches
    train_count = sum(c for c, b in zip(counts, self.batches) if b > 0)
    member_counts = [counts[gi] for gi in self.members]
    found = cheapest_split(s.B, [train_count, *member_counts], [training, *self.tables(s, configs)], s.q)
    if found is None:
      return None
    batches = [found[1][0] if b > 0 else 0 for b in self.batches]
    for gi, b in zip(self.members, found[1][1:]):
      batches[gi] = b
    return found[0], batches

  def neighbours(self, s: Search, configs, batches) -> list[tuple[float, list[int]]]:
    """(estimated cost, batches) of the splits one granule from ``batches``: member i gains
    ``count_j/g·q`` examples per device and member j loses ``count_i/g·q`` (g their gcd), so
    the sum is kept (the training groups' batch too); those with a finite estimate."""
    counts = [g.count for g in s.p.cluster.groups]
    tables = dict(zip(self.members, self.tables(s, configs)))
    out = []
    for i, j in itertools.permutations(self.members, 2):
      g = math.gcd(counts[i], counts[j])
      near = list(batches)
      near[i] += counts[j] // g * s.q
      near[j] -= counts[i] // g * s.q
      ks = {gi: near[gi] // s.q for gi in self.members}
      if all(1 <= ks[gi] < len(tables[gi]) for gi in self.members):
        est = sum(tables[gi][ks[gi]] for gi in self.members) + s.training_cost(near)
        if est < math.inf:
          out.append((est, near))
    return out


def _share(
  problem: Problem, s: Search, train_idx, members, configs, target, goal, highest=None
) -> Share | None:
  """The ``Share`` of ``members`` at ``goal`` (≤ ``target``): the training groups at the largest
  batch whose replayed step keeps pace with it (or smaller, while the rest cannot be split at
  an affine step within ``goal·(1 + MARGIN)``; where they cost something, that batch is their
  most: ``Share.cheapest``); None if no batch leaves a split."""
  n, q, B = len(problem.groups), s.q, s.B
  counts = [g.count for g in problem.cluster.groups]
  limit = goal * (1 + MARGIN)
  running = [gi in train_idx or gi in members for gi in range(n)]
  train_count = sum(counts[gi] for gi in train_idx)
  room = sum(
    counts[gi] * max(s.affine(gi, r, running).largest_batch(limit, q) for r in configs[gi]) for gi in members
  )
  top = min(s.affine(gi, None, running).largest_batch(limit, q) for gi in train_idx)
  top = min(top, (B - q * sum(counts[gi] for gi in members)) // train_count // q * q)
  b_train = largest_true(lambda b: _training_step(s, train_idx, b, running) <= goal * (1 + 1e-9), q, top, q)
  highest = highest if highest is not None else {gi: B for gi in members}
  while b_train >= q and B - train_count * b_train <= room:
    share = Share(tuple(b_train if gi in train_idx else 0 for gi in range(n)), members, goal, highest)
    if share.cheapest(s, configs) is not None:
      return share
    if share.training_table(s) is not None:
      return None  # its split already ranged over every training batch up to b_train
    b_train -= q
  return None


def _training_step(s: Search, train_idx, b: int, running) -> float:
  """The replayed step of the training groups alone at batch ``b`` (the all-reduce of ``running``)."""
  n = len(s.p.groups)
  return s.step([b if gi in train_idx else 0 for gi in range(n)], [None] * n, running)


def _greedy_split(problem: Problem, s: Search, share: Share, batches, configs, target, runs):
  """``(candidate, runs, goal, highest)``: the greedy's precisions for each member of ``share``
  at its batch in ``batches``, against ``share.goal``; the candidate is None unless its replayed
  plan keeps pace with ``target``. ``runs``: the greedy runs spent, so far and here; none are
  started beyond ``GREEDY_RUNS`` (the first split's always are). ``goal`` and ``highest``: the
  share's, or what this split taught where there is no candidate:

  * a member whose configurations (those that fit) are all slower than the goal alone at its
    batch (replayed; no greedy is run then), or whose greedy straggles, may take no more than
    ``_pace_batch`` (``highest``);
  * a plan slower than ``target`` (the groups' all-reduces wait on each other) lowers the goal
    by twice that overhead: the replayed step minus the slowest group's step alone.
  """
  members, goal, n = share.members, share.goal, len(problem.groups)
  highest = {gi: _pace_batch(s, gi, batches, configs[gi], goal) for gi in members}
  if all(highest[gi] >= batches[gi] for gi in members):
    mask = tuple(b > 0 for b in batches)
    new = sum((gi, batches[gi], mask, goal) not in s._greedy for gi in members)
    if runs and runs + new > GREEDY_RUNS:
      return None, GREEDY_RUNS, goal, share.highest
    runs += new
    found = {gi: _greedy_at(problem, s, gi, batches, goal) for gi in members}
    for gi in members:
      if found[gi][0] is None:
        highest[gi] = batches[gi] - s.q
  stragglers = [gi for gi in members if highest[gi] < batches[gi]]
  if stragglers:
    return None, runs, goal, {**share.highest, **{gi: highest[gi] for gi in stragglers}}
  rows: list[Row] = [found[gi][0] if gi in members else None for gi in range(n)]
  cand = s.candidate("joint", batches, rows)
  if cand.step_ms <= target * (1 + 1e-9):
    return cand, runs, goal, share.highest
  train_idx = [gi for gi in range(n) if gi not in problem.inference]
  alone = [found[gi][1] for gi in members] + [_training_step(s, train_idx, batches[train_idx[0]], batches)]
  return None, runs, goal - 2 * (cand.step_ms - max(alone)), share.highest


def _pace_batch(s: Search, gi: int, batches, rows: Sequence[Row], goal: float) -> int:
  """Group ``gi``'s batch ``b`` in ``batches`` if a configuration of ``rows`` that fits it keeps
  pace with ``goal`` alone there (replayed with the all-reduce of the groups that run, fastest by
  the affine model first); else the largest batch below ``b`` that the configurations' misses
  allow: ``b`` less each miss (replayed, or affine where the configuration does not fit ``b``)
  over its slope ``s``, the largest over the configurations (the step is convex in the batch, so
  its slope below ``b`` is at most ``s``)."""
  b, q = batches[gi], s.q
  running = [b > 0 for b in batches]
  models = [(s.affine(gi, r, running), k, r) for k, r in enumerate(rows)]
  cut = math.inf
  for model, _, row in sorted(models, key=lambda m: (m[0].step_ms(b), m[1])):
    fits = model.cap >= b
    miss = (s._alone(gi, b, row, running) if fits else model.step_ms(b)) - goal * (1 + 1e-9)
    if miss <= 0 and fits:
      return b
    cut = min(cut, math.ceil(max(miss, 0) / (model.s * q)) if model.s > 0 else math.inf)
  return b - q * max(cut, 1) if cut < math.inf else 0


def _training_only(problem: Problem, s: Search, train_idx, target) -> Candidate | None:
  """The training groups alone at one batch that sums to B, if it fits and keeps pace with ``target``."""
  n, total = len(problem.groups), sum(problem.cluster.groups[gi].count for gi in train_idx)
  b, rem = divmod(s.B, total)
  if rem or b % s.q or any(s.affine(gi, None).cap < b for gi in train_idx):
    return None
  cand = s.candidate("training groups only", [b if gi in train_idx else 0 for gi in range(n)], [None] * n)
  return cand if cand.step_ms <= target * (1 + 1e-9) else None


def _cost_table(s: Search, gi: int, rows: Sequence[Row], running, high: int, limit: float) -> list[float]:
  """``[estimated cost of group gi at batch k·q for k = 0 … high/q]`` at step ``limit``: its
  share times the lower convex hull of its configurations' (affine step with the all-reduce of
  ``running``, cost per share) at ``limit`` (configurations that do not fit the batch left out;
  k = 0: inf)."""
  models = [(s.affine(gi, r, running), s.row_cost(gi, r)) for r in rows]
  count = s.p.cluster.groups[gi].count
  table = [math.inf]
  for b in range(s.q, high + 1, s.q):
    points = [(m.step_ms(b), c) for m, c in models if b <= m.cap]
    table.append(count * b / s.B * hull_cost(points, limit))
  return table


def _greedy_at(problem: Problem, s: Search, gi: int, batches: Sequence[int], target: float):
  """``(levels, step)`` of the allocator's greedy for inference group ``gi`` alone at its batch
  in ``batches`` (the all-reduce of every group that runs there) against ``target``; ``(None,
  inf)`` if it cannot keep pace or fit. Memoized on (group, batch, groups that run, target)."""
  key = (gi, batches[gi], tuple(b > 0 for b in batches), target)
  if key not in s._greedy:
    j = problem.inference.index(gi)
    cluster = problem.cluster.with_batch_per_device({g.name: b for g, b in zip(problem.groups, batches)})
    group = dataclasses.replace(problem.groups[gi], batch_per_device=batches[gi])
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
      s.replays += alloc.replays
      s._greedy[key] = (None, math.inf) if alloc.straggles else (alloc.assignment[0], alloc.step_ms)
    except PlanError:
      s._greedy[key] = (None, math.inf)
  return s._greedy[key]


def plan_of(problem: Problem, cand: Candidate, predictions=None):
  """The ``Plan`` of a candidate: per-op rules on inference groups that run, the training
  precision on the others, every group's per-device batch (0: out) and micro-steps (where not 1)."""
  rows = tuple(
    cand.rows[gi] if cand.rows[gi] is not None else uniform_levels(problem, j, "fp32")
    for j, gi in enumerate(problem.inference)
  )
  moded = dataclasses.replace(problem, reduction=cand.mode[0], optimizer_update=cand.mode[1], sync=cand.sync)
  if cand.train_ops is not None:  # a baseline at the training groups' 8-bit auto policy
    moded = dataclasses.replace(moded, train_ops=cand.train_ops)
  plan = to_plan(moded, rows, predictions)
  return dataclasses.replace(
    plan,
    batch_per_device={g.name: b for g, b in zip(problem.groups, cand.batches)},
    micro_steps={g.name: k for g, k in zip(problem.groups, cand.micro_steps) if k != 1},
  )
