"""Re-planning from measured group speeds: the balanced split, the decisions (with hysteresis),
and the trainer that re-balances, logs it, checkpoints it and resumes bit-identically."""

import json

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import QsyncError
from qsync_jax.plan import Plan
from qsync_jax.train.replan import GroupSpeed, Replanner, balance, predicted_ms, probe_sizes
from qsync_jax.train.trainer import Trainer
from tests.trainer.tiny import make_task


def test_balance_gives_each_group_the_batch_its_speed_allows():
  speeds = {"fast": GroupSpeed(0.0, 1.0), "slow": GroupSpeed(0.0, 3.0)}
  assert balance({"fast": 2, "slow": 2}, speeds, 32) == {"fast": 12, "slow": 4}
  assert balance({"fast": 1, "slow": 3}, speeds, 24, granularity=2) == {"fast": 12, "slow": 4}
  # an intercept (fixed cost per step) moves examples to the group that pays less of it
  speeds = {"a": GroupSpeed(4.0, 1.0), "b": GroupSpeed(0.0, 1.0)}
  assert balance({"a": 1, "b": 1}, speeds, 16) == {"a": 6, "b": 10}
  equal = {"a": GroupSpeed(0.0, 1.0), "b": GroupSpeed(0.0, 1.0)}
  assert balance({"a": 2, "b": 2}, equal, 16) == {"a": 4, "b": 4}


def test_balance_is_optimal_against_every_split():
  rng = np.random.default_rng(0)
  for _ in range(30):
    speeds = {g: GroupSpeed(float(rng.uniform(0, 5)), float(rng.uniform(0.2, 3))) for g in "abc"}
    counts = {"a": 1, "b": 2, "c": 1}
    got = predicted_ms(speeds, balance(counts, speeds, 24))
    best = min(
      predicted_ms(speeds, {"a": a, "b": b, "c": 24 - a - 2 * b})
      for a in range(1, 24)
      for b in range(1, 12)
      if 24 - a - 2 * b >= 1
    )
    assert got == pytest.approx(best)


def test_balance_refuses_a_batch_the_groups_cannot_split():
  speeds = {"a": GroupSpeed(0, 1), "b": GroupSpeed(0, 1)}
  with pytest.raises(QsyncError, match=r"global batch 3 cannot be split.*Fix"):
    balance({"a": 2, "b": 2}, speeds, 3)
  with pytest.raises(QsyncError, match=r"global batch 2 cannot be split"):
    balance({"a": 2, "b": 2}, speeds, 2)


def test_speed_fit_and_probe_sizes():
  s = GroupSpeed.fit({4: 6.0, 8: 10.0})
  assert s.intercept_ms == pytest.approx(2.0) and s.slope_ms == pytest.approx(1.0)
  assert GroupSpeed.fit({8: 4.0}).ms(16) == pytest.approx(8.0)
  assert probe_sizes(8) == (4, 8) and probe_sizes(1) == (1, 2)


def _cluster(batch=8):
  return ClusterSpec((DeviceGroup("g0", "cpu", 2, 16, batch), DeviceGroup("g1", "cpu", 2, 16, batch)))


def _measured(per_example, noise=0.0, rng=None):
  """A fake measurement: ``per_example[g]`` ms per example, times 1 ± ``noise``."""

  def measure(program, state, host_batch):
    out = {}
    for g in program.cluster.groups:
      sizes = probe_sizes(g.batch_per_device)
      jitter = (lambda: 1 + rng.uniform(-noise, noise)) if noise else (lambda: 1.0)
      out[g.name] = {b: per_example[g.name] * b * jitter() for b in sizes}
    return out

  return measure


def test_decisions_need_a_predicted_gain_and_never_oscillate_on_noise():
  cluster = _cluster()
  rng = np.random.default_rng(1)
  r = Replanner(mode="auto", threshold=0.05, warmup_steps=2, window=10)
  measure = _measured({"g0": 1.0, "g1": 1.0}, noise=0.02, rng=rng)
  decisions = []
  for step in range(1, 400):
    step_ms = 8.0 * (1 + rng.uniform(-0.04, 0.04))  # noisy wall time around a constant
    if r.wants_measurement(step, 0, step_ms):
      new, _ = r.decide(step, cluster, measure(type("P", (), {"cluster": cluster}), None, None))
      decisions.append(new)
  assert decisions and all(d is None for d in decisions)  # measured, never re-planned


