"""8-bit only where it pays (planners.allocator.payoff): the choice from measured in-step times,
the accuracy budget, and the whole measured search on this machine's CPU."""

import dataclasses
import re

import numpy as np
import pytest

from benchmarks.allocator import exhaustive_joint
from planners.allocator import auto_policy, exhaustive, greedy, joint_plan, make_problem, plan_of
from planners.allocator.frontier import DEFAULT_BUDGET
from planners.allocator.payoff import (
  CANDIDATE_KINDS,
  OpPayoff,
  eight_bit_presets,
  paying_ops,
  policy_of,
  profile_paying_ops,
  profile_payoffs,
)
from planners.allocator.search import Search
from planners.ops import OpShape
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError
from qsync_jax.policy import PrecisionPolicy
from tests.planners import tiny
from tests.planners.fakes import fake_indicator, fake_profile

PAYOFFS = (
  OpPayoff("a:dense", 10.0, {"int8": 6.0, "fp8": 7.0}),  # saves 4 at int8
  OpPayoff("b:dense", 10.0, {"int8": 9.5, "fp8": 8.0}),  # saves 2 at fp8
  OpPayoff("c:dense", 10.0, {"int8": 12.0, "fp8": 10.0}),  # saves nothing (fp8 ties)
  OpPayoff("d:dense", 1.0, {"int8": 0.95}),  # saves 5 %
)


def test_each_op_runs_8bit_only_where_it_saves_time_at_its_fastest_preset():
  assert paying_ops(PAYOFFS) == {"a:dense": "int8", "b:dense": "fp8", "d:dense": "int8"}
  assert paying_ops(PAYOFFS, min_gain=0.10) == {"a:dense": "int8", "b:dense": "fp8"}
  # one preset alone: the ops that save at that preset (for the whole-step candidate of each preset)
  assert paying_ops(PAYOFFS, preset="int8") == {"a:dense": "int8", "b:dense": "int8", "d:dense": "int8"}
  assert paying_ops(PAYOFFS, preset="fp8") == {"a:dense": "fp8", "b:dense": "fp8"}
  assert OpPayoff("x", 1.0, {}).best() is None


def test_the_budget_spends_omega_on_the_most_time_per_unit_of_sensitivity():
  omega = {"a:dense": {"int8": 4.0}, "b:dense": {"fp8": 1.0}, "d:dense": {"int8": 5.0}}
  # Ω per ms saved: b 0.5, a 1.0, d 100; total Ω of paying ops 10
  assert paying_ops(PAYOFFS, omega=omega, budget=1.0) == paying_ops(PAYOFFS)
  assert paying_ops(PAYOFFS, omega=omega, budget=0.5) == {"b:dense": "fp8", "a:dense": "int8"}
  assert paying_ops(PAYOFFS, omega=omega, budget=0.1) == {"b:dense": "fp8"}
  assert paying_ops(PAYOFFS, omega=omega, budget=0.0) == {}


def test_a_budget_without_the_ops_omega_or_outside_0_1_is_refused_with_the_fix():
  with pytest.raises(PlanError, match=r"no Ω for op 'a:dense' at 'int8'.*--precisions int8"):
    paying_ops(PAYOFFS, omega={"b:dense": {"fp8": 1.0}})
  with pytest.raises(PlanError, match=r"outside \[0, 1\]"):
    paying_ops(PAYOFFS, omega={}, budget=1.5)
  with pytest.raises(PlanError, match="is nan"):
    paying_ops(
      PAYOFFS, omega={op: {"int8": float("nan"), "fp8": 1.0} for op in ("a:dense", "b:dense", "d:dense")}
    )


def test_only_presets_with_a_kernel_on_the_architecture_are_tried():
  assert eight_bit_presets("V100") == ()  # no 8-bit tensor-core kernel at all
  assert eight_bit_presets("A100") == ("int8",)  # no fp8 before sm89
  assert eight_bit_presets("H100") == ("int8", "fp8")


def test_policy_of_runs_chosen_ops_at_their_preset_lookups_unmodified_and_the_rest_at_the_base():
  ops = [OpShape(n, "dense", 1, 4, 4, 4, 1, 16, 16, 16) for n in ("a:dense", "b:dense")]
  ops.append(OpShape("emb:embed", "embed", 1, 4, 8, 4, 1, 32, 32, 16))
  policy = policy_of(ops, "bf16", {"b:dense": "int8"})
  assert policy.lookup_name("a:dense").fwd == "bf16"
  assert policy.lookup_name("b:dense").fwd == "int8"
  assert policy.lookup_name("emb:embed") is None


