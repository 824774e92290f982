"""Where no group can take its share of the global batch at once, the joint search plans it in
micro-steps (gradient accumulation), with the optimizer state where the mode keeps it; the
accumulating baselines count in the plan's gain."""

import dataclasses

import pytest

from planners.allocator.bound import best_baseline
from planners.allocator.greedy import make_problem, memory_layout
from planners.allocator.joint import joint_plan, plan_of
from planners.predictor.memory_model import memory_bytes
from planners.predictor.replay import predict
from planners.profile import GroupCost
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import QsyncWarning
from qsync_jax.precision import OpPolicy
from tests.planners.fakes import fake_indicator, fake_profile

BATCH = 4  # per device in the spec: 1 A100 + 3 T4 → a global batch of 16


def _pool():
  """One A100 that holds 4 examples at once, three T4s that hold one at fp16 only with the
  optimizer state sharded; the global batch is 16."""
  legs = [(1.0, 1.0, 1.0)] * 3
  share = {"fixed_share": 0.05}  # each micro-step pays 5 % of the profiled step's compute again
  train = dataclasses.replace(
    fake_profile(legs, device_type="A100", rhs_elems=20_000, lhs_elems=200_000, batch=BATCH), **share
  )
  infer = dataclasses.replace(
    fake_profile([(3.0,) * 3] * 3, device_type="T4", rhs_elems=20_000, lhs_elems=200_000, batch=BATCH),
    **share,
  )
  sharded = memory_layout("sharded", 4)
  omega = fake_indicator(train.op_names, [1.0, 2.0, 3.0])["omega"]
  fp16 = {name: OpPolicy.preset("fp16") for name in infer.op_names}

  def need(prof, b, policies, **layout):
    return memory_bytes(GroupCost("g", prof, policies, b), **layout)

  alone = memory_layout("sharded", 1)  # the A100 alone: nothing to shard over
  train_gb = (need(train, 4, {}, **alone) + need(train, 5, {}, **alone)) / 2 / 1e9
  infer_gb = (need(infer, 1, fp16, **sharded) + need(infer, 2, fp16, **sharded)) / 2 / 1e9
  assert (
    need(infer, 1, fp16, **memory_layout("replicated", 4)) > infer_gb * 1e9
  )  # replicated: no example fits
  cluster = ClusterSpec(
    (
      DeviceGroup("train", "A100", 1, train_gb, BATCH, 100.0),
      DeviceGroup("infer", "T4", 3, infer_gb, BATCH, 100.0),
    )
  )
  # scored at 16 bits only: no 8-bit level frees the T4s' memory
  sixteen = {op: {p: w for p, w in row.items() if p in ("fp16", "bf16", "fp32")} for op, row in omega.items()}
  with pytest.warns(QsyncWarning, match="scores no op at int8"):  # said once, as to a user
    return make_problem(cluster, {"A100": train, "T4": infer}, {"omega": sixteen})


def test_a_batch_no_group_takes_at_once_is_planned_in_micro_steps_with_the_state_sharded():
  problem = _pool()
  chosen, cands, _ = joint_plan(problem, 1, 0.02)
  names = {c.name for c in cands if c.fits}
  assert "training groups only, accumulating" in names
  # planned, but a T4 beside the A100 holds the A100's fp32 branch too (the step is one program:
  # ``program_memory_bytes``), which it cannot at even one example a micro-step
  planned = {c.name for c in cands}
  assert {"joint, accumulating", "fastest, accumulating"} <= planned - names
  assert not names & {"dynamic batching", "training groups only", "joint"}  # no split fits at once
  assert chosen.fits and chosen.mode == ("flat", "sharded")
  assert chosen.micro_steps and max(chosen.micro_steps) > 1
  for b, k in zip(chosen.batches, chosen.micro_steps):
    assert b % k == 0
  plan = plan_of(problem, chosen)
  assert plan.micro_steps == {g.name: k for g, k in zip(problem.groups, chosen.micro_steps) if k != 1}
  assert sum(g.count * plan.batch_per_device[g.name] for g in problem.cluster.groups) == 16
  pred = predict(problem.cluster, {g.profile.device_type: g.profile for g in problem.groups}, plan)
  assert pred.fits and pred.step_ms == chosen.step_ms
  # the gain is against the best baseline, the accumulating ones included
  assert best_baseline(cands).name.endswith(", accumulating")
  # each micro-step pays the fixed share again
  groups = [dataclasses.replace(g, batch_per_device=b) for g, b in zip(problem.groups, chosen.batches)]
  for g, k in zip(groups, chosen.micro_steps):
    assert dataclasses.replace(g, micro_steps=k).compute_scale == 0.05 * k + 0.95 * g.batch_per_device / BATCH


def test_micro_steps_grow_on_the_largest_micro_batch_until_the_program_fits():
  from planners.allocator.search import Search

  class Program:  # fits once no group's micro-batch exceeds 3 examples (each device holds the costliest)
    def __init__(self):
      self.asked = []

    def plan_fits(self, batches, rows, micro):
      self.asked.append(tuple(micro))
      return max(b / k for b, k in zip(batches, micro) if b) <= 3

  program = Program()
  micro = Search.micro_steps_for_program(program, (12, 4, 0), (None,) * 3, [1, 2, 1])
  # 12/1 → 12/2 → 12/3 → 12/4 = 3 (group 1 at 4/2 = 2 already fits); the empty group stays at 1
  assert micro == [4, 2, 1]
  assert program.asked == [(1, 2, 1), (2, 2, 1), (3, 2, 1), (4, 2, 1)]
  never = Program()
  never.plan_fits = lambda batches, rows, micro: False
  assert Search.micro_steps_for_program(never, (6, 2), (None, None), [1, 1]) == [6, 2]  # as far as it got
