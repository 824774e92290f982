"""Profiles calibrated to measured group speeds: the scale is recovered, every time is scaled, a
group's own profile wins over its device type's, and two groups of one device type measured at
different speeds plan differently."""

import dataclasses

import pytest

from planners.allocator.greedy import make_problem
from planners.allocator.joint import joint_plan
from planners.calibrate import (
  GroupMeasurement,
  calibrated_profile,
  calibrated_profiles,
  check_run_groups,
  fit_scale,
  latest_measurements,
)
from planners.predictor.replay import base_profile, one_device_compute_ms, predict, profile_for
from planners.profile import GroupCost, Profile
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from tests.planners.fakes import fake_indicator, fake_profile


def _base():
  return fake_profile(
    [(1.0, 0.5, 0.7), (2.0, 1.0, 1.5)], batch=8, remainder_ms=0.6, optimizer_ms=0.4, cast_a=1e-4
  )


def _leaves(tree, path=()):
  """``{path: number}`` of a nested dict of numbers."""
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in _leaves(sub, (*path, key)).items()}
  return {path: tree}


def test_a_profile_scaled_by_a_known_factor_is_recovered_from_its_measured_points():
  base = _base()
  # op 1 at QSync's int8 op (int8 forward, fp16 backward): its saved operands are dequantized, a cast
  policies = {"Dense_0:dense": None, "Dense_1:dense": OpPolicy.preset("int8_fwd")}
  truth = base.times_scaled(2.5)
  points = {b: one_device_compute_ms(GroupCost("g", truth, policies, b)) for b in (4, 8, 12)}
  cal = calibrated_profile(base, "g", policies, GroupMeasurement(7, points), "runs/a", "cpu.json")
  record = cal.meta["calibration"]
  assert record["scale"] == pytest.approx(2.5, rel=1e-12) and record["rel_rms_error"] < 1e-12
  assert record["run"] == "runs/a" and record["step"] == 7
  assert record["base"] == {"source": "measured", "device_type": "cpu", "file": "cpu.json"}
  assert [p["batch"] for p in record["points"]] == [4, 8, 12]
  assert [p["measured_ms"] for p in record["points"]] == [points[b] for b in (4, 8, 12)]
  # every time scaled (legs, whole policies, remainder, optimizer, casts), nothing else
  assert _leaves(cal.op_ms) == pytest.approx(_leaves(truth.op_ms), rel=1e-12)
  assert _leaves(cal.op_ms) != pytest.approx(_leaves(base.op_ms))
  assert cal.remainder_ms == pytest.approx(truth.remainder_ms) and cal.optimizer_ms == pytest.approx(1.0)
  assert {k: (c.a, c.b) for k, c in cal.cast.items()} == {k: (2.5e-4, 0.0) for k in base.cast}
  assert (cal.ops, cal.memory, cal.batch_per_device) == (base.ops, base.memory, base.batch_per_device)
  assert (cal.group, cal.source, cal.key) == ("g", "calibrated", "group:g")
  # at a batch it was not measured at, the calibrated profile predicts what the truth does
  at_20 = one_device_compute_ms(GroupCost("g", cal, policies, 20))
  assert at_20 == pytest.approx(one_device_compute_ms(GroupCost("g", truth, policies, 20)), rel=1e-12)


@pytest.mark.parametrize("share", [0.0, 0.3, 0.8])
def test_points_at_several_batches_recover_the_fixed_share_and_the_scale(share):
  base = _base()
  policies = {"Dense_0:dense": None, "Dense_1:dense": OpPolicy.preset("int8_fwd")}
  truth = dataclasses.replace(base, fixed_share=share).times_scaled(1.7)
  points = {b: one_device_compute_ms(GroupCost("g", truth, policies, b)) for b in (4, 8, 16)}
  cal = calibrated_profile(base, "g", policies, GroupMeasurement(3, points), "runs/a", "cpu.json")
  assert cal.fixed_share == pytest.approx(share, abs=1e-9)
  assert cal.meta["calibration"]["fixed_share"] == cal.fixed_share
  assert cal.meta["calibration"]["scale"] == pytest.approx(1.7, rel=1e-9)
  for b in (2, 24):  # batches it was not measured at
    want = one_device_compute_ms(GroupCost("g", truth, policies, b))
    assert one_device_compute_ms(GroupCost("g", cal, policies, b)) == pytest.approx(want, rel=1e-9)


