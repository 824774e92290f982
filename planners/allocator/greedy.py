"""Allocator: one precision per op on each inference group (QSync's greedy allocator, fixed).

Inputs: the cluster, the cost profiles, a sensitivity table ``Ω[op][precision]`` (the
indicator's JSON) and which groups are *training* groups (they keep ``train_policy``).

For every op of an inference group, its *ladder* is the precisions the table scores and the
device supports, one per bit width (the least sensitive of a width), ordered 8 → 16 → 19 →
32 bits; fp32 is always the top with Ω = 0. A precision becomes an op policy through
``LEVEL_POLICIES`` (int8 → QSync's int8 op: int8 forward, fp16 backward), or, with
``make_problem(int8_op="int8")``, int8 on all three legs (stochastically rounded gradients).
Ω scores an op's forward product either way.

1. ``start``: the predicted-fastest plan that fits memory, by the synchronous step (the
   quantity step 3 checks), among a handful of candidates per inference group: every op at its
   own fastest ladder level (the predicted time of its legs and casts), and each *uniform*
   plan (every op at the level of one precision name, or the op's nearest level above where
   its ladder lacks it). Per-op-fastest alone can be slower as a whole (it may move time
   into the backward pass and delay the overlapped all-reduce). With several inference
   groups the candidates are every group at one precision and one group changed at a time,
   repeated until no candidate is strictly faster; ties keep per-op-fastest. If
   per-op-fastest does not fit a group's memory, ops move to their least-memory level
   (largest saving first) until it fits; if even the least-memory plan does not fit,
   ``PlanError`` names the least memory the group needs.
2. ``T*``: the predicted synchronous step of the training groups alone (with the all-reduce
   over the whole cluster); if the inference groups are slower even at ``start``, T* is the
   step of ``start`` (they cannot keep pace; the plan says so).
3. A max-heap keyed by the Ω a move recovers above the training precision's,
   ``max(0, Ω(level) − Ω_train) − max(0, Ω(next level) − Ω_train)``, recovers the most
   sensitive op first: pop, build the candidate plan with that op one level up, accept it only
   if every group's memory fits and the predicted synchronous step is ≤ T*, then push the op's
   next level. A move that recovers nothing (e.g. fp16 → fp32 when the training groups run
   fp16: the accuracy cost counts Ω above theirs) is never made. With fp32 training this is
   QSync's ``Ω(level) − Ω(next level)``. Plans are immutable tuples, so a rejected move leaves
   no trace.

A plan's Ω (``Allocation.omega``) is QSync's Σ Ω over the inference groups' ops, plus, for each
training group that runs ops at 8 bits (``make_problem(train_ops=…)``), those ops' Ω above the
training precision's (``Problem.train_cost``): the same for every assignment, so it moves no
choice.

``planners.allocator.exhaustive`` searches every combination of ladder levels for the plan of least total Ω
under the same constraints (small graphs only). ``planners.allocator.joint`` chooses the groups'
batches too, with ``greedy`` for the precisions at each batch.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from planners.indicator.coverage import warn_unscored
from planners.predictor.graph import DEFAULT_BUCKET_BYTES, op_costs
from planners.predictor.memory_model import memory_bytes, op_memory, residual_bytes
from planners.predictor.replay import comm_for, profile_for, sync_step_ms
from planners.profile import GroupCost, Profile
from qsync_jax import devices
from qsync_jax.cluster import ClusterSpec
from qsync_jax.devices import supported_precisions
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import PRECISION_BITS, OpPolicy

LEVEL_POLICIES: dict[str, str] = {
  "int8": "int8_fwd",
  "fp8": "fp8",
  "fp16": "fp16",
  "bf16": "bf16",
  "tf32": "tf32",
  "fp32": "fp32",
}
"""Op policy (preset) an allocator level stands for."""


def omega_table(indicator: Mapping[str, Any]) -> dict[str, dict[str, float]]:
  """``{op: {precision: Ω}}`` from an indicator JSON (``{"omega": …}``) or the bare table."""
  table = indicator.get("omega", indicator) if isinstance(indicator, Mapping) else None
  if not isinstance(table, Mapping):
    raise PlanError(
      "the indicator must be a JSON object {op: {precision: omega}} (or `qsync indicator` output). "
      "Fix: pass the file `qsync indicator` wrote."
    )
  return {op: {p: float(v) for p, v in row.items()} for op, row in table.items()}


def omega_of(omega: Mapping[str, Mapping[str, float]], op: str, precision: str) -> float:
  """``omega[op][precision]``; ``PlanError`` naming the op and the precision where the table lacks
  it or it is not finite."""
  try:
    value = float(omega[op][precision])
  except KeyError:
    raise PlanError(
      f"the indicator has no Ω for op {op!r} at {precision!r}. "
      f"Fix: run `qsync indicator --precisions {precision}` on this model."
    ) from None
  if not math.isfinite(value):
    raise PlanError(f"the indicator's Ω of {op!r} at {precision!r} is {value}. Fix: recompute the indicator.")
  return value


def floor_precision(train_policy: str) -> str:
  """The precision the accuracy cost counts Ω above: the training preset where it names a
  precision, else fp32 (Ω 0)."""
  return train_policy if train_policy in PRECISION_BITS else "fp32"


def training_cost_per_share(
  omega: Mapping[str, Mapping[str, float]], train_policy: str, eight_bit: Mapping[str, str]
) -> float:
  """A training group's accuracy cost per unit of batch share: its 8-bit ops' Ω above the training
  precision's. Equivalent to::

    train = floor_precision(train_policy)
    sum(max(0, omega[op][PRESETS[p].fwd] - (0 if train == "fp32" else omega[op].get(train, 0)))
        for op, p in eight_bit.items())

  (Ω scores an op's forward product; where the table does not score the training precision, the
  op's Ω counts above fp32's 0.) ``PlanError`` (``omega_of``) where the table lacks an op's Ω at its
  8-bit precision."""
  train = floor_precision(train_policy)
  total = 0.0
  for op, preset in sorted(eight_bit.items()):
    floor = 0.0 if train == "fp32" else omega.get(op, {}).get(train, 0.0)
    total += max(0.0, omega_of(omega, op, OpPolicy.preset(preset).fwd) - floor)
  return total


@dataclasses.dataclass(frozen=True)
class Problem:
  """Everything the search needs, precomputed. ``ladders[g][i]`` lists (precision, OpPolicy)."""

  cluster: ClusterSpec
  groups: tuple[GroupCost, ...]  # training groups carry their fixed policies
  inference: tuple[int, ...]  # indices into groups
  op_names: tuple[str, ...]
  ladders: tuple[tuple[tuple[tuple[str, OpPolicy], ...], ...], ...]  # [inference j][op i]
  omega: tuple[tuple[tuple[float, ...], ...], ...]  # [inference j][op i][level]
  limits: tuple[int, ...]  # memory per inference group, bytes
  bucket_bytes: int
  train_policy: str = "fp32"
  train_ops: Mapping[str, Mapping[str, str]] = dataclasses.field(
    default_factory=dict
  )  # training group → op → 8-bit preset
  train_cost: Mapping[str, float] = dataclasses.field(
    default_factory=dict
  )  # training group → accuracy cost per unit of batch share (``training_cost_per_share``)
  reduction: str = "flat"  # the plan's gradient reduction, optimizer update and sync (``qsync_jax.plan``)
  optimizer_update: str = "replicated"
  sync: str = "fp32"
  omega_by_op: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)  # the indicator's
  payload: Mapping[str, Any] | None = (
    None  # the indicator's measured payloads (``planners.indicator.payload_cost``)
  )


Assignment = tuple[tuple[int, ...], ...]
"""Ladder level of every op, per inference group."""


INT8_OPS = ("int8_fwd", "int8")
"""What the int8 level runs: QSync's int8 op (int8 forward, fp16 backward), or int8 on every leg."""


