"""Joint batch × precision planning: never slower than an alternative (beyond the slack), plans
that fit and keep their batch sums, batch splits as the replay predicts them, named errors."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.allocator import exhaustive_joint
from planners.allocator.greedy import make_problem
from planners.allocator.joint import joint_plan, plan_of
from planners.predictor.replay import predict
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import ClusterSpecError, PlanError
from qsync_jax.plan import Plan
from tests.planners.fakes import fake_indicator, fake_profile


def _setup(leg_ms, slow, sens, counts=(2, 2), batch=8, memory_gb=(40.0, 16.0), comm_kb=4):
  train = fake_profile(leg_ms, device_type="A100", rhs_elems=comm_kb * 250)
  infer = fake_profile(
    [tuple(slow * t for t in legs) for legs in leg_ms], device_type="T4", rhs_elems=comm_kb * 250
  )
  cluster = ClusterSpec(
    (
      DeviceGroup("train", "A100", counts[0], memory_gb[0], batch, 100.0),
      DeviceGroup("infer", "T4", counts[1], memory_gb[1], batch, 100.0),
    )
  )
  profiles = {"A100": train, "T4": infer}
  return cluster, profiles, fake_indicator(train.op_names, sens)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
  leg_ms=st.lists(st.tuples(*[st.floats(0.1, 5.0)] * 3), min_size=1, max_size=4),
  slow=st.floats(1.0, 8.0),
  slack=st.sampled_from([0.0, 0.02, 0.1]),
  counts=st.sampled_from([(2, 2), (1, 3), (3, 1)]),
  granularity=st.sampled_from([1, 2]),
  seed=st.integers(0, 2**16),
)
def test_joint_never_loses_to_an_alternative(leg_ms, slow, slack, counts, granularity, seed):
  sens = np.random.default_rng(seed).exponential(size=len(leg_ms)).tolist()
  cluster, profiles, indicator = _setup(leg_ms, slow, sens, counts=counts)
  problem = make_problem(cluster, profiles, indicator)
  chosen, cands, _ = joint_plan(problem, granularity, slack)
  names = {c.name for c in cands}
  assert {"equal batches, training precision", "dynamic batching", "uniform low precision"} <= names
  assert {"QSync (precision only)", "joint"} <= names
  if cluster.global_batch % (counts[0] * granularity) == 0:  # else the training groups cannot take it all
    assert "training groups only" in names
  for c in cands:
    if c.fits and not c.reference:  # references: baselines outside the plan's space (8-bit training groups)
      assert chosen.samples_per_s >= c.samples_per_s / (1 + slack) * (1 - 1e-9), c.name
      if c.samples_per_s >= chosen.samples_per_s * (1 + 1e-9):  # faster but within slack: costs more
        assert chosen.cost <= c.cost + 1e-12, c.name
  # the plan is what the replay predicts, fits, and keeps the global batch
  plan = plan_of(problem, chosen)
  pred = predict(cluster, profiles, plan)
  assert pred.step_ms == pytest.approx(chosen.step_ms)
  assert pred.fits
  assert plan.apply_to(cluster).global_batch == cluster.global_batch
  assert all(b % granularity == 0 for b in plan.batch_per_device.values())


@pytest.mark.parametrize("seed", range(4))
def test_joint_near_exhaustive_on_small_problems(seed):
  rng = np.random.default_rng(200 + seed)
  leg_ms = [tuple(rng.uniform(0.2, 3.0, size=3)) for _ in range(3)]
  cluster, profiles, indicator = _setup(
    leg_ms, float(rng.uniform(2, 6)), rng.exponential(size=3).tolist(), batch=4
  )
  problem = make_problem(cluster, profiles, indicator)
  chosen, _, _ = joint_plan(problem, 1, 0.05)
  optimum, best_ms = exhaustive_joint(problem, 0.05)
  # the joint plan is within the slack of the fastest plan there is (measured against the
  # exhaustive search's fastest, not only the alternatives'), and at most as costly as the
  # exhaustive optimum when it is as fast
  assert chosen.step_ms <= best_ms * 1.05 * (1 + 1e-9)
  if chosen.step_ms <= optimum.step_ms:
    assert chosen.cost <= optimum.cost + 1e-9 or chosen.step_ms < optimum.step_ms


def test_slow_inference_group_is_dropped_and_fast_one_gets_a_bigger_share():
  leg_ms = [(1.0, 1.0, 1.0)] * 3
  cluster, profiles, indicator = _setup(leg_ms, 40.0, [1.0, 1.0, 1.0])
  chosen, _, _ = joint_plan(make_problem(cluster, profiles, indicator), 1, 0.0)
  assert chosen.batches == (8 * 2, 0)  # 40× slower even at int8: the training groups alone win
  cluster, profiles, indicator = _setup(leg_ms, 4.0, [1.0, 1.0, 1.0])  # int8 there: 1.2× fp32 here
  chosen, cands, _ = joint_plan(make_problem(cluster, profiles, indicator), 1, 0.0)
  train_b, infer_b = chosen.batches
  assert train_b > infer_b > 0
  dyn = next(c for c in cands if c.name == "dynamic batching")
  assert chosen.samples_per_s >= dyn.samples_per_s


def test_equal_mode_keeps_the_spec_batches():
  cluster, profiles, indicator = _setup([(1.0, 1.0, 1.0)] * 2, 2.0, [1.0, 2.0])
  chosen, cands, _ = joint_plan(make_problem(cluster, profiles, indicator), 1, 0.0, batch="equal")
  # every candidate keeps 8 examples per forward/backward: the accumulating one in 2 micro-steps
  assert all(c.batches == (8, 8) for c in cands if not c.micro_steps)
  assert {(c.batches, c.micro_steps) for c in cands if c.micro_steps} == {((16, 0), (2, 1))}
  assert chosen.name in {c.name for c in cands}


def test_equal_mode_drops_a_slow_inference_group_and_accumulates():
  cluster, profiles, indicator = _setup([(1.0, 1.0, 1.0)] * 3, 40.0, [1.0, 1.0, 1.0])
  problem = make_problem(cluster, profiles, indicator)
  chosen, cands, _ = joint_plan(problem, 1, 0.0, batch="equal")
  assert chosen.name == "training groups only, accumulating"  # 40× slower even at int8
  assert (chosen.batches, chosen.micro_steps) == ((16, 0), (2, 1))
  assert chosen.step_ms < min(c.step_ms for c in cands if not c.micro_steps)
  plan = plan_of(problem, chosen)
  assert plan.micro_steps == {"train": 2} and plan.batch_per_device == {"train": 16, "infer": 0}
  pred = predict(cluster, profiles, plan)
  assert pred.step_ms == pytest.approx(chosen.step_ms) and pred.fits
  assert chosen.to_json(problem)["micro_steps"] == {"train": 2, "infer": 1}


def test_the_accumulating_candidate_pays_its_fixed_share_per_micro_step():
  cluster, profiles, indicator = _setup([(1.0, 1.0, 1.0)] * 3, 40.0, [1.0, 1.0, 1.0])
  profiles = {**profiles, "A100": dataclasses.replace(profiles["A100"], fixed_share=0.5)}
  problem = make_problem(cluster, profiles, indicator)
  chosen, _, _ = joint_plan(problem, 1, 0.0, batch="equal")
  assert (chosen.batches, chosen.micro_steps) == ((16, 0), (2, 1))
  plan = plan_of(problem, chosen)
  assert predict(cluster, profiles, plan).step_ms == pytest.approx(chosen.step_ms)
  one_pass = predict(cluster, profiles, dataclasses.replace(plan, micro_steps={})).step_ms
  # the second micro-step pays half the profiled 8 ms of compute again (3 ops; no dlhs of the first)
  assert chosen.step_ms - one_pass == pytest.approx(0.5 * 8.0)


def test_micro_steps_cut_modeled_memory_not_step_time():
  prof = fake_profile([(1.0, 1.0, 1.0)] * 2, device_type="A100", lhs_elems=100_000)
  cluster = ClusterSpec((DeviceGroup("g", "A100", 2, 40.0, 16, 100.0),))
  whole = predict(cluster, {"A100": prof}, Plan())
  halves = predict(cluster, {"A100": prof}, Plan(micro_steps={"g": 2}))
  # without a fixed share (fake_profile's) compute is linear in the batch: 2 × 8 costs what 16 does
  assert halves.step_ms == whole.step_ms
  # activations of 8 examples instead of 16, plus one fp32 gradient accumulator (the parameters' size)
  saved = 2 * 4 * 100_000 * (16 - 8) // 8 - prof.memory["param_bytes"]
  assert whole.memory_bytes["g"] - halves.memory_bytes["g"] == saved > 0


def test_bad_input_named_before_search():
  cluster, profiles, indicator = _setup([(1.0, 1.0, 1.0)], 2.0, [1.0], counts=(3, 2), batch=3)  # B = 15
  problem = make_problem(cluster, profiles, indicator)
  with pytest.raises(PlanError, match="global batch 15 .* not a multiple of the granularity 2"):
    joint_plan(problem, granularity=2)
  with pytest.raises(PlanError, match="slack"):
    joint_plan(problem, slack=-0.1)
  with pytest.raises(PlanError, match="'joint' or 'equal'"):
    joint_plan(problem, batch="dynamic")
  cluster, profiles, indicator = _setup([(1.0, 1.0, 1.0)], 2.0, [1.0], memory_gb=(40.0, 1e-9))
  with pytest.raises(PlanError, match="'infer' .* cannot fit even 1 example.*Fix: set memory_gb"):
    joint_plan(make_problem(cluster, profiles, indicator))
  with pytest.raises(ClusterSpecError, match="device_type='Z80' is unknown"):
    DeviceGroup("x", "Z80", 1, 16.0, 8)
  with pytest.raises(ClusterSpecError, match="count=0 must be a positive integer"):
    DeviceGroup("x", "T4", 0, 16.0, 8)


def test_dynamic_batching_splits_by_speed():
  cluster, profiles, indicator = _setup([(1.0, 1.0, 1.0)] * 3, 3.0, [1.0] * 3)
  _, cands, _ = joint_plan(make_problem(cluster, profiles, indicator), 1, 0.0)
  dyn = next(c for c in cands if c.name == "dynamic batching")
  equal = next(c for c in cands if c.name == "equal batches, training precision")
  train_b, infer_b = dyn.batches
  assert 2 * train_b + 2 * infer_b == cluster.global_batch
  assert train_b == pytest.approx(3 * infer_b, rel=0.35)  # 3× faster at fp32
  assert dyn.step_ms < equal.step_ms and dyn.cost == 0.0