def test_one_batch_or_a_line_that_does_not_grow_keeps_the_profiles_fixed_share():
  base = dataclasses.replace(_base(), fixed_share=0.25)
  one = calibrated_profile(base, "g", {}, GroupMeasurement(1, {8: 20.0}), "runs/a", "cpu.json")
  assert one.fixed_share == 0.25
  # noise (or a time-sliced device): the time does not grow with the batch, the share is kept
  flat = calibrated_profile(base, "g", {}, GroupMeasurement(1, {4: 20.0, 8: 19.0}), "runs/a", "cpu.json")
  assert flat.fixed_share == 0.25


def test_one_device_compute_is_the_replays_compute_of_a_replicated_update():
  base = _base()
  cluster = ClusterSpec((DeviceGroup("g", "cpu", 2, 16.0, 8),))
  pred = predict(cluster, {"cpu": base}, Plan())
  assert one_device_compute_ms(GroupCost("g", base, {}, 8)) == pytest.approx(pred.group_compute_ms["g"])


def test_fit_scale_is_least_squares_through_the_origin():
  assert fit_scale([(1.0, 2.0), (2.0, 3.0)]) == pytest.approx((2.0 + 6.0) / (1.0 + 4.0))
  assert fit_scale([(2.0, 5.0)]) == pytest.approx(2.5)
  with pytest.raises(PlanError, match="no point with a modeled time above 0.*Fix"):
    fit_scale([])
  with pytest.raises(PlanError, match="Fix"):
    fit_scale([(0.0, 1.0)])


def test_the_latest_measurement_of_each_group_counts():
  records = [
    {"step": 1, "loss": 0.5},
    {"step": 3, "replan": {"measured_ms": {"a": {"4": 1.0, "8": 2.0}, "b": {"4": 3.0}}}},
    {"step": 9, "replan": {"checked": "no group moved"}},
    {"step": 12, "replan_measured": {"measured_ms": 5.0}},
    {"step": 20, "replan": {"measured_ms": {"a": {"8": 1.5}}}},
  ]
  got = latest_measurements(records, "m.jsonl")
  assert got == {"a": GroupMeasurement(20, {8: 1.5}), "b": GroupMeasurement(3, {4: 3.0})}
  assert latest_measurements(records[:1], "m.jsonl") == {}
  for bad in ({"4": -1.0}, {"x": 1.0}, {}, [1.0], {"0": 1.0}, {"4": float("nan")}):
    with pytest.raises(
      PlanError, match=r"m.jsonl: the measured_ms of group 'a'.*not \{\"<per-device batch>\": ms\}.*Fix"
    ):
      latest_measurements([{"step": 1, "replan": {"measured_ms": {"a": bad}}}], "m.jsonl")


def _cluster():
  return ClusterSpec(
    (DeviceGroup("g0", "cpu", 2, 16.0, 8, 100.0), DeviceGroup("g1", "cpu", 2, 16.0, 8, 100.0))
  )


def _measured(base, slowdown):
  """Measured points of ``_cluster``'s groups: each ``slowdown[g]`` × the modeled compute."""
  return {
    g: GroupMeasurement(5, {b: s * one_device_compute_ms(GroupCost(g, base, {}, b)) for b in (4, 8)})
    for g, s in slowdown.items()
  }