def _ladder(
  ops_omega: Mapping[str, float],
  device_type: str,
  runs_8bit: bool = True,
  levels: Mapping[str, str] = LEVEL_POLICIES,
) -> list[tuple[str, float]]:
  supported = supported_precisions(device_type) if runs_8bit else ("fp32", "tf32", "bf16", "fp16")
  best: dict[int, tuple[str, float]] = {}
  for p, w in ops_omega.items():
    if p not in levels or p == "fp32":
      continue
    preset = OpPolicy.preset(levels[p])
    if not all(leg in supported for leg in preset.precisions):
      continue
    bits = PRECISION_BITS[p]
    if bits not in best or w < best[bits][1]:
      best[bits] = (p, w)
  return [best[b] for b in sorted(best)] + [("fp32", 0.0)]


def make_problem(
  cluster: ClusterSpec,
  profiles: Mapping[str, Profile],
  indicator: Mapping[str, Any],
  training_groups: Sequence[str] | None = None,
  train_policy: str = "fp32",
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  int8_op: str = "int8_fwd",
  train_ops: Mapping[str, Mapping[str, str]] | None = None,
) -> Problem:
  """Resolves profiles (each group's own, ``Profile.group``, over its device type's:
  ``profile_for``), ladders and Ω for every inference group of ``cluster``; the int8 level
  runs ``int8_op`` (one of ``INT8_OPS``). A training group runs ``train_policy`` on every op but
  those ``train_ops[group]`` names (op → an 8-bit preset: ``training_group_policy``). A
  ``QsyncWarning`` says when the indicator scores no op at an 8-bit precision an inference
  group's devices run (``planners.indicator.coverage``): no op can be planned at it."""
  train_ops = {name: dict(ops) for name, ops in (train_ops or {}).items()}
  if int8_op not in INT8_OPS:
    raise PlanError(f"int8_op={int8_op!r} is not one of {list(INT8_OPS)}. Fix: pick one of them.")
  levels = {**LEVEL_POLICIES, "int8": int8_op}
  omega = omega_table(indicator)
  training = tuple(training_groups) if training_groups is not None else default_training_groups(cluster)
  for name in training:
    cluster.group(name)
  groups, inference, ladders, omegas, limits = [], [], [], [], []
  op_names = None
  for g in cluster.groups:
    prof = profile_for(profiles, g.device_type, g.name)
    op_names = op_names or prof.op_names
    if g.name in training:
      policy = training_group_policy(train_policy, train_ops.get(g.name, {}))
      cost = GroupCost(g.name, prof, prof.policies(policy), g.batch_per_device)
      # the least any plan needs: one example per device, the optimizer state sharded over the cluster
      least = dataclasses.replace(cost, batch_per_device=1)
      need = memory_bytes(least, **memory_layout("sharded", cluster.num_devices))
      if need > g.memory_gb * 1e9:
        raise PlanError(
          f"training group {g.name!r} ({g.device_type}, {train_policy}) needs {math.ceil(need / 1e7) / 100:.2f} "
          f"GB per device even at 1 example per device with the optimizer state sharded, but has "
          f"memory_gb={g.memory_gb:g}. Fix: set memory_gb ≥ {math.ceil(need / 1e7) / 100:.2f} if the device has "
          "it, or plan it as an inference group (--training-groups)."
        )
      groups.append(cost)
      continue
    missing = [o for o in prof.op_names if o not in omega]
    if missing:
      raise PlanError(
        f"the indicator has no Ω for op(s) {missing[:3]}{'…' if len(missing) > 3 else ''} of model "
        f"{prof.model!r}. Fix: run `qsync indicator` on the same model as `qsync profile`."
      )
    rows = [_ladder(omega[op.name], g.device_type, op.runs_8bit, levels) for op in prof.ops]
    ladders.append(tuple(tuple((p, OpPolicy.preset(levels[p])) for p, _ in row) for row in rows))
    omegas.append(tuple(tuple(w for _, w in row) for row in rows))
    inference.append(len(groups))
    limits.append(int(g.memory_gb * 1e9))
    groups.append(GroupCost(g.name, prof, {}, g.batch_per_device))
  warn_unscored(omega, cluster, [g.name for g in cluster.groups if g.name not in training])
  eight_bit = {name: ops for name, ops in train_ops.items() if name in training and ops}
  return Problem(
    cluster,
    tuple(groups),
    tuple(inference),
    tuple(op_names),
    tuple(ladders),
    tuple(omegas),
    tuple(limits),
    bucket_bytes,
    train_policy,
    eight_bit,
    {name: training_cost_per_share(omega, train_policy, ops) for name, ops in eight_bit.items()},
    omega_by_op=omega,
    payload=indicator.get("payload"),
  )