@pytest.mark.standard_promotion  # optax's update promotes bf16 with float32
def test_auto_policy_returns_the_fastest_candidate_within_the_budget_and_a_second_search_loads_it(tmp_path):
  task = tiny.attn()
  messages = []
  small = dict(trace_repeats=2, step_repeats=3, rounds=1, indicator_steps=3, indicator_batches=1)
  result = auto_policy(task, 8, presets=("int8",), cache_dir=str(tmp_path), progress=messages.append, **small)
  names = [p.op for p in result.payoffs]
  assert names and all(n.split(":")[1] in CANDIDATE_KINDS for n in names)
  assert not any("attention" in n for n in names)
  assert "base" in result.step_ms and result.candidates["base"] == {}
  # the indicator was measured (the default): every candidate op has Ω at int8 and at the base
  assert "gradient indicator on 1 batches of 8 after 3 bf16 steps" == result.indicator
  assert set(result.omega) == set(names) and all(
    {"int8", "bf16"} <= set(row) for row in result.omega.values()
  )
  assert result.budget == DEFAULT_BUDGET and result.frontier.allowed == pytest.approx(
    DEFAULT_BUDGET * result.frontier.reference
  )
  # the winner: the fastest candidate whose Ω is within the budget; the speed winner: the fastest
  within = [n for n in result.step_ms if result.candidate_omega[n] <= result.frontier.allowed * (1 + 1e-9)]
  assert result.winner == min(within, key=result.step_ms.get)
  assert result.speed_winner == min(result.step_ms, key=result.step_ms.get)
  assert result.speedup >= 1.0 and result.speed_speedup >= result.speedup
  assert result.chosen == result.candidates[result.winner]
  for op, preset in result.chosen.items():
    assert result.policy.lookup_name(op).fwd == preset and preset in ("int8", "fp8")
  unchosen = [n for n in names if n not in result.chosen]
  assert all(result.policy.lookup_name(n).fwd == "bf16" for n in unchosen)
  assert PrecisionPolicy.from_json(result.to_json()["policy"]) == result.policy
  lines = result.summary()
  assert "measured" in lines[0] and lines[1].startswith(
    f"accuracy budget {DEFAULT_BUDGET:g} of the speed-only Ω"
  )
  assert "Ω spent" in lines[1] and len(lines) == 3 + len(names)
  # the last line: the search's seconds per phase, each also on the progress lines' stamps
  assert (
    lines[-1].startswith(f"search {result.search_s:.1f} s (setup ") and "training steps compiled" in lines[-1]
  )
  assert {"setup", "indicator", "compile", "trace", "time"} <= set(result.search_phases)
  assert sum(result.search_phases.values()) <= result.search_s
  assert all(re.match(r"\[ *\d+\.\d s\] ", m) for m in messages)
  assert set(result.step_ms) | set(result.pruned) == set(result.candidates) == set(result.predicted_ms)
  for p, line in zip(result.payoffs, lines[2:]):  # why each op not at its fastest preset is left out
    if p.best() is not None and p.op not in result.chosen:
      assert "over the budget" in line or f"not in the {result.winner} candidate" in line
  # the same search again loads the result (nothing measured) and says so
  assert result.cache_path and any("] kept the result in" in m for m in messages)
  again = auto_policy(task, 8, presets=("int8",), cache_dir=str(tmp_path), progress=messages.append, **small)
  assert again.loaded and "loaded the result of an earlier search" in messages[-1]
  assert again.summary()[0].startswith("auto policy loaded from") and again.summary()[1:] == lines
  assert again.policy == result.policy and again.to_json() == result.to_json()


@pytest.mark.standard_promotion  # optax's update promotes bf16 with float32
def test_a_zero_budget_times_the_base_alone():
  task = tiny.mlp()
  result = auto_policy(task, 8, presets=("int8",), budget=0.0, trace_repeats=2, step_repeats=3, rounds=1)
  assert list(result.step_ms) == ["base"] and result.chosen == {} and result.speedup == 1.0
  assert result.payoffs == () and result.omega is None  # nothing traced, no indicator