def test_auto_replans_when_a_group_slows_and_back_when_it_recovers():
  r = Replanner(mode="auto", threshold=0.05, warmup_steps=2, window=5)
  cluster = _cluster()
  program = type("P", (), {})()
  splits = []
  for step in range(1, 200):
    slow = 2.0 if 40 <= step < 120 else 1.0  # g1 loses half its speed, then gets it back
    program.cluster = cluster
    batches = {g.name: g.batch_per_device for g in cluster.groups}
    step_ms = max(batches["g0"] * 1.0, batches["g1"] * slow)
    if r.wants_measurement(step, 0, step_ms):
      new, _ = r.decide(step, cluster, _measured({"g0": 1.0, "g1": slow})(program, None, None))
      if new is not None:
        cluster = cluster.with_batch_per_device(new)
        splits.append((step, new))
  assert [s for _, s in splits] == [{"g0": 11, "g1": 5}, {"g0": 8, "g1": 8}]
  # slowing shows in the step time (within a window or two); recovery does not (g0 is now the
  # slowest), so it is found by the periodic re-measurement, every 10 windows of 5 steps
  assert 40 <= splits[0][0] < 55 and 120 <= splits[1][0] < 175


def _trainer(tmp_path, name, replan, resume=False):
  return Trainer(
    make_task(),
    _cluster(),
    Plan(),
    optax.adam(1e-2),
    seed=3,
    out_dir=str(tmp_path / name),
    devices=jax.devices()[:4],
    replan=replan,
    resume=resume,
  )


def test_the_trainer_rebalances_logs_and_resumes_bit_identically(tmp_path):
  def replanner():
    return Replanner(mode="once", warmup_steps=2, measure=_measured({"g0": 1.0, "g1": 3.0}))

  full = _trainer(tmp_path, "full", replanner())
  full.run(8)
  assert {g.name: g.batch_per_device for g in full.program.cluster.groups} == {"g0": 12, "g1": 4}
  assert full.global_batch == 32
  lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
  replans = [x["replan"] for x in lines if "replan" in x]
  assert len(replans) == 1 and replans[0]["step"] == 2 and replans[0]["new"] == {"g0": 12, "g1": 4}
  assert replans[0]["replanned"] and replans[0]["predicted_ms_new"] < replans[0]["predicted_ms_old"]
  full_params = jax.device_get(full.params)
  full.close()

  first = _trainer(tmp_path, "cut", replanner())
  first.run(5)
  first.close()
  resumed = _trainer(tmp_path, "cut", replanner(), resume=True)
  assert resumed.step == 5
  assert {g.name: g.batch_per_device for g in resumed.program.cluster.groups} == {"g0": 12, "g1": 4}
  resumed.run(8)
  assert not [x for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines() if '"replan"' in x][1:]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), full_params)
  resumed.close()


def test_a_replan_of_a_step_builder_strategy_is_refused():
  with pytest.raises(QsyncError, match=r"replan='once'.*selsync.*Fix"):
    Trainer(make_task(), _cluster(), grad_sync="selsync", devices=jax.devices()[:4], replan="once")


def test_measure_groups_times_each_group_at_two_batches_on_its_own_device():
  from qsync_jax.train.replan import measure_groups

  cluster = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 8), DeviceGroup("g1", "cpu", 2, 16, 4)))
  policy = {"rules": [{"path": "Dense_0", "policy": "int8"}], "__default__": None}
  trainer = Trainer(make_task(), cluster, Plan.from_json({"policies": {"g1": policy}}), devices=jax.devices()[:3])
  measured = measure_groups(trainer.program, trainer.state, trainer._sample, repeats=2)
  assert sorted(measured) == ["g0", "g1"]
  assert sorted(measured["g0"]) == [4, 8] and sorted(measured["g1"]) == [2, 4]
  assert all(ms > 0 for m in measured.values() for ms in m.values())