def memory_layout(optimizer_update: str, devices: int) -> dict[str, int]:
  """``memory_bytes``' keywords for a step over ``devices`` devices: the optimizer state sharded
  over all of them under the ``"sharded"`` update."""
  return {"optimizer_shards": devices if optimizer_update == "sharded" else 1, "devices": devices}


def problem_layout(problem: Problem) -> dict[str, int]:
  """``memory_layout`` of ``problem``'s mode, every device of its cluster running."""
  return memory_layout(problem.optimizer_update, problem.cluster.num_devices)


def training_group_policy(preset: str, eight_bit: Mapping[str, str]) -> PrecisionPolicy:
  """``preset`` on every op but those of ``eight_bit`` (op → 8-bit preset), which run theirs (one
  exact rule each, sorted by op name); ``PrecisionPolicy.uniform(preset)`` without any."""
  if not eight_bit:
    return PrecisionPolicy.uniform(preset)
  ops = PrecisionPolicy.from_ops({op: OpPolicy.preset(p) for op, p in sorted(eight_bit.items())})
  return PrecisionPolicy(rules=ops.rules, default=OpPolicy.preset(preset))


def default_training_groups(cluster: ClusterSpec) -> tuple[str, ...]:
  """The groups of the device type that trains best by the catalog: the highest fp16 peak, ties
  broken by the higher memory bandwidth, then the larger memory (all groups of types equal on
  all three).

  fp16 is the one tensor-core precision every catalogued GPU runs (int8 peaks would rank a T4
  above a V100). Training reads and writes the weights, gradients and optimizer state every step
  and keeps the activations for the backward, so of two equal peaks the faster and larger memory
  trains faster: a V100 (125 TFLOP/s, 900 GB/s, 32 GB) is the training group next to an A10 (125
  TFLOP/s, 600 GB/s, 24 GB), as a user of both would choose."""

  def rank(g):
    spec = devices.device(g.device_type)
    return spec.peak_tflops.get("fp16", spec.peak_tflops["fp32"]), spec.mem_bw_gbps, spec.memory_gb

  best = max(rank(g) for g in cluster.groups)
  return tuple(g.name for g in cluster.groups if rank(g) == best)


