"""The baselines a plan is measured against, and the plans that accumulate gradients.

A plan's gain is against the fastest of the baselines (``planners.allocator.bound.BASELINES``): what
a pool does without precision planning, in every mode and sync the search covers —

* **equal batches** (plain data parallelism: the spec's batches), **dynamic batching** and **the
  training groups alone**, at the training precision (the joint search's own,
  ``planners.allocator.joint``);
* the same **accumulating** (``ACCUMULATING``), where their batches do not fit at once: each group
  in the fewest micro-steps it fits in (``Search.accumulating``), each micro-step paying the
  profile's batch-independent share again;
* the same at **each group's 8-bit auto policy** (``EIGHT_BIT``): every op of a group at its 8-bit
  level where the group's profile prices that level below the group's 16-bit one
  (``auto_rows``), what ``qsync plan --train-precision auto`` and ``qsync train --plan auto`` run on
  measured times (``planners.allocator.payoff``); here on the profile's times, measured or modeled.

``accumulating_plans`` are no baselines: where no split of the joint search fits at once, every
group at each combination of its configurations, in micro-steps.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from planners.allocator.greedy import Problem, training_cost_per_share
from planners.allocator.payoff import eight_bit_presets, paying_ops, profile_payoffs
from planners.allocator.search import Candidate, Row, Search
from planners.allocator.splits import fastest_splits
from planners.predictor.graph import op_costs
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy


def equal_accumulating(problem: Problem, s: Search, train_idx) -> Candidate | None:
  """The training groups alone, each device at its spec batch ``m`` per micro-step, ``k = B /
  sum(count·m)`` micro-steps (per-device batch ``k·m``), the inference groups out; None unless
  ``k`` is a whole number. Its step is the replay at batches ``k·m`` in ``k`` micro-steps (each
  paying the profile's batch-independent share, ``GroupCost.compute_scale``), its memory that
  of one micro-batch (``memory_bytes``)."""
  groups = problem.cluster.groups
  k, rem = divmod(s.B, sum(groups[gi].count * groups[gi].batch_per_device for gi in train_idx))
  if rem or k < 2:
    return None
  n = len(problem.groups)
  batches = [k * groups[gi].batch_per_device if gi in train_idx else 0 for gi in range(n)]
  micro_steps = tuple(k if gi in train_idx else 1 for gi in range(n))
  rows: list[Row] = [None] * n
  layout = s.layout(batches)
  fits = all(s.fits(gi, batches[gi], None, layout, micro_steps=k) for gi in train_idx)
  fits = fits and s.plan_fits(batches, rows, micro_steps)
  name = "training groups only, accumulating"
  return Candidate(
    name,
    tuple(batches),
    tuple(rows),
    s.step(batches, rows, micro_steps=micro_steps),
    s.cost(batches, rows),
    s.B,
    fits,
    (problem.reduction, problem.optimizer_update),
    micro_steps=micro_steps,
    sync=problem.sync,
  )


ACCUMULATING = {
  "training groups only": "training groups only, accumulating",
  "dynamic batching": "dynamic batching, accumulating",
}
"""The baselines that accumulate gradients where a group's batch does not fit at once."""


def _accumulating_split(
  s: Search, name: str, members: Sequence[int], rows: Sequence[Row]
) -> Candidate | None:
  """The global batch over ``members`` (group indices) under ``rows``, each group in the fewest
  micro-steps it fits in (``Search.accumulating``): of the ``ACCUMULATING_SPLITS`` splits of least
  affine step (``Search.unbounded_affine``: whatever the memory), the fastest replayed; None if
  none fits even one example a micro-step."""
  counts = [s.p.cluster.groups[gi].count for gi in members]
  models = [s.unbounded_affine(gi, rows[gi]) for gi in members]
  best = None
  for split in fastest_splits(s.B, counts, models, s.q, ACCUMULATING_SPLITS):
    batches = [0] * len(s.p.groups)
    for gi, b in zip(members, split):
      batches[gi] = b
    cand = s.accumulating(name, batches, rows)
    if cand is not None and (best is None or cand.step_ms < best.step_ms):
      best = cand
  return best


ACCUMULATING_SPLITS = 8
"""Splits replayed with micro-steps per accumulating candidate (a batch with few divisors takes
many micro-steps, so the split of least affine step is not always the fastest)."""


def accumulating_baselines(s: Search, train_idx, train_rows, found: Sequence[Candidate]) -> list[Candidate]:
  """The baselines of ``ACCUMULATING`` where the plain one is missing or does not fit: the
  training groups alone, and every group, at the training precision, each group in the fewest
  micro-steps it fits in (``_accumulating_split``)."""
  fitting = {c.name for c in found if c.fits}
  out = []
  for plain, members in (
    ("training groups only", list(train_idx)),
    ("dynamic batching", range(len(s.p.groups))),
  ):
    if plain not in fitting and members:
      cand = _accumulating_split(s, ACCUMULATING[plain], list(members), train_rows)
      out += [cand] if cand is not None else []
  return out


def accumulating_plans(problem: Problem, s: Search, train_rows, configs, slack, found) -> list[Candidate]:
  """Where no plan of the joint search fits (step 3's ``joint``, step 2's ``fastest``): every
  group running, the inference groups at each combination of their configurations (step 1), each
  group in the fewest micro-steps it fits in (``_accumulating_split``); the fastest (``"fastest,
  accumulating"``) and the least-cost one within ``slack`` of it (``"joint, accumulating"``)."""
  if any(c.fits and c.name in ("joint", "fastest") for c in found) or not problem.inference:
    return []
  n, plans = len(problem.groups), []
  for combo in itertools.product(*(configs[gi] for gi in problem.inference)):
    rows = list(train_rows)
    for gi, row in zip(problem.inference, combo):
      rows[gi] = row
    cand = _accumulating_split(s, "fastest, accumulating", range(n), rows)
    plans += [cand] if cand is not None else []
  if not plans:
    return []
  fastest = min(plans, key=lambda c: c.step_ms)
  within = [c for c in plans if c.step_ms <= fastest.step_ms * (1 + slack) + 1e-12]
  cheapest = min(within, key=lambda c: (c.cost, c.step_ms))
  return [fastest, dataclasses.replace(cheapest, name="joint, accumulating")]


EIGHT_BIT = {
  "training groups only": "training groups only, 8-bit auto",
  "dynamic batching": "dynamic batching, 8-bit auto",
}
"""The baselines at each group's 8-bit auto policy (module docstring)."""


def _op_ms(group, op_index: int, policy) -> float:
  name = group.profile.ops[op_index].name
  return sum(
    ms for ms, _ in op_costs(dataclasses.replace(group, op_policies={name: policy}), op_index).values()
  )


def auto_rows(problem: Problem, base_rows: Sequence[Row]) -> list[Row]:
  """Each inference group's ladder levels under its 8-bit auto policy: an op at the 8-bit level
  its profile prices fastest where that is below its level in ``base_rows`` (the training
  precision's), else at that level; None for the training groups."""
  rows: list[Row] = [None] * len(problem.groups)
  for j, gi in enumerate(problem.inference):
    group, row = problem.groups[gi], []
    for i, ladder in enumerate(problem.ladders[j]):
      base = base_rows[gi][i]
      eight = [lv for lv, (p, _) in enumerate(ladder) if p in QUANTIZED_PRECISIONS]
      times = {lv: _op_ms(group, i, ladder[lv][1]) for lv in [base, *eight]}
      row.append(min(times, key=lambda lv: (times[lv], lv != base)))
    rows[gi] = tuple(row)
  return rows


def auto_training_problem(problem: Problem) -> Problem:
  """``problem`` with every training group at its 8-bit auto policy: an op at the 8-bit preset
  its profile prices fastest where that is below its time at the training precision
  (``planners.allocator.payoff.paying_ops`` over ``profile_payoffs``), charged its Ω above the
  training precision's times the group's share (``Problem.train_cost``); ``problem`` itself where
  no training group has a paying op."""
  groups, train_ops, train_cost = list(problem.groups), dict(problem.train_ops), dict(problem.train_cost)
  for gi, g in enumerate(problem.groups):
    presets = eight_bit_presets(g.profile.device_type)
    if gi in problem.inference or not presets or problem.train_policy not in ("bf16", "fp16", "fp32"):
      continue
    chosen = paying_ops(profile_payoffs(g.profile, problem.train_policy, presets))
    chosen = {op: p for op, p in chosen.items() if _scored(problem, op, p)}
    if not chosen:
      continue
    policies = {**g.op_policies, **{op: OpPolicy.preset(p) for op, p in chosen.items()}}
    groups[gi] = dataclasses.replace(g, op_policies=policies)
    train_ops[g.name] = {**train_ops.get(g.name, {}), **chosen}
    train_cost[g.name] = training_cost_per_share(problem.omega_by_op, problem.train_policy, train_ops[g.name])
  if groups == list(problem.groups):
    return problem
  return dataclasses.replace(problem, groups=tuple(groups), train_ops=train_ops, train_cost=train_cost)


def _scored(problem: Problem, op: str, preset: str) -> bool:
  """Whether the indicator scores ``op`` at ``preset``'s forward precision (its Ω is its cost)."""
  return OpPolicy.preset(preset).fwd in problem.omega_by_op.get(op, {})


def eight_bit_baselines(problem: Problem, granularity: int, train_idx, base_rows) -> list[Candidate]:
  """The ``EIGHT_BIT`` baselines of ``problem`` (module docstring): the fastest split of the
  training groups alone, and of every group, at their 8-bit auto policies; none where no group
  has an op that pays at 8 bits. References (``Candidate.reference``): in the plan's own space the
  training groups run the training precision (``--train-precision``), so these are what the gain
  is measured against, not plans to choose."""
  auto = auto_training_problem(problem)
  rows = auto_rows(problem, base_rows)
  if auto is problem and list(rows) == list(base_rows):
    return []
  s = Search(auto, granularity)
  out = []
  for plain, members in (
    ("training groups only", list(train_idx)),
    ("dynamic batching", range(len(problem.groups))),
  ):
    split = s.fastest_split(list(members), rows) if members else None
    if split is not None:
      cand = s.candidate(EIGHT_BIT[plain], split, rows)
      out.append(dataclasses.replace(cand, train_ops=auto.train_ops, reference=True))
  return out


def payload_baselines(problem: Problem, granularity: int, syncs: Sequence[str]) -> list[Candidate]:
  """The baselines at each priced sync not in ``syncs`` (the flat reduction, the replicated
  update: the one mode the trainer runs them in): dynamic batching and the training groups alone,
  at the training precision (accumulating where they do not fit at once) and at the 8-bit auto
  policies, all references (``Candidate.reference``): the best baseline is at the best payload
  whatever sync the plan is made for (``--sync``), and a plan is chosen in its own syncs."""
  from planners.predictor.payload import PRICED_SYNCS

  if problem.cluster.num_devices < 2:
    return []
  out = []
  for sync in (p for p in PRICED_SYNCS if p not in syncs):
    moded = dataclasses.replace(problem, reduction="flat", optimizer_update="replicated", sync=sync)
    s = Search(moded, granularity)
    train_idx = [gi for gi in range(len(problem.groups)) if gi not in problem.inference]
    rows: list[Row] = [None] * len(problem.groups)
    for j, gi in enumerate(problem.inference):
      rows[gi] = s.base[j]
    found = []
    for name, members in (
      ("training groups only", train_idx),
      ("dynamic batching", range(len(problem.groups))),
    ):
      split = s.fastest_split(list(members), rows) if members else None
      if split is not None:
        found.append(s.candidate(name, split, rows))
    found += accumulating_baselines(s, train_idx, rows, found)
    found += eight_bit_baselines(moded, granularity, train_idx, rows)
    out += [dataclasses.replace(c, reference=True) for c in found]
  return out
