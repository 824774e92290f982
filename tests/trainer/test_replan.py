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
from qsync_jax.train.replan import PROBE_COST_RUNS, GroupSpeed, Replanner, balance, predicted_ms, probe_sizes
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


def _measured(per_example, noise=0.0, rng=None, calls=None):
  """A fake measurement: ``per_example[g]`` ms per example (a number, or a function of the
  batch giving the time), times 1 ± ``noise``; each call's sizes appended to ``calls``."""

  def measure(program, state, host_batch, sizes=None):
    if sizes is None:
      sizes = {g.name: probe_sizes(g.batch_per_device) for g in program.cluster.groups}
    if calls is not None:
      calls.append({g: tuple(b) for g, b in sizes.items() if b})
    out = {}
    for g, batches in sizes.items():
      jitter = (lambda: 1 + rng.uniform(-noise, noise)) if noise else (lambda: 1.0)
      time_of = per_example[g] if callable(per_example[g]) else (lambda b, c=per_example[g]: c * b)
      out[g] = {b: time_of(b) * jitter() for b in batches}
    return out

  return measure


class _Program:
  """What ``Replanner.replan`` reads of a program: its cluster."""

  def __init__(self, cluster):
    self.cluster = cluster


def test_decisions_need_a_predicted_gain_and_never_oscillate_on_noise():
  cluster = _cluster()
  rng = np.random.default_rng(1)
  r = Replanner(mode="auto", threshold=0.05, warmup_steps=2, window=10)
  measure = _measured({"g0": 1.0, "g1": 1.0}, noise=0.02, rng=rng)
  r.measure, r.max_overhead = measure, 1.0
  decisions = []
  for step in range(1, 400):
    step_ms = 8.0 * (1 + rng.uniform(-0.04, 0.04))  # noisy wall time around a constant
    if r.wants_measurement(step, 0, step_ms):
      decisions.append(r.replan(step, _Program(cluster), None, None)[0])
  assert len(decisions) > 3 and all(d is None for d in decisions)  # measured, never re-planned


def test_auto_replans_when_a_group_slows_and_back_when_it_recovers():
  slow = 1.0
  calls = []
  r = Replanner(
    mode="auto", threshold=0.05, warmup_steps=2, window=5, max_overhead=0.5,
    measure=_measured({"g0": 1.0, "g1": lambda b: slow * b}, calls=calls),
  )
  cluster = _cluster()
  splits, checks = [], []
  for step in range(1, 200):
    slow = 2.0 if 40 <= step < 120 else 1.0  # g1 loses half its speed, then gets it back
    batches = {g.name: g.batch_per_device for g in cluster.groups}
    step_ms = max(batches["g0"] * 1.0, batches["g1"] * slow)
    if r.wants_measurement(step, 0, step_ms):
      checks.append(step)
      new, _ = r.replan(step, _Program(cluster), None, None)
      if new is not None:
        cluster = cluster.with_batch_per_device(new)
        splits.append((step, new))
  assert [s for _, s in splits] == [{"g0": 11, "g1": 5}, {"g0": 8, "g1": 8}]
  # slowing shows in the step time (two windows in a row); recovery does not (g0 is now the
  # slowest), so it is found by the periodic check, every 10 windows of 5 steps
  assert 40 <= splits[0][0] < 60 and 120 <= splits[1][0] < 175
  # a check measures each group at its running batch only; a full measurement follows only
  # when a group's time moved; the sizes it adds are ones measured before where it can
  assert checks == [2, 47, 97, 147, 197]
  assert calls == [
    {"g0": (4, 8), "g1": (4, 8)},  # step 2: the first decision (8/8 kept)
    {"g0": (8,), "g1": (8,)},  # step 47: a check (the step time drifted): g1 moved,
    {"g1": (8,)},  # confirmed by a second measurement
    {"g0": (4,), "g1": (4,)},  # the second size of each, then the balanced split's batches
    {"g0": (11,), "g1": (5,)},
    {"g0": (11,), "g1": (5,)},  # step 97: a periodic check, nothing moved
    {"g0": (11,), "g1": (5,)},  # step 147: a periodic check: g1 moved (back), confirmed
    {"g1": (5,)},
    {"g0": (4,), "g1": (8,)},  # sizes measured before (their probes are compiled)
    {"g0": (8,)},
    {"g0": (8,), "g1": (8,)},  # step 197: a periodic check
  ]


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
  from qsync_jax.train.replan import compile_seconds, measure_groups

  cluster = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 8), DeviceGroup("g1", "cpu", 2, 16, 4)))
  policy = {"rules": [{"path": "Dense_0", "policy": "int8"}], "__default__": None}
  trainer = Trainer(make_task(), cluster, Plan.from_json({"policies": {"g1": policy}}), devices=jax.devices()[:3])
  cache, before = {}, compile_seconds()
  measured = measure_groups(trainer.program, trainer.state, trainer._sample, cache=cache)
  compiled = compile_seconds()
  assert compiled > before  # its warm-up runs compiled (what auto's overhead bound leaves aside)
  assert sorted(measured) == ["g0", "g1"]
  assert sorted(measured["g0"]) == [4, 8] and sorted(measured["g1"]) == [2, 4]
  assert all(ms > 0 for m in measured.values() for ms in m.values())
  # one jitted probe per policy, kept: measuring again (at sizes of one's own) compiles nothing new
  probes = [fn for _, _, fn in cache.values()]
  assert len(probes) == 2
  versions = [fn._cache_size() for fn in probes]
  again = measure_groups(trainer.program, trainer.state, trainer._sample, sizes={"g0": (8,), "g1": (2,)}, cache=cache)
  assert {g: sorted(m) for g, m in again.items()} == {"g0": [8], "g1": [2]}
  assert [fn._cache_size() for fn in probes] == versions and compile_seconds() == compiled


