"""The batch-independent share of a profile's compute: its fit, its JSON and how the replay
prices batches and micro-steps with it."""

import dataclasses

import pytest

from planners.predictor.replay import one_device_compute_ms
from planners.profile import GroupCost, Profile
from planners.profiler.fit import fit_fixed_share, fit_profile
from qsync_jax.errors import PlanError
from tests.planners.fakes import fake_profile

LEGS = [
  (1.0, 2.0, 3.0),
  (2.0, 1.0, 1.0),
]  # fp32 ms per op: 8 ms of op compute at batch 8 (no dlhs of the first)


def _group(prof: Profile, batch: int, micro_steps: int = 1) -> GroupCost:
  return GroupCost("g", prof, {}, batch, micro_steps)


def test_compute_scale_is_linear_without_a_fixed_share():
  prof = fake_profile(LEGS, batch=8)
  assert _group(prof, 4).compute_scale == 0.5
  assert _group(prof, 16, 2).compute_scale == 2.0


def test_each_micro_step_pays_the_fixed_share_again():
  prof = dataclasses.replace(fake_profile(LEGS, batch=8), fixed_share=0.4)
  assert _group(prof, 8).compute_scale == pytest.approx(1.0)
  assert _group(prof, 4).compute_scale == pytest.approx(0.4 + 0.6 * 0.5)
  # two micro-steps of 8: twice the profiled pass
  assert _group(prof, 16, 2).compute_scale == pytest.approx(2.0)
  assert _group(prof, 16, 1).compute_scale == pytest.approx(0.4 + 0.6 * 2)


def test_the_replay_charges_micro_steps_their_fixed_share():
  prof = dataclasses.replace(fake_profile(LEGS, batch=8, optimizer_ms=1.5), fixed_share=0.5)
  linear = dataclasses.replace(prof, fixed_share=0.0)
  one_pass = one_device_compute_ms(_group(prof, 16))
  two_steps = one_device_compute_ms(_group(prof, 16, 2))
  # at the profiled batch the share changes nothing: 8 ms of ops plus the optimizer
  assert one_device_compute_ms(_group(prof, 8)) == pytest.approx(9.5)
  assert one_device_compute_ms(_group(linear, 16, 2)) == pytest.approx(17.5)
  assert two_steps == pytest.approx(2 * 8.0 + 1.5)  # two passes of 8
  assert one_pass == pytest.approx(8.0 * (0.5 + 0.5 * 2) + 1.5)
  assert two_steps - one_pass == pytest.approx(0.5 * 8.0)


@pytest.mark.parametrize("f", [0.0, 0.3, 0.9])
def test_fit_fixed_share_recovers_an_affine_compute(f):
  base = fake_profile(LEGS, batch=8, optimizer_ms=3.0, remainder_ms=12.0)
  truth = dataclasses.replace(base, fixed_share=f)
  for small in (1, 4, 7):
    points = {b: one_device_compute_ms(_group(truth, b)) for b in (small, 8)}
    assert fit_fixed_share(base, {}, points) == pytest.approx(f)


def test_fit_fixed_share_clips_keeps_and_checks_its_batches():
  base = fake_profile(LEGS, batch=8, optimizer_ms=3.0)
  assert fit_fixed_share(base, {}, {4: 3.0, 8: 13.0}) == 0.0  # the half batch costs nothing
  # a step that does not grow with the batch says nothing the model can hold: the share is kept
  assert fit_fixed_share(dataclasses.replace(base, fixed_share=0.2), {}, {4: 13.0, 8: 13.0}) == 0.2
  assert fit_fixed_share(base, {}, {4: 14.0, 8: 13.0}) == 0.0
  with pytest.raises(ValueError, match="needs points at two batches or more"):
    fit_fixed_share(base, {}, {8: 13.0})


def test_fit_profile_fits_the_share_and_keeps_the_fit_step():
  meta = {"fit_preset": "fp32", "fit_step_ms": 21.5, "fit_small_batch": 4, "fit_step_small_ms": 15.5}
  prof = fake_profile(LEGS, batch=8, optimizer_ms=1.5)
  fitted = fit_profile(dataclasses.replace(prof, meta=meta))
  # compute 20 ms at 8 and 14 ms at 4: f = (14/20 - 1/2) / (1/2)
  assert fitted.fixed_share == pytest.approx(0.4)
  assert one_device_compute_ms(_group(fitted, 8)) == pytest.approx(21.5)
  assert one_device_compute_ms(_group(fitted, 4)) == pytest.approx(15.5)
  without = fit_profile(dataclasses.replace(prof, meta={"fit_preset": "fp32", "fit_step_ms": 21.5}))
  assert without.fixed_share == 0.0


def test_fixed_share_round_trips_and_is_checked(tmp_path):
  prof = dataclasses.replace(fake_profile(LEGS), fixed_share=0.25)
  path = str(tmp_path / "p.json")
  prof.save(path)
  assert Profile.load(path).fixed_share == 0.25
  obj = prof.to_json()
  del obj["fixed_share"]
  assert Profile.from_json(obj).fixed_share == 0.0  # a profile written before the field
  with pytest.raises(PlanError, match=r"fixed_share 1\.5 is not a share between 0 and 1"):
    Profile.from_json({**prof.to_json(), "fixed_share": 1.5}, source="p.json")