def test_two_groups_of_one_device_type_measured_apart_plan_apart():
  """One GPU shared with another job: its group is measured 3× slower than its twin. Costed from
  the device type's profile they are alike (equal batches); calibrated, the slower one gets less."""
  base = _base()
  cluster = _cluster()
  indicator = fake_indicator(base.op_names, [1.0, 1.0])
  measured = _measured(base, {"g0": 1.0, "g1": 3.0})
  cal = calibrated_profiles(cluster, {"cpu": base}, Plan(), measured, "runs/a", {"cpu": "cpu.json"})
  assert sorted(cal) == ["group:g0", "group:g1"]
  assert cal["group:g0"].meta["calibration"]["scale"] == pytest.approx(1.0)
  assert cal["group:g1"].meta["calibration"]["scale"] == pytest.approx(3.0)
  batches = {}
  for name, profiles in (("type", {"cpu": base}), ("calibrated", {"cpu": base, **cal})):
    chosen, _, _ = joint_plan(make_problem(cluster, profiles, indicator, ("g0", "g1"), "fp32"), 1, 0.0)
    batches[name] = chosen.batches
  assert batches["type"] == (8, 8)
  g0, g1 = batches["calibrated"]
  assert g0 > g1 > 0 and 2 * (g0 + g1) == cluster.global_batch
  pred = predict(cluster, {"cpu": base, **cal}, Plan())
  assert pred.sources == {"g0": "calibrated (cpu)", "g1": "calibrated (cpu)"}
  assert pred.group_compute_ms["g1"] == pytest.approx(3 * pred.group_compute_ms["g0"])


def test_a_groups_own_profile_wins_and_round_trips():
  base = _base()
  own = dataclasses.replace(base.times_scaled(2.0), group="g1", source="calibrated")
  profiles = {"cpu": base, own.key: own}
  assert profile_for(profiles, "cpu", "g1") is own
  assert profile_for(profiles, "cpu", "g0") is base and profile_for(profiles, "cpu") is base
  # a device type without a profile is modeled from a device type's profile, not from a group's
  assert base_profile({own.key: own, "cpu": base}) is base
  modeled = profile_for({own.key: own}, "T4", "g0")
  assert (modeled.device_type, modeled.group, modeled.source) == ("T4", None, "modeled")
  again = Profile.from_json(own.to_json())
  assert again == own and "group" not in base.to_json()


def test_the_run_must_be_of_the_cluster_and_measure_every_group():
  base = _base()
  cluster = _cluster()
  measured = _measured(base, {"g0": 1.0, "g1": 1.0})
  check_run_groups(cluster, measured, [["g0", 2, 8], ["g1", 2, 4]], "runs/a", "c.json")  # batches may move
  with pytest.raises(PlanError, match=r"ran groups \{'g0': 2, 'g2': 2\}.*c.json.*Fix: pass the cluster spec"):
    check_run_groups(cluster, measured, [["g0", 2, 8], ["g2", 2, 8]], "runs/a", "c.json")
  with pytest.raises(PlanError, match=r"ran groups \{'g0': 2, 'g1': 4\}"):
    check_run_groups(cluster, measured, [["g0", 2, 8], ["g1", 4, 8]], "runs/a", "c.json")
  with pytest.raises(PlanError, match=r"no measurement of group\(s\) \['g1'\].*Fix"):
    check_run_groups(cluster, {"g0": measured["g0"]}, [["g0", 2, 8], ["g1", 2, 8]], "runs/a", "c.json")


def test_a_lifted_group_is_calibrated_from_the_points_of_the_policy_the_plan_runs():
  # The record lifted g's int8 legs to fp16 (the trainer's precision lift): its measured_ms are of
  # the running (int8) policy, lifted.measured_ms of the lifted one. The plan that ran holds the
  # lifted policy unless the re-plan was undone; each must calibrate from its own points.
  base = _base()
  int8, fp16 = PrecisionPolicy.uniform("int8_fwd"), PrecisionPolicy.uniform("fp16")
  record = {
    "step": 23,
    "replan": {
      "measured_ms": {"g": {"8": 10.0}},
      "lifted": {"g": {"old": int8.to_json(), "new": fp16.to_json(), "measured_ms": {"8": 6.0}}},
    },
  }
  measured = latest_measurements([record], "m.jsonl")
  cluster = ClusterSpec((DeviceGroup("g", "cpu", 1, 16.0, 8),))
  scales = {}
  for name, policy in (("lifted", fp16), ("undone", int8)):
    plan = Plan(policies={"g": policy})
    cal = calibrated_profiles(cluster, {"cpu": base}, plan, measured, "runs/a", {"cpu": "cpu.json"})[
      "group:g"
    ]
    points = cal.meta["calibration"]["points"]
    scales[name] = cal.meta["calibration"]["scale"]
    assert [p["measured_ms"] for p in points] == [6.0 if name == "lifted" else 10.0]
  assert scales["lifted"] != pytest.approx(scales["undone"])