def test_bad_base_preset_budget_or_table_is_refused_before_any_tracing(monkeypatch):
  task = tiny.mlp()
  monkeypatch.setattr("planners.allocator.payoff._search", lambda *a: pytest.fail("measured"))
  with pytest.raises(PlanError, match="base precision 'int8'"):
    auto_policy(task, 8, base="int8")
  with pytest.raises(PlanError, match="preset 'int4' has no kernel"):
    auto_policy(task, 8, presets=("int4",))
  with pytest.raises(PlanError, match=r"accuracy budget -0.5 is outside \[0, 1\]. Fix"):
    auto_policy(task, 8, budget=-0.5)
  with pytest.raises(PlanError, match="accuracy budget 'fastest' is neither a number nor 'speed'. Fix"):
    auto_policy(task, 8, budget="fastest")
  with pytest.raises(PlanError, match=r"no Ω for op 'Dense_2:dense' at 'int8'"):
    auto_policy(task, 8, presets=("int8",), omega={f"Dense_{i}:dense": {"int8": 1.0} for i in range(2)})


# -- profile_paying_ops: the training groups of `qsync plan --train-precision auto` -----------------

EIGHT_BIT_SPEED = {"fp32": 1.0, "tf32": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.3, "fp8": 0.4}


def _profile():
  """Three dense ops; Dense_0 and Dense_1 are faster at int8 (0.3) and fp8 (0.4) than at bf16
  (0.5), Dense_2's 8-bit legs are slower (0.6)."""
  prof = fake_profile([(1.0, 1.0, 1.0)] * 3, speed=EIGHT_BIT_SPEED, model="mlp", batch=16)
  slow = {leg: {**t, "int8": 0.6, "fp8": 0.6} for leg, t in prof.op_ms["Dense_2:dense"].items()}
  return dataclasses.replace(prof, op_ms={**prof.op_ms, "Dense_2:dense": slow})


def test_a_training_group_runs_8bit_exactly_the_ops_whose_measured_8bit_time_pays():
  prof = _profile()
  payoffs = {p.op: p for p in profile_payoffs(prof, "bf16", ("int8", "fp8"))}
  # Dense_0 is the first op: no input gradient, so fwd + drhs only
  assert payoffs["Dense_0:dense"].base_ms == pytest.approx(1.0) and payoffs["Dense_1:dense"].base_ms == 1.5
  assert payoffs["Dense_2:dense"].preset_ms == pytest.approx({"int8": 1.8, "fp8": 1.8})
  omega = {op: {"int8": 1.0, "fp8": 1.0} for op in prof.op_names}
  assert profile_paying_ops(prof, "bf16", omega) == {"Dense_0:dense": "int8", "Dense_1:dense": "int8"}
  # at fp32 the base is slower than every 8-bit leg: Dense_2 pays too
  assert set(profile_paying_ops(prof, "fp32", omega)) == set(prof.op_names)


def test_a_training_group_uses_the_8bit_time_inside_the_step_where_the_profile_traced_it():
  prof = _profile()
  omega = {op: {"int8": 1.0, "fp8": 1.0} for op in prof.op_names}
  # Dense_1 at int8 inside the step: 3x its standalone int8 legs, above its bf16 time
  traced = dataclasses.replace(prof, quantized_in_step_ms={"Dense_1:dense": {"fwd": 0.9, "bwd": 1.8}})
  assert profile_paying_ops(traced, "bf16", omega) == {"Dense_0:dense": "int8"}


def test_the_training_budget_limits_the_8bit_ops_by_omega_per_ms_saved():
  prof = _profile()
  # Ω at int8: Dense_0 3 (saves 0.4 ms), Dense_1 1 (saves 0.6 ms): Dense_1 first, total Ω 4
  omega = fake_indicator(prof.op_names, [3.0, 1.0, 5.0])["omega"]
  assert profile_paying_ops(prof, "bf16", omega, 1.0) == {"Dense_0:dense": "int8", "Dense_1:dense": "int8"}
  assert profile_paying_ops(prof, "bf16", omega, 0.5) == {"Dense_1:dense": "int8"}
  assert profile_paying_ops(prof, "bf16", omega, 0.0) == {}