class Evaluator:
  """Predicts candidate assignments; counts replays (an assignment is replayed once)."""

  def __init__(self, problem: Problem):
    self.problem = problem
    self.comm = comm_for(
      problem.cluster,
      problem.bucket_bytes,
      reduction=problem.reduction,
      optimizer_update=problem.optimizer_update,
      sync=problem.sync,
    )
    self.replays = 0
    self._costs: dict = {}
    self._steps: dict[Assignment, float] = {}
    self._memory: dict[tuple[int, int, tuple[int, ...] | None], int] = {}
    self._groups: dict[tuple[int, tuple[int, ...]], GroupCost] = {}
    # the training groups' part of ``omega``, the same for every assignment
    self.training_cost = sum(
      problem.train_cost.get(g.name, 0.0)
      for gi, g in enumerate(problem.groups)
      if gi not in problem.inference
    )

  def cost(self, group: GroupCost, op_index: int):
    """``graph.op_costs``, memoized on (group, batch, op, its policy)."""
    return self._memo(op_costs, group, op_index)

  def op_memory(self, group: GroupCost, op_index: int):
    """``memory_model.op_memory``, memoized likewise."""
    return self._memo(op_memory, group, op_index)

  def _memo(self, fn, group: GroupCost, op_index: int):
    # Keyed on the policy's identity (hashing the dataclass costs more than the lookup); the
    # entry holds the policy, so no other object can take its id while the entry lives.
    policy = group.op_policies.get(self.problem.op_names[op_index])
    key = (fn.__name__, group.name, group.batch_per_device, group.micro_steps, op_index, id(policy))
    hit = self._costs.get(key)
    if hit is None:
      hit = self._costs[key] = (policy, fn(group, op_index))
    return hit[1]

  def groups(self, assignment: Assignment) -> list[GroupCost]:
    out = list(self.problem.groups)
    for j, (gi, row) in enumerate(zip(self.problem.inference, assignment)):
      out[gi] = self.group(j, row)
    return out

  def group(self, j: int, row: tuple[int, ...]) -> GroupCost:
    """Inference group ``j`` with its ops at the ladder levels ``row``, memoized."""
    if (j, row) not in self._groups:
      p = self.problem
      pols = {name: p.ladders[j][i][lvl][1] for i, (name, lvl) in enumerate(zip(p.op_names, row))}
      self._groups[j, row] = dataclasses.replace(p.groups[p.inference[j]], op_policies=pols)
    return self._groups[j, row]

  def step_ms(self, assignment: Assignment) -> float:
    """The predicted synchronous step (ms), memoized on the assignment."""
    if assignment not in self._steps:
      self.replays += 1
      self._steps[assignment] = sync_step_ms(self.groups(assignment), self.comm, self.cost)
    return self._steps[assignment]

  def memory(self, assignment: Assignment) -> dict[str, int]:
    """Bytes per device of every group: the plan's one program holds every group's branch
    (``memory_model.program_memory_bytes``); a branch's bytes on a group's device memoized on
    (device group, branch group, the branch's levels)."""
    p = self.problem
    groups = self.groups(assignment)
    levels = dict(zip(p.inference, assignment))
    layout = {**problem_layout(p), "input_batch": max(g.batch_per_device for g in groups)}
    out = {}
    for gi, g in enumerate(groups):
      need = 0
      for hi, h in enumerate(groups):
        key = (gi, hi, levels.get(hi))
        if key not in self._memory:
          branch = dataclasses.replace(h, name=g.name, profile=g.profile)
          self._memory[key] = memory_bytes(branch, self.op_memory, **layout)
        need = max(need, self._memory[key])
      out[g.name] = need
    return out

  def fits(self, assignment: Assignment) -> bool:
    """Every device holds what the plan's program needs there (``memory``)."""
    limits = {g.name: g.memory_gb * 1e9 for g in self.problem.cluster.groups}
    return all(need <= limits[name] for name, need in self.memory(assignment).items())

  def training_step_ms(self) -> float:
    p = self.problem
    training = [g for i, g in enumerate(p.groups) if i not in p.inference]
    # beside inference groups the step is a switch over branches: no bucket leaves it early
    together = True if p.inference else None
    return sync_step_ms(training, self.comm, self.cost, together) if training else 0.0

  def omega(self, assignment: Assignment) -> float:
    """QSync's Σ Ω of the inference groups' ops at their levels, plus each training group's
    ``Problem.train_cost`` (its 8-bit ops' Ω above the training precision's); every group counted
    once, whatever its count and batch."""
    inference = sum(
      self.problem.omega[j][i][lvl] for j, row in enumerate(assignment) for i, lvl in enumerate(row)
    )
    return inference + self.training_cost