def test_the_split_is_refined_where_it_lands_so_a_nonlinear_slowdown_is_followed():
  # g1 shares its device with another process: much of each step is lost whatever its batch, so
  # its time is far from the line through half its batch and its batch at small batches
  times = {"g0": lambda b: 0.5 * b, "g1": lambda b: 8.0 * b**0.5}
  cluster = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 16), DeviceGroup("g1", "cpu", 1, 16, 16)))
  step = {a: max(times["g0"](a), times["g1"](32 - a)) for a in range(1, 32)}
  best = min(step, key=step.get)
  got = {}
  for refine in (0, 3):
    calls = []
    r = Replanner(mode="once", refine=refine, measure=_measured(times, calls=calls))
    new, record = r.replan(3, _Program(cluster), None, None)
    got[refine] = new["g0"]
    if refine:  # the chosen split was measured, not extrapolated
      assert str(new["g0"]) in record["measured_ms"]["g0"] and str(new["g1"]) in record["measured_ms"]["g1"]
      assert record["predicted_ms_new"] == pytest.approx(step[new["g0"]], abs=1e-3)
  assert got[3] == best and step[got[0]] > 1.05 * step[best]  # the line alone: > 5 % off


def test_checks_cost_at_most_max_overhead_of_the_training_time():
  # a noisy host: every check finds a group 10-40 % off, so each one measures, confirms and
  # measures in full; what they cost (on the replanner's clock) stays below max_overhead
  now = [0.0]
  fake = _measured({"g0": 1.0, "g1": 1.0}, noise=0.4, rng=np.random.default_rng(2))

  def measure(program, state, host_batch, sizes=None):
    out = fake(program, state, host_batch, sizes)
    now[0] += PROBE_COST_RUNS * sum(sum(ms.values()) for ms in out.values()) / 1e3  # seconds
    return out

  r = Replanner(mode="auto", warmup_steps=1, window=5, recheck_windows=1, max_overhead=0.05,
                measure=measure, clock=lambda: now[0])
  program, trained, spent, measurements = _Program(_cluster()), 0.0, [], 0
  for step in range(1, 5000):
    trained += 10.0  # ms per step
    if r.wants_measurement(step, 0, 10.0 * (1 + 0.2 * np.sin(step))):
      t0 = now[0]
      r.replan(step, program, None, None)
      if step > 1:  # the first decision is every mode's
        spent.append(1e3 * (now[0] - t0))
      measurements += 1
  assert measurements > 5 and sum(spent[:-1]) <= 0.05 * trained


def test_auto_trainer_replans_back_to_the_step_it_built_before_and_logs_the_measured_step(tmp_path):
  slow = {"g1": 3.0}
  reported = []
  # (the fake probe times are far below the steps' on CPU: the periodic check is never held back)
  r = Replanner(mode="auto", warmup_steps=2, window=3, recheck_windows=2, max_overhead=1.0,
                measure=_measured({"g0": 1e-3, "g1": lambda b: slow["g1"] * 1e-3 * b}), report=reported.append)
  trainer = _trainer(tmp_path, "auto", r)
  built = []
  build = trainer._build
  trainer._build = lambda plan: built.append(plan) or build(plan)
  original = trainer.program

  def recover(step, values):
    if step == 12:
      slow["g1"] = 1.0

  trainer.run(40, callback=recover)
  assert [x["new"] for x in r.history] == [{"g0": 12, "g1": 4}, {"g0": 8, "g1": 8}]
  assert len(built) == 1 and trainer.program is original  # back to the first split: not rebuilt
  lines = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
  measured = [x for x in lines if "replan_measured" in x]
  assert [x["replan_measured"]["decision_step"] for x in measured] == [x["step"] for x in r.history]
  assert all(x["replan_measured"]["measured_ms"] > 0 for x in measured)
  assert all("measured_ms_new" in x for x in r.history)
  assert [x["step"] for x in reported if "replanned" in x] == [x["step"] for x in lines if "replan" in x]
  trainer.close()


def test_a_check_takes_a_running_batch_no_decision_measured_as_its_reference():
  speed = {"g0": 1.0, "g1": 3.0}
  r = Replanner(mode="auto", refine=0, measure=_measured({g: (lambda b, g=g: speed[g] * b) for g in speed}))
  cluster = _cluster()
  new, _ = r.replan(3, _Program(cluster), None, None)
  assert new == {"g0": 12, "g1": 4}  # g0 was measured at 4 and 8 only
  cluster = cluster.with_batch_per_device(new)
  assert r.replan(50, _Program(cluster), None, None) == (None, None)  # g0 at 12: now its reference
  speed["g0"] = 2.0  # g0 slows down: the next check sees it
  new, record = r.replan(100, _Program(cluster), None, None)
  assert record is not None and new == {"g0": 10, "g1": 6}