def test_a_training_group_without_measured_8bit_times_or_kernels_is_refused_by_name():
  prof = _profile()
  omega = {op: {"int8": 1.0, "fp8": 1.0} for op in prof.op_names}
  for source in ("modeled", "traced"):
    with pytest.raises(
      PlanError, match=rf"on cpu is {source}, not measured.*Fix: profile the model on a cpu"
    ):
      profile_paying_ops(dataclasses.replace(prof, source=source), "bf16", omega)
  with pytest.raises(PlanError, match=r"a V100 has no 8-bit kernel.*Fix: pass a 16-bit preset"):
    profile_paying_ops(dataclasses.replace(prof, device_type="V100"), "fp16", omega)
  # calibrated from a measured profile: every time scaled by one factor, the same ops pay
  calibration = {"calibration": {"base": {"source": "measured"}}}
  scaled = dataclasses.replace(prof.times_scaled(2.0), source="calibrated", meta=calibration)
  assert profile_paying_ops(scaled, "bf16", omega) == profile_paying_ops(prof, "bf16", omega)
  modeled_base = dataclasses.replace(scaled, meta={"calibration": {"base": {"source": "modeled"}}})
  with pytest.raises(PlanError, match="is calibrated, not measured"):
    profile_paying_ops(modeled_base, "bf16", omega)


# -- the accuracy cost of a training group's 8-bit ops (`qsync plan --train-precision auto`) --------

TRAIN_8BIT = {"train": {"Dense_0:dense": "int8", "Dense_2:dense": "int8"}}
"""Two of the three ops of the training group at int8; Ω above bf16's: (3 − 0.3) + (2 − 0.2) = 4.5."""


def _cluster(slow: float):
  """2 A100 training devices and 2 T4 inference devices, batch 8 each (B = 32): three dense ops of
  1 ms per leg at fp32 on the A100, ``slow`` times that on the T4; Ω at int8 3, 1, 2 (fake_indicator)."""
  train = fake_profile([(1.0, 1.0, 1.0)] * 3, device_type="A100")
  infer = fake_profile([(slow, slow, slow)] * 3, device_type="T4")
  cluster = ClusterSpec(
    (DeviceGroup("train", "A100", 2, 40.0, 8, 100.0), DeviceGroup("infer", "T4", 2, 16.0, 8, 100.0))
  )
  return cluster, {"A100": train, "T4": infer}, fake_indicator(train.op_names, [3.0, 1.0, 2.0])


def _hand_cost(plan, indicator, cluster) -> float:
  """The objective's accuracy cost of ``plan``, by hand: Σ_groups (count·batch / B) · Σ_ops
  max(0, Ω(op, its forward precision) − Ω(op, bf16)), Ω(op, fp32) = 0."""
  omega = indicator["omega"]
  total = 0.0
  for g in cluster.groups:
    share = g.count * plan.batch_per_device[g.name] / cluster.global_batch
    policy = plan.policy_for(g.name)
    total += share * sum(max(0.0, row[policy.lookup_name(op).fwd] - row["bf16"]) for op, row in omega.items())
  return total


def test_a_training_groups_8bit_ops_cost_their_omega_above_the_training_precision_times_their_share():
  cluster, profiles, indicator = _cluster(2.0)
  problem = make_problem(cluster, profiles, indicator, ["train"], "bf16", train_ops=TRAIN_8BIT)
  assert problem.train_cost == {"train": pytest.approx(4.5)}
  s = Search(problem, 1)
  base = s.base[0]  # the inference group at the training precision's level: Ω 0 above it
  # (count · batch / B) · 4.5, changing with the training group's share
  assert s.cost((8, 8), (None, base)) == pytest.approx(2.25)
  assert s.cost((12, 4), (None, base)) == pytest.approx(3.375)
  assert s.cost((16, 0), (None, None)) == pytest.approx(4.5)
  # Dense_1 at int8 on the inference group adds its share · (1 − 0.1)
  assert s.cost((8, 8), (None, (base[0], 0, base[2]))) == pytest.approx(2.25 + 0.5 * 0.9)
  assert s.training_cost((12, 4)) == pytest.approx(3.375)
  chosen, cands, _ = joint_plan(problem, 1, 0.3)
  for c in [chosen, *cands]:
    assert c.cost == pytest.approx(_hand_cost(plan_of(problem, c), indicator, cluster)), c.name
  alone = next(c for c in cands if c.name == "training groups only")
  assert alone.batches == (16, 0) and alone.cost == pytest.approx(4.5)
  # the greedy's Ω (QSync's Σ Ω, each group once) counts the training group's 4.5 too
  blind = dataclasses.replace(problem, train_cost={})
  assert greedy(problem).omega == pytest.approx(greedy(blind).omega + 4.5)
  assert exhaustive(problem).omega == pytest.approx(exhaustive(blind).omega + 4.5)
  # equal batches: the training groups alone, accumulating, cost their whole share
  _, equal, _ = joint_plan(problem, 1, 0.3, batch="equal")
  accumulating = next(c for c in equal if c.name == "training groups only, accumulating")
  assert accumulating.cost == pytest.approx(4.5)


