"""8-bit only where it pays (planners.allocator.payoff): the choice from measured in-step times,
the accuracy budget, and the whole measured search on this machine's CPU."""

import dataclasses

import pytest

from planners.allocator import auto_policy
from planners.allocator.payoff import (
  CANDIDATE_KINDS,
  OpPayoff,
  eight_bit_presets,
  paying_ops,
  policy_of,
  profile_paying_ops,
  profile_payoffs,
)
from planners.ops import OpShape
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
def test_auto_policy_returns_the_fastest_measured_candidate_and_never_quantizes_attention():
  task = tiny.attn()
  result = auto_policy(task, 8, presets=("int8",), trace_repeats=2, step_repeats=3, rounds=1)
  names = [p.op for p in result.payoffs]
  assert names and all(n.split(":")[1] in CANDIDATE_KINDS for n in names)
  assert not any("attention" in n for n in names)
  assert "base" in result.step_ms and result.candidates["base"] == {}
  assert result.winner == min(result.step_ms, key=result.step_ms.get)
  assert result.speedup >= 1.0
  assert result.chosen == result.candidates[result.winner]
  for op, preset in result.chosen.items():
    assert result.policy.lookup_name(op).fwd == preset and preset in ("int8", "fp8")
  unchosen = [n for n in names if n not in result.chosen]
  assert all(result.policy.lookup_name(n).fwd == "bf16" for n in unchosen)
  assert PrecisionPolicy.from_json(result.to_json()["policy"]) == result.policy
  lines = result.summary()
  assert "measured" in lines[0] and len(lines) == 1 + len(names)


@pytest.mark.standard_promotion  # optax's update promotes bf16 with float32
def test_a_zero_budget_times_the_base_alone():
  task = tiny.mlp()
  omega = {f"Dense_{i}:dense": {"int8": 1.0, "fp8": 1.0} for i in range(3)}
  result = auto_policy(
    task, 8, presets=("int8",), omega=omega, budget=0.0, trace_repeats=2, step_repeats=3, rounds=1
  )
  assert list(result.step_ms) == ["base"] and result.chosen == {} and result.speedup == 1.0


def test_bad_base_or_preset_is_refused_before_any_tracing():
  task = tiny.mlp()
  with pytest.raises(PlanError, match="base precision 'int8'"):
    auto_policy(task, 8, base="int8")
  with pytest.raises(PlanError, match="preset 'int4' has no kernel"):
    auto_policy(task, 8, presets=("int4",))


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