def _op_time(group: GroupCost, op_index: int) -> float:
  return sum(ms for ms, _ in op_costs(group, op_index).values())


def fastest_levels(problem: Problem, fit_memory: bool = True) -> Assignment:
  """Each op at its own fastest level; with ``fit_memory``, memory-reducing moves if that does
  not fit (PlanError if impossible)."""
  out = []
  for j, gi in enumerate(problem.inference):
    g = problem.groups[gi]
    prof = g.profile
    levels, mem_levels, savings = [], [], []
    for i, name in enumerate(problem.op_names):
      ladder = problem.ladders[j][i]
      times = [_op_time(dataclasses.replace(g, op_policies={name: pol}), i) for _, pol in ladder]
      fastest = min(range(len(ladder)), key=lambda lv: (times[lv], -lv))
      op = prof.ops[i].scaled(g.batch_per_device / prof.batch_per_device)
      mems = [residual_bytes(op, pol) for _, pol in ladder]
      least = min(range(len(ladder)), key=lambda lv: (mems[lv], times[lv]))
      levels.append(fastest)
      mem_levels.append(least)
      savings.append(mems[fastest] - mems[least])

    def mem(lv, j=j, g=g):
      pols = {n: problem.ladders[j][i][lv[i]][1] for i, n in enumerate(problem.op_names)}
      return memory_bytes(dataclasses.replace(g, op_policies=pols), **problem_layout(problem))

    limit = problem.limits[j] if fit_memory else math.inf
    for i in sorted(range(len(levels)), key=lambda i: -savings[i]):
      if mem(levels) <= limit:
        break
      levels[i] = mem_levels[i]
    if mem(levels) > limit:
      need = mem(mem_levels)
      raise PlanError(
        f"device group {g.name!r} ({prof.device_type}, {g.batch_per_device} per device) needs at least "
        f"{math.ceil(need / 1e7) / 100:.2f} GB per device even with every op at its least-memory precision, but has "
        f"memory_gb={limit / 1e9:g}. Fix: set memory_gb ≥ {math.ceil(need / 1e7) / 100:.2f}, lower its "
        "batch_per_device, or move it to a bigger device."
      )
    out.append(tuple(levels))
  return tuple(out)