def test_the_training_groups_8bit_omega_decides_between_plans_within_the_slack():
  # at 30 % slack the dynamic batching split (13, 3) is fastest; the training group's 4.5 per
  # share makes (12, 4), one example per device more on the T4 at its training-precision level
  # (Ω 0 above it) and slower but within the slack, the cheaper plan: 2·12/32·4.5 = 3.375
  cluster, profiles, indicator = _cluster(3.0)
  problem = make_problem(cluster, profiles, indicator, ["train"], "bf16", train_ops=TRAIN_8BIT)
  chosen, cands, search = joint_plan(problem, 1, 0.3)
  assert chosen.batches == (12, 4) and chosen.rows[1] == search.base[0]
  assert chosen.cost == pytest.approx(3.375)
  assert chosen.step_ms <= min(c.step_ms for c in cands if c.fits and not c.reference) * 1.3 * (1 + 1e-9)
  # blind to the training group's Ω every plan at the training precision costs 0: the fastest wins
  blind, _, _ = joint_plan(dataclasses.replace(problem, train_cost={}), 1, 0.3)
  assert blind.batches == (13, 3) and blind.cost == 0
  counted = search.cost(blind.batches, blind.rows)
  assert counted == pytest.approx(2 * 13 / 32 * 4.5) and counted > chosen.cost


@pytest.mark.parametrize("seed", range(4))
def test_the_joint_plan_with_training_8bit_ops_is_the_least_cost_plan_of_an_exhaustive_search(seed):
  rng = np.random.default_rng(500 + seed)  # seeded: leg times, slowdown, Ω and the 8-bit ops
  leg_ms = [tuple(rng.uniform(0.2, 3.0, size=3)) for _ in range(3)]
  train = fake_profile(leg_ms, device_type="A100")
  infer = fake_profile([tuple(rng.uniform(1, 6) * t for t in legs) for legs in leg_ms], device_type="T4")
  counts = [(2, 2), (1, 3), (3, 1), (2, 2)][seed]
  cluster = ClusterSpec(
    (
      DeviceGroup("train", "A100", counts[0], 40.0, 4, 100.0),
      DeviceGroup("infer", "T4", counts[1], 16.0, 4, 100.0),
    )
  )
  indicator = fake_indicator(train.op_names, rng.exponential(size=3).tolist())
  ops = {op: "int8" for op in train.op_names if rng.uniform() < 0.6} or {train.op_names[0]: "int8"}
  problem = make_problem(
    cluster, {"A100": train, "T4": infer}, indicator, ["train"], "bf16", train_ops={"train": ops}
  )
  slack = (0.0, 0.05, 0.2, 0.05)[seed]
  chosen, _, _ = joint_plan(problem, 1, slack)
  optimum, best_ms = exhaustive_joint(problem, slack)
  assert chosen.step_ms <= best_ms * (1 + slack) * (1 + 1e-9)
  assert chosen.cost == pytest.approx(optimum.cost)


def test_a_training_groups_8bit_op_without_omega_at_its_precision_is_refused_before_the_search():
  cluster, profiles, indicator = _cluster(2.0)
  del indicator["omega"]["Dense_2:dense"]["int8"]
  with pytest.raises(
    PlanError, match=r"no Ω for op 'Dense_2:dense' at 'int8'\. Fix: run `qsync indicator --precisions int8`"
  ):
    make_problem(cluster, profiles, indicator, ["train"], "bf16", train_ops=TRAIN_8BIT)
  # a training precision the indicator does not score (tf32): the 8-bit ops' Ω counts in full
  _, _, full = _cluster(2.0)
  problem = make_problem(cluster, profiles, full, ["train"], "tf32", train_ops=TRAIN_8BIT)
  assert problem.train_cost == {"train": pytest.approx(3.0 + 2.0)}
  # no 8-bit ops: no cost
  assert make_problem(cluster, profiles, full, ["train"], "bf16").train_cost == {}
