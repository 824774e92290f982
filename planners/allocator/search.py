"""The joint planner's candidates and the search state that replays them.

``Candidate``: one plan (per-device batch of every group, ladder levels of every inference
group, its predicted step and accuracy cost — the training groups' 8-bit ops included —, the
trainer mode it is predicted under).
``Search``: replays candidate plans of a ``Problem`` (memoized: a plan is replayed once), fits
each group's affine step model and prices a plan's accuracy cost (``planners.allocator.joint``'s
module docstring).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence

from planners.allocator.greedy import Evaluator, Problem, floor_precision, memory_layout, uniform_levels
from planners.allocator.splits import Affine, fastest_splits, largest_true
from planners.indicator.payload_cost import payload_omega
from planners.predictor.memory_model import memory_bytes, program_memory_bytes
from planners.predictor.replay import comm_for, sync_step_ms
from planners.profile import GroupCost

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
  mode: tuple[str, str] = ("flat", "replicated")  # (reduction, optimizer_update) it is predicted under
  micro_steps: tuple[int, ...] = ()  # per group (``Plan.micro_steps``); empty: 1 everywhere
  sync: str = "fp32"  # the gradient sync it is predicted under (``planners.predictor.payload``)
  # the training groups' 8-bit ops where not the problem's; a baseline outside the plan's own space
  # (at another sync, or the training groups at 8 bits: ``planners.allocator.baselines``)
  train_ops: Mapping[str, Mapping[str, str]] | None = None
  reference: bool = False
  # the payload's accuracy cost, part of ``cost`` (``with_payload_cost``); None: not measured, 0 counted
  payload_cost: float | None = None

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
      "payload_accuracy_cost": self.payload_cost,
      "fits_memory": self.fits,
      "reduction": self.mode[0],
      "optimizer_update": self.mode[1],
      "sync": self.sync,
      **({"reference": True} if self.reference else {}),
      **(
        {"micro_steps": dict(zip((g.name for g in problem.groups), self.micro_steps))}
        if self.micro_steps
        else {}
      ),
    }


def running_devices(problem: Problem, batches: Sequence[int]) -> int:
  """The devices of the groups that run (``batches`` > 0 there)."""
  return sum(g.count for g, b in zip(problem.cluster.groups, batches) if b > 0)


def with_payload_cost(problem: Problem, cand: Candidate) -> Candidate:
  """``cand`` with the accuracy cost of its gradient payload added to ``cost`` and kept in
  ``payload_cost``: the indicator's measured Ω of its sync among the devices that run
  (``planners.indicator.payload_cost.payload_omega``; 0 for fp32, the reference). Where the indicator did
  not measure it, ``payload_cost`` is None and nothing is added: among plans within the slack the
  earlier sync then wins (``joint_plan``'s tie order, the widest payload first)."""
  omega = payload_omega(problem.payload, cand.sync, running_devices(problem, cand.batches))
  return dataclasses.replace(cand, cost=cand.cost + (omega or 0.0), payload_cost=omega)


def precision_counts(problem: Problem, cand: Candidate) -> dict[str, dict[str, int]]:
  """``{group: {precision: number of ops}}`` of the groups that run."""
  out = {}
  for gi, (g, b, row) in enumerate(zip(problem.groups, cand.batches, cand.rows)):
    if b == 0:
      continue
    if row is None:
      ops = (problem.train_ops if cand.train_ops is None else cand.train_ops).get(g.name, {})
      out[g.name] = dict(Counter(ops.get(op, problem.train_policy) for op in problem.op_names))
      continue
    j = problem.inference.index(gi)
    counts: dict[str, int] = {}
    for i, lv in enumerate(row):
      p = problem.ladders[j][i][lv][0]
      counts[p] = counts.get(p, 0) + 1
    out[g.name] = counts
  return out


class Search:
  """Replays candidate plans of ``problem`` (memoized: a plan is replayed once)."""

  def __init__(self, problem: Problem, granularity: int):
    self.p, self.q = problem, granularity
    self.ev = Evaluator(problem)
    self.B = problem.cluster.global_batch
    self.replays = 0
    self._comm: dict = {}
    self._steps: dict = {}
    self._affine: dict = {}
    self._greedy: dict = {}
    train = floor_precision(problem.train_policy)
    self.base = [uniform_levels(problem, j, train) for j in range(len(problem.inference))]

  def group_at(self, gi: int, b: int, row: Row) -> GroupCost:
    g = self.p.groups[gi]
    if row is None:
      return dataclasses.replace(g, batch_per_device=b)
    j = self.p.inference.index(gi)
    pols = {n: self.p.ladders[j][i][lv][1] for i, (n, lv) in enumerate(zip(self.p.op_names, row))}
    return dataclasses.replace(g, op_policies=pols, batch_per_device=b)

  def comm(self, batches: Sequence[int]):
    """The all-reduce of the groups that run (``batches`` > 0 there), memoized."""
    key = tuple(b > 0 for b in batches)
    if key not in self._comm:
      kept = {g.name: g.batch_per_device if run else 0 for g, run in zip(self.p.cluster.groups, key)}
      self._comm[key] = comm_for(
        self.p.cluster.with_batch_per_device(kept),
        self.p.bucket_bytes,
        reduction=self.p.reduction,
        optimizer_update=self.p.optimizer_update,
        sync=self.p.sync,
      )
    return self._comm[key]

  def step(
    self,
    batches: Sequence[int],
    rows: Sequence[Row],
    comm_batches: Sequence[int] | None = None,
    micro_steps: Sequence[int] = (),
  ) -> float:
    """The predicted synchronous step of the groups that run (with the all-reduce of the
    groups that run in ``comm_batches``, default ``batches``), each in its ``micro_steps``
    (per group; empty: 1 everywhere)."""
    comm_batches = batches if comm_batches is None else comm_batches
    micro_steps = tuple(micro_steps) or (1,) * len(batches)
    key = (
      tuple(batches),
      tuple(r if b else None for b, r in zip(batches, rows)),
      tuple(b > 0 for b in comm_batches),
      micro_steps,
    )
    if key not in self._steps:
      self.replays += 1
      groups = [
        dataclasses.replace(self.group_at(gi, b, r), micro_steps=k)
        for gi, (b, r, k) in enumerate(zip(batches, rows, micro_steps))
        if b > 0
      ]
      self._steps[key] = sync_step_ms(groups, self.comm(comm_batches), self.ev.cost)
    return self._steps[key]

  def max_batch(self, gi: int, row: Row) -> int:
    """The largest per-device batch (multiple of q, ≤ B / count) that fits the group's memory (0: none)."""
    cap = self.B // self.p.cluster.groups[gi].count // self.q * self.q
    return largest_true(lambda b: self.fits(gi, b, row), self.q, cap, self.q)

  def affine(self, gi: int, row: Row, running: Sequence[int] | None = None) -> Affine:
    """Group ``gi``'s affine step under ``row`` (module docstring), memoized; with ``running``
    (per group, > 0 where it runs), ``a`` moved by that set's all-reduce: by the difference of
    the group's replays with it and with the whole cluster's, at the training precision and
    its largest batch that fits (nothing if none fits)."""
    if (gi, row) not in self._affine:
      cap = self.max_batch(gi, row)
      if cap < self.q:
        model = Affine(math.inf, 0.0, cap)
      else:
        lo = max(self.q, cap // 2 // self.q * self.q)
        hi = max(cap, lo + self.q)
        t_lo, t_hi = self._alone(gi, lo, row), self._alone(gi, hi, row)
        slope = (t_hi - t_lo) / (hi - lo)
        model = Affine(t_lo - slope * lo, slope, cap) if slope > 0 else Affine(max(t_lo, t_hi), 0.0, cap)
      self._affine[gi, row] = model
    model = self._affine[gi, row]
    mask = tuple(b > 0 for b in running) if running is not None else (True,) * len(self.p.groups)
    if all(mask):
      return model
    base = None if gi not in self.p.inference else self.base[self.p.inference.index(gi)]
    ref = self.affine(gi, base).cap
    if ref < self.q:
      return model
    shift = self._alone(gi, ref, base, mask) - self._alone(gi, ref, base)
    return dataclasses.replace(model, a=model.a + shift)

  def row_cost(self, gi: int, row: Row) -> float:
    """The accuracy cost of group ``gi`` under ``row`` per unit of share (module docstring): an
    inference group's ops' Ω above the training precision's; a training group's
    ``Problem.train_cost`` (its 8-bit ops', 0 without any)."""
    if gi not in self.p.inference:
      return self.p.train_cost.get(self.p.groups[gi].name, 0.0)
    if row is None:
      return 0.0
    j = self.p.inference.index(gi)
    om, base = self.p.omega[j], self.base[j]
    return sum(max(0.0, om[i][lv] - om[i][base[i]]) for i, lv in enumerate(row))

  def cost(self, batches: Sequence[int], rows: Sequence[Row]) -> float:
    """The accuracy cost (module docstring): ``Σ_groups that run (count·batch / B) · row_cost``; Ω
    counts above the training precision's, on the training groups' 8-bit ops too."""
    counts = [g.count for g in self.p.cluster.groups]
    return sum(
      c * b / self.B * self.row_cost(gi, r) for gi, (c, b, r) in enumerate(zip(counts, batches, rows)) if b
    )

  def training_cost(self, batches: Sequence[int]) -> float:
    """The training groups' part of ``cost(batches, …)``: their 8-bit ops' Ω times their share."""
    train = [0 if gi in self.p.inference else b for gi, b in enumerate(batches)]
    return self.cost(train, [None] * len(train))

  def layout(self, batches: Sequence[int] | None = None) -> dict[str, int]:
    """``memory_bytes``' ``optimizer_shards`` and ``devices`` for the groups that run
    (``batches`` > 0 there; default every group): ``memory_layout``."""
    groups = self.p.cluster.groups
    running = sum(g.count for g, b in zip(groups, batches or [1] * len(groups)) if b > 0)
    return memory_layout(self.p.optimizer_update, running)

  def fits(self, gi: int, b: int, row: Row, layout: dict | None = None, micro_steps: int = 1) -> bool:
    """Group ``gi`` at batch ``b`` (in ``micro_steps``) under ``row`` fits its memory, its
    optimizer state and gradients held as ``layout`` says (default ``layout()``: every device of
    the cluster runs)."""
    limit = self.p.cluster.groups[gi].memory_gb * 1e9
    group = dataclasses.replace(self.group_at(gi, b, row), micro_steps=micro_steps)
    return memory_bytes(group, self.ev.op_memory, **(layout or self.layout())) <= limit

  def plan_fits(
    self, batches: Sequence[int], rows: Sequence[Row], micro_steps: Sequence[int] | None = None
  ) -> bool:
    """Every device that runs holds what the plan's one program needs there: every running
    group's branch, the input at the largest batch (``program_memory_bytes``). ``fits`` of each
    group alone is necessary, not sufficient."""
    micro_steps = micro_steps or [1] * len(batches)
    groups = [
      dataclasses.replace(self.group_at(gi, b, r), micro_steps=k)
      for gi, (b, r, k) in enumerate(zip(batches, rows, micro_steps))
      if b
    ]
    need = program_memory_bytes(groups, self.ev.op_memory, **self.layout(batches))
    limits = {g.name: g.memory_gb * 1e9 for g in self.p.cluster.groups}
    return all(need[name] <= limits[name] for name in need)

  def candidate(self, name: str, batches: Sequence[int], rows: Sequence[Row]) -> Candidate:
    rows = tuple(r if b else None for b, r in zip(batches, rows))
    layout = self.layout(batches)
    fits = all(self.fits(gi, b, r, layout) for gi, (b, r) in enumerate(zip(batches, rows)) if b)
    fits = fits and self.plan_fits(batches, rows)
    step, cost = self.step(batches, rows), self.cost(batches, rows)
    mode = (self.p.reduction, self.p.optimizer_update)
    return Candidate(name, tuple(batches), rows, step, cost, self.B, fits, mode, sync=self.p.sync)

  def micro_steps_to_fit(self, gi: int, b: int, row: Row, layout: dict) -> int | None:
    """The fewest micro-steps ``k`` (a divisor of ``b``) in which group ``gi`` at per-device batch
    ``b`` under ``row`` fits its memory (1: without accumulating), or None where even one
    example a micro-step does not."""
    for k in range(1, b + 1):
      if b % k == 0 and self.fits(gi, b, row, layout, micro_steps=k):
        return k
    return None

  def micro_steps_for_program(
    self, batches: Sequence[int], rows: Sequence[Row], micro: Sequence[int]
  ) -> list[int]:
    """``micro`` (each group's fewest micro-steps alone), raised where the plan's one program does
    not fit every device (``plan_fits``: each device holds the costliest branch): the group with the
    largest micro-batch takes its next divisor of micro-steps first, until the program fits or no
    group can take more (then ``micro`` as far as it got; the candidate does not fit)."""
    micro = list(micro)
    while not self.plan_fits(batches, rows, micro):
      growable = [gi for gi, b in enumerate(batches) if b and micro[gi] < b]
      if not growable:
        break
      gi = max(growable, key=lambda i: (batches[i] / micro[i], -i))
      micro[gi] = next(k for k in range(micro[gi] + 1, batches[gi] + 1) if batches[gi] % k == 0)
    return micro

  def accumulating(self, name: str, batches: Sequence[int], rows: Sequence[Row]) -> Candidate | None:
    """The candidate of ``batches`` under ``rows`` where every group that runs takes the fewest
    micro-steps it fits in (``micro_steps_to_fit``; the trainer's ``Plan.micro_steps``), more where
    the plan's program needs them (``micro_steps_for_program``), priced
    with them (each micro-step pays the profile's batch-independent share again:
    ``GroupCost.compute_scale``); None where a group does not fit even one example a
    micro-step (its ``fits``: whether the plan's program fits every device, ``plan_fits``)."""
    rows = tuple(r if b else None for b, r in zip(batches, rows))
    layout, micro = self.layout(batches), []
    for gi, (b, r) in enumerate(zip(batches, rows)):
      k = self.micro_steps_to_fit(gi, b, r, layout) if b else 1
      if k is None:
        return None
      micro.append(k)
    micro = self.micro_steps_for_program(batches, rows, micro)
    step = self.step(batches, rows, micro_steps=micro)
    mode = (self.p.reduction, self.p.optimizer_update)
    return Candidate(
      name,
      tuple(batches),
      rows,
      step,
      self.cost(batches, rows),
      self.B,
      self.plan_fits(batches, rows, micro),
      mode,
      tuple(micro),
      self.p.sync,
    )

  def unbounded_affine(self, gi: int, row: Row) -> Affine:
    """Group ``gi``'s affine step under ``row`` as ``affine`` fits it, but through its replays at
    half and all of the largest batch it could take (``B / count``), whatever its memory: the
    split of a plan that accumulates where a batch does not fit at once."""
    key = ("unbounded", gi, row)
    if key not in self._affine:
      cap = self.B // self.p.cluster.groups[gi].count // self.q * self.q
      lo = max(self.q, cap // 2 // self.q * self.q)
      hi = max(cap, lo + self.q)
      t_lo, t_hi = self._alone(gi, lo, row), self._alone(gi, hi, row)
      slope = (t_hi - t_lo) / (hi - lo)
      self._affine[key] = (
        Affine(t_lo - slope * lo, slope, cap) if slope > 0 else Affine(max(t_lo, t_hi), 0.0, cap)
      )
    return self._affine[key]

  def fastest_split(
    self, members: Sequence[int], rows: Sequence[Row], keep: int = 3
  ) -> tuple[int, ...] | None:
    """The split of B over ``members`` (group indices; the others get 0) with the least
    replayed step under ``rows`` among the ``keep`` of least affine step, or None if no split
    fits."""
    members = list(members)
    running = [gi in members for gi in range(len(self.p.groups))]
    models = [self.affine(gi, rows[gi], running) for gi in members]
    counts = [self.p.cluster.groups[gi].count for gi in members]
    best, best_ms = None, math.inf
    for split in fastest_splits(self.B, counts, models, self.q, keep):
      batches = [0] * len(self.p.groups)
      for gi, b in zip(members, split):
        batches[gi] = b
      ms = self.step(batches, rows)
      if ms < best_ms:
        best, best_ms = tuple(batches), ms
    return best

  def _alone(self, gi: int, b: int, row: Row, running: Sequence[bool] | None = None) -> float:
    """Group ``gi``'s replayed step alone at batch ``b`` under ``row``, with the all-reduce of
    the groups ``running`` (default: the whole cluster), memoized."""
    mask = tuple(running) if running is not None else (True,) * len(self.p.groups)
    key = ("alone", gi, b, row, mask)
    if key not in self._steps:
      self.replays += 1
      together = True if sum(mask) > 1 else None  # a group beside others runs in a switch branch
      self._steps[key] = sync_step_ms([self.group_at(gi, b, row)], self.comm(mask), self.ev.cost, together)
    return self._steps[key]