def training_omega(problem: Problem) -> list[list[float]]:
  """Ω of every op of every inference group at the training precision's ladder level
  (``uniform_levels``): the accuracy cost counts Ω above it, so a move between levels at or below
  it (e.g. fp16 → fp32 when the training groups run fp16) recovers nothing."""
  train = floor_precision(problem.train_policy)
  return [
    [problem.omega[j][i][lv] for i, lv in enumerate(uniform_levels(problem, j, train))]
    for j in range(len(problem.inference))
  ]


def uniform_levels(problem: Problem, j: int, precision: str) -> tuple[int, ...]:
  """Inference group ``j`` with every op at ``precision``'s ladder level, or, where an op's
  ladder lacks it, at the op's lowest level of at least as many bits."""
  bits = PRECISION_BITS[precision]
  out = []
  for ladder in problem.ladders[j]:
    names = [p for p, _ in ladder]
    if precision in names:
      out.append(names.index(precision))
    else:
      out.append(next(lv for lv, p in enumerate(names) if PRECISION_BITS[p] >= bits))
  return tuple(out)


def start_assignment(problem: Problem, ev: Evaluator | None = None) -> Assignment:
  """The predicted-fastest plan that fits memory among per-op-fastest (``fastest_levels``) and
  the uniform plans of every ladder precision; see the module docstring, step 1.

  Candidates are replayed through ``ev`` (its replay count includes them)."""
  ev = ev or Evaluator(problem)
  fastest = fastest_levels(problem)
  names = sorted(
    {p for ladders in problem.ladders for lad in ladders for p, _ in lad},
    key=lambda p: (PRECISION_BITS[p], p),
  )
  groups = range(len(problem.inference))
  rows = [[fastest[j]] + [uniform_levels(problem, j, p) for p in names] for j in groups]
  joint = [tuple(rows[j][k] for j in groups) for k in range(1, len(names) + 1)]
  plan, best = fastest, ev.step_ms(fastest)

  def moves():  # every group at one precision, then one group at a time (the others kept)
    yield from joint
    for j in groups:
      for row in rows[j]:
        yield plan[:j] + (row,) + plan[j + 1 :]

  changed = True
  while changed:
    changed = False
    for cand in moves():
      if cand != plan and ev.fits(cand) and (step := ev.step_ms(cand)) < best:
        plan, best, changed = cand, step, True
  return plan


@dataclasses.dataclass(frozen=True)
class Allocation:
  """The allocator's result: an assignment, its plan, and how it was found."""

  assignment: Assignment
  plan: Plan
  step_ms: float
  target_ms: float
  omega: float
  replays: int
  straggles: bool


def to_plan(problem: Problem, assignment: Assignment, predictions: Mapping[str, Any] | None = None) -> Plan:
  """The ``Plan``: exact per-op rules on inference groups, the fixed policy on the others."""
  policies = {}
  inference = dict(zip(problem.inference, range(len(problem.inference))))
  for gi, g in enumerate(problem.groups):
    if gi in inference:
      j = inference[gi]
      ops = {
        n: problem.ladders[j][i][lv][1] for i, (n, lv) in enumerate(zip(problem.op_names, assignment[j]))
      }
      policies[g.name] = PrecisionPolicy.from_ops(ops)
    else:
      policies[g.name] = training_group_policy(problem.train_policy, problem.train_ops.get(g.name, {}))
  return Plan(
    policies=policies,
    predictions=dict(predictions or {}),
    reduction=problem.reduction,
    optimizer_update=problem.optimizer_update,
    sync=problem.sync,
  )


def finish(problem, ev, assignment, target, straggles) -> Allocation:
  """The ``Allocation`` of ``assignment`` (its plan with the predictions that justified it)."""
  step = ev.step_ms(assignment)
  preds = {
    "step_ms": step,
    "target_ms": target,
    "omega": ev.omega(assignment),
    "memory_bytes": ev.memory(assignment),
    "straggles": straggles,
    "levels": {
      problem.groups[gi].name: {
        n: problem.ladders[j][i][lv][0] for i, (n, lv) in enumerate(zip(problem.op_names, assignment[j]))
      }
      for j, gi in enumerate(problem.inference)
    },
  }
  plan = to_plan(problem, assignment, preds)
  return Allocation(assignment, plan, step, target, ev.omega(assignment), ev.replays, straggles)


def greedy(problem: Problem, rel_tol: float = 1e-9, target_ms: float | None = None) -> Allocation:
  """The greedy allocation; see the module docstring. ``target_ms`` replaces T* (the joint
  planner's target)."""
  ev = Evaluator(problem)
  plan = start_assignment(problem, ev)
  target = ev.training_step_ms() if target_ms is None else target_ms
  start_step = ev.step_ms(plan)
  straggles = start_step > target * (1 + rel_tol)
  if straggles or not problem.inference:
    target = max(target, start_step)
  limit = target * (1 + rel_tol)
  heap: list[tuple[float, int, int, int, int]] = []
  counter = itertools.count()

  floor = training_omega(problem)

  def push(j, i, lvl):
    if lvl + 1 < len(problem.ladders[j][i]):
      om, base = problem.omega[j][i], floor[j][i]
      key = max(0.0, om[lvl] - base) - max(0.0, om[lvl + 1] - base)
      if key > 0:  # a move that recovers no accuracy above the training precision's spends slack for nothing
        heapq.heappush(heap, (-key, next(counter), j, i, lvl))

  for j, row in enumerate(plan):
    for i, lvl in enumerate(row):
      push(j, i, lvl)
  while heap:
    _, _, j, i, lvl = heapq.heappop(heap)
    if plan[j][i] != lvl:
      continue
    row = list(plan[j])
    row[i] = lvl + 1
    cand = plan[:j] + (tuple(row),) + plan[j + 1 :]
    if not ev.fits(cand) or ev.step_ms(cand) > limit:
      continue  # rejected: ``plan`` is untouched
    plan = cand
    push(j, i, lvl + 1)
  return finish(problem, ev, plan, target, straggles)
