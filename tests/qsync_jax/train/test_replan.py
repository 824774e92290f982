"""Re-planning from measured group speeds: the balanced split, the decisions (with hysteresis),
the undo of a re-plan whose step is measured slower, the precision lift, and the trainer that
re-balances, logs it, checkpoints it and resumes bit-identically."""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import QsyncError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import PRECISION_BITS, OpPolicy
from qsync_jax.train.replan import (
  PROBE_COST_RUNS,
  GroupSpeed,
  Replanner,
  Running,
  Undone,
  balance,
  decide,
  lifted_policy,
  predicted_ms,
  probe_sizes,
)
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import make_task


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


def _measured(per_example, noise=0.0, rng=None, calls=None, lifted=None):
  """A fake measurement: ``per_example[g]`` ms per example (a number, or a function of the
  batch giving the time), times 1 ± ``noise``; ``lifted[g]`` likewise for a group measured at
  a policy of ``policies`` (checked to be ``lifted_policy`` of its plan's); each call's sizes
  appended to ``calls``."""

  def measure(program, state, host_batch, sizes=None, policies=None):
    if sizes is None:
      sizes = {g.name: probe_sizes(g.batch_per_device) for g in program.cluster.groups}
    if calls is not None:
      calls.append({g: tuple(b) for g, b in sizes.items() if b})
    out = {}
    for g, batches in sizes.items():
      jitter = (lambda: 1 + rng.uniform(-noise, noise)) if noise else (lambda: 1.0)
      time_of = per_example[g]
      if policies and g in policies:
        assert policies[g] == lifted_policy(program.plan.policy_for(g))
        time_of = lifted[g]
      time_of = time_of if callable(time_of) else (lambda b, c=time_of: c * b)
      out[g] = {b: time_of(b) * jitter() for b in batches}
    return out

  return measure


class _Program:
  """What ``Replanner.replan`` reads of a program: its cluster and plan."""

  def __init__(self, cluster, plan=None):
    self.cluster, self.plan = cluster, plan or Plan()


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
    mode="auto",
    threshold=0.05,
    warmup_steps=2,
    window=5,
    max_overhead=0.5,
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
  assert checks == [7, 47, 97, 147, 197]
  assert calls == [
    {"g0": (4, 8), "g1": (4, 8)},  # step 7: the first decision, after 2 untimed steps and a window (8/8 kept)
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


def _trainer(tmp_path, name, replan, resume=False, plan=None, checkpoint_every=0):
  trainer = Trainer(
    make_task(),
    _cluster(),
    plan or Plan(),
    optax.adam(1e-2),
    seed=3,
    out_dir=str(tmp_path / name),
    checkpoint_every=checkpoint_every,
    devices=jax.devices()[:4],
    replan=replan,
    resume=resume,
  )
  if isinstance(replan, _TimedReplanner):
    replan.trainer = trainer
  return trainer


def _split(trainer) -> dict[str, int]:
  return {g.name: g.batch_per_device for g in trainer.program.cluster.groups}


@dataclasses.dataclass
class _TimedReplanner(Replanner):
  """A replanner that is given ``step_ms(split)`` in place of each timed step's wall time
  (``split``: the running per-device batches of ``trainer``), so that the CPU's timings do not
  decide the test."""

  step_ms: Callable[[dict[str, int]], float] | None = None
  trainer: Any = None

  def wants_measurement(self, step, start_step, step_ms):
    timed = None if step_ms is None else self.step_ms(_split(self.trainer))
    return super().wants_measurement(step, start_step, timed)


def _slowest(per_example):
  """The step time of a split as the fake probes predict it: the slowest group's."""
  return lambda split: max(
    per_example[g](b) if callable(per_example[g]) else per_example[g] * b for g, b in split.items()
  )


INT8_G1 = Plan.from_json({"policies": {"g1": "int8_fwd"}})  # g1: int8 forward, fp16 backward


def _once_on_int8_g1(lifted_g1: float, equal_ms: float, other_ms: float) -> _TimedReplanner:
  """``once`` after 2 untimed steps and a window of 3, the probes measuring g1 (``INT8_G1``) 3×
  slower per example than g0 and its lifted policy at ``lifted_g1``; a step takes ``equal_ms``
  at the 8/8 split and ``other_ms`` at any other."""
  return _TimedReplanner(
    mode="once",
    warmup_steps=2,
    window=3,
    measure=_measured({"g0": 1.0, "g1": 3.0}, lifted={"g1": lifted_g1}),
    step_ms=lambda split: equal_ms if split == {"g0": 8, "g1": 8} else other_ms,
  )


def test_the_trainer_rebalances_lifts_logs_and_resumes_bit_identically(tmp_path):
  # g1's probe at its policy lifted to fp16 is measured twice as fast: the decision takes it
  def replanner():
    return _once_on_int8_g1(lifted_g1=1.5, equal_ms=24.0, other_ms=10.0)

  full = _trainer(tmp_path, "full", replanner(), plan=INT8_G1, checkpoint_every=8)
  full.run(12)
  assert _split(full) == {"g0": 10, "g1": 6}
  assert full.global_batch == 32
  assert full.program.plan.policies["g1"] == PrecisionPolicy.uniform("fp16")  # lifted
  lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
  replans = [x["replan"] for x in lines if "replan" in x]
  # steps 1-2 untimed, 3-5 timed (a window of 3), then the decision
  assert len(replans) == 1 and replans[0]["step"] == 5 and replans[0]["new"] == {"g0": 10, "g1": 6}
  assert replans[0]["replanned"] and replans[0]["predicted_ms_new"] < replans[0]["predicted_ms_old"]
  assert (
    list(replans[0]["lifted"]) == ["g1"] and replans[0]["lifted"]["g1"]["new"]["__default__"]["fwd"] == "fp16"
  )
  assert replans[0]["measured_ms_old"] == 24.0
  # the new split's first full window (steps 6-7 left out: the timer restarts, the step compiles)
  measured = [x for x in lines if "replan_measured" in x]
  assert [x["step"] for x in measured] == [10] and measured[0]["replan_measured"]["measured_ms"] == 10.0
  assert not measured[0]["replan_measured"]["undone"] and full.replanner.history[0]["measured_ms_new"] == 10.0
  full_params = jax.device_get(full.params)
  full.close()

  # resumed from the checkpoint of step 8: after the re-plan, before its step was measured
  resumed = _trainer(tmp_path, "full", replanner(), resume=True, plan=INT8_G1)
  assert resumed.resume(8) and resumed.step == 8
  assert _split(resumed) == {"g0": 10, "g1": 6}
  assert resumed.program.plan.policies["g1"] == PrecisionPolicy.uniform("fp16")
  assert resumed.replanner.times_steps()  # the re-planned split's step is measured after the warm-up
  resumed.run(12)
  assert (
    len([x for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines() if '"replan"' in x]) == 1
  )
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), full_params)
  resumed.close()


def test_a_replan_measured_slower_is_undone_and_a_resumed_run_continues_bit_identically(tmp_path, capsys):
  # the probes say g1 is 3x slower, but the step of the re-planned split is measured slower (a
  # cost the probes do not see): the trainer goes back to 8/8
  # (g1's lifted probe is faster too: the undo restores its policy as well)
  def replanner():
    return _once_on_int8_g1(lifted_g1=2.0, equal_ms=10.0, other_ms=11.0)

  full = _trainer(tmp_path, "full", replanner(), plan=INT8_G1, checkpoint_every=11)
  original = full.program
  full.run(13)
  assert _split(full) == {"g0": 8, "g1": 8} and full.program is original  # its step (and policy) was kept
  history = full.replanner.history
  assert [(r["step"], r.get("replanned"), r.get("undone")) for r in history] == [
    (5, True, None),
    (10, None, 5),
  ]
  assert history[0]["lifted"]["g1"]["new"] == PrecisionPolicy.uniform("fp16").to_json()
  assert history[1]["old"] == {"g0": 11, "g1": 5} and history[1]["new"] == {"g0": 8, "g1": 8}
  assert (history[1]["measured_ms_new"], history[1]["measured_ms_old"]) == (11.0, 10.0)
  assert (
    "replan: step 10: the split of the re-plan at step 5 measured 11 ms, slower than 10 ms before: undone"
    in (capsys.readouterr().err)
  )
  lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
  measured = [x["replan_measured"] for x in lines if "replan_measured" in x]
  assert len(measured) == 1 and measured[0]["undone"] and measured[0]["restored"] == {"g0": 8, "g1": 8}
  assert measured[0]["restored_policies"] == {"g1": INT8_G1.policies["g1"].to_json()}
  full_params = jax.device_get(full.params)
  full.close()

  # resumed from the checkpoint of step 11 (after the undo, at step 10)
  resumed = _trainer(tmp_path, "full", replanner(), resume=True, plan=INT8_G1)
  assert resumed.resume(11) and resumed.step == 11 and _split(resumed) == {"g0": 8, "g1": 8}
  assert resumed.program.plan.policies == INT8_G1.policies
  assert resumed.replanner.history == history and not resumed.replanner.times_steps()  # once: decided
  resumed.run(13)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), full_params)
  resumed.close()


def test_a_replan_of_a_step_builder_strategy_is_refused():
  with pytest.raises(QsyncError, match=r"replan='once'.*selsync.*Fix"):
    Trainer(make_task(), _cluster(), grad_sync="selsync", devices=jax.devices()[:4], replan="once")


def test_measure_groups_times_each_group_at_two_batches_on_its_own_device():
  from qsync_jax.train.replan import compile_seconds, measure_groups

  cluster = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 8), DeviceGroup("g1", "cpu", 2, 16, 4)))
  policy = {"rules": [{"path": "Dense_0", "policy": "int8"}], "__default__": None}
  trainer = Trainer(
    make_task(), cluster, Plan.from_json({"policies": {"g1": policy}}), devices=jax.devices()[:3]
  )
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
  again = measure_groups(
    trainer.program, trainer.state, trainer._sample, sizes={"g0": (8,), "g1": (2,)}, cache=cache
  )
  assert {g: sorted(m) for g, m in again.items()} == {"g0": [8], "g1": [2]}
  assert [fn._cache_size() for fn in probes] == versions and compile_seconds() == compiled
  # a group measured at another policy (as a lifted one is) runs a probe of that policy
  other = {"g1": PrecisionPolicy.uniform("bf16")}
  up = measure_groups(trainer.program, trainer.state, trainer._sample, {"g1": (2,)}, other, cache=cache)
  assert sorted(up) == ["g1"] and up["g1"][2] > 0 and len(cache) == 3


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

  def measure(program, state, host_batch, sizes, policies):
    out = fake(program, state, host_batch, sizes, policies)
    now[0] += PROBE_COST_RUNS * sum(sum(ms.values()) for ms in out.values()) / 1e3  # seconds
    return out

  r = Replanner(
    mode="auto",
    warmup_steps=1,
    window=5,
    recheck_windows=1,
    max_overhead=0.05,
    measure=measure,
    clock=lambda: now[0],
  )
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
  speeds = {"g0": 1e-3, "g1": lambda b: slow["g1"] * 1e-3 * b}
  # (the fake probe times are far below the steps' on CPU: the periodic check is never held back)
  r = _TimedReplanner(
    mode="auto",
    warmup_steps=2,
    window=3,
    recheck_windows=2,
    max_overhead=1.0,
    measure=_measured(speeds),
    report=reported.append,
    step_ms=_slowest(speeds),
  )
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


def _run_auto(r, cluster, steps, step_ms_of, rng, first_step=1):
  """Drives ``r`` as the trainer does, ``step_ms_of(split)`` the running split's step time
  (times 1 ± 3 %); returns the cluster at the end."""
  for step in range(first_step, first_step + steps):
    split = {g.name: g.batch_per_device for g in cluster.groups}
    if r.wants_measurement(step, 0, step_ms_of(split) * (1 + rng.uniform(-0.03, 0.03))):
      new, _ = r.replan(step, _Program(cluster), None, None)
      if new is not None:
        cluster = cluster.with_batch_per_device(new)
    for note in r.take_notes():
      if note["undone"]:
        cluster = cluster.with_batch_per_device(note["restored"])
  return cluster


def test_once_times_a_window_before_deciding_and_keeps_a_replan_measured_faster():
  r = Replanner(mode="once", warmup_steps=2, window=4, measure=_measured({"g0": 1.0, "g1": 3.0}))
  cluster = _cluster()
  assert r.times_steps()
  times = [50.0, 50.0, 24.0, 26.0, 23.0, 25.0]  # steps 1-2 (compiling) are not counted
  assert [r.wants_measurement(s, 0, ms) for s, ms in enumerate(times, 1)] == [False] * 5 + [True]
  new, record = r.replan(6, _Program(cluster), None, None)
  assert new == {"g0": 12, "g1": 4} and record["measured_ms_old"] == 24.5  # the window's median
  assert r.times_steps()  # the new split's window is timed
  assert not any(r.wants_measurement(s, 0, None) for s in (7, 8))  # the timer restarts after a switch
  assert not any(r.wants_measurement(s, 0, ms) for s, ms in zip(range(9, 13), (13.0, 12.0, 14.0, 12.5)))
  assert record["measured_ms_new"] == 12.75 and r.history == [record]
  notes = r.take_notes()
  assert [(n["step"], n["measured_ms"], n["measured_ms_old"], n["undone"]) for n in notes] == [
    (12, 12.75, 24.5, False)
  ]
  assert not r.times_steps() and not r.wants_measurement(13, 0, 12.0)  # once: done


def test_an_undone_split_is_not_chosen_again_until_a_speed_moves():
  rng = np.random.default_rng(4)
  speed = {"g0": 1.0, "g1": 3.0}
  measure = _measured({g: (lambda b, g=g: speed[g] * b) for g in speed}, noise=0.02, rng=rng)
  r = Replanner(mode="auto", warmup_steps=2, window=5, recheck_windows=2, max_overhead=1.0, measure=measure)
  # the probes predict 12/4 twice as fast, but its step is measured slower than 8/8's
  slower = {(8, 8): 30.0, (12, 4): 33.0}
  cluster = _run_auto(r, _cluster(), 300, lambda split: slower[tuple(split.values())], rng)
  assert {g.name: g.batch_per_device for g in cluster.groups} == {"g0": 8, "g1": 8}
  assert [(r.get("replanned"), r.get("undone"), r["new"]) for r in r.history] == [
    (True, None, {"g0": 12, "g1": 4}),
    (None, r.history[0]["step"], {"g0": 8, "g1": 8}),
  ]  # checks every 2 windows found no group moved: nothing more, no oscillation
  # a full decision under unchanged (2 % noisy) speeds: the balanced split is the undone one, kept out
  replanned_at = r.history[0]["step"]
  for step in range(400, 420):
    new, record = r.decide(
      step, cluster, measure(_Program(cluster), None, None, {"g0": (4, 8, 12), "g1": (4, 8)})
    )
    assert new is None and record["new"] == {"g0": 12, "g1": 4} and record["undone_replan"] == replanned_at
  # both groups 20 % slower: the same balanced split, but the speeds moved: it may be chosen again
  speed.update(g0=1.2, g1=3.6)
  new, record = r.decide(
    500, cluster, measure(_Program(cluster), None, None, {"g0": (4, 8, 12), "g1": (4, 8)})
  )
  assert new == {"g0": 12, "g1": 4} and record["replanned"] and "undone_replan" not in record


def test_restore_keeps_undone_splits_blocked_and_times_a_replan_not_yet_measured():
  measure = _measured({"g0": 1.0, "g1": 3.0})
  r = Replanner(mode="once", warmup_steps=2, window=2, measure=measure)
  for step, ms in enumerate((9.0, 9.0, 24.0, 24.0), 1):
    r.wants_measurement(step, 0, ms)
  new, _ = r.replan(4, _Program(_cluster()), None, None)
  checkpointed = json.loads(json.dumps(r.history))  # as a checkpoint holds it: a re-plan not yet timed
  resumed = Replanner(mode="once", warmup_steps=2, window=2, measure=measure)
  resumed.restore(checkpointed)
  assert resumed.times_steps()
  # resumed at step 6: 7-8 are its warm-up, 9-10 the window of the re-planned split, slower: undone
  assert not any(resumed.wants_measurement(s, 6, 30.0) for s in range(7, 11))
  assert [(h.get("undone"), h["new"]) for h in resumed.history] == [(None, new), (4, {"g0": 8, "g1": 8})]
  assert resumed.take_notes()[0]["restored"] == {"g0": 8, "g1": 8} and not resumed.times_steps()
  again = Replanner(mode="auto", measure=measure)
  again.restore(json.loads(json.dumps(resumed.history)))
  batches, record = again.decide(
    20, _cluster(), measure(_Program(_cluster()), None, None, {"g0": (4, 8, 12), "g1": (4, 8)})
  )
  assert batches is None and record["undone_replan"] == 4


def test_lifted_policy_raises_only_8_bit_legs_to_the_policys_16_bit_precision():
  def policy(obj):
    return Plan.from_json({"policies": {"g": obj}}).policies["g"]

  int8_fwd = policy("int8_fwd")
  assert lifted_policy(int8_fwd) == PrecisionPolicy.uniform("fp16")  # its backward's precision
  mixed = policy({"rules": [{"path": "Dense_0", "policy": "int8_fwd"}], "__default__": "bf16"})
  lifted = lifted_policy(mixed)  # the other ops' bf16: the 8-bit leg only, its fp16 legs stay
  assert lifted.rules[0].policy.precisions == ("bf16", "fp16", "fp16") and lifted.default == mixed.default
  assert lifted.rules[0].path == "Dense_0"
  fp8 = policy({"rules": [{"path": "Dense_1", "kind": "dense", "policy": "fp8"}], "__default__": "fp16"})
  assert (
    lifted_policy(fp8).rules[0].policy == OpPolicy.uniform("fp16")
    and lifted_policy(fp8).rules[0].kind == "dense"
  )
  for obj in ("int8", "bf16", "fp32"):  # no 16-bit leg to lift to, or nothing 8-bit: not lifted
    assert lifted_policy(policy(obj)) is None
  both = policy(
    {"rules": [{"path": "a", "policy": "int8_fwd"}, {"path": "b", "policy": "fp16"}], "__default__": "bf16"}
  )
  assert lifted_policy(both) is None  # fp16 and bf16 among the other ops: no single precision
  for before in (int8_fwd, mixed, fp8):  # accuracy can only improve: no leg loses bits
    after = lifted_policy(before)
    for old, new in zip(
      [r.policy for r in before.rules] + [before.default], [r.policy for r in after.rules] + [after.default]
    ):
      if old is not None:
        assert all(PRECISION_BITS[b] >= PRECISION_BITS[a] for a, b in zip(old.precisions, new.precisions))
        assert not any(p in ("int8", "fp8") for p in new.precisions)


def test_a_group_whose_lifted_probe_is_faster_gets_the_lifted_policy():
  cluster = _cluster()
  got = {}
  for lifted_ms in (1.5, 2.9):  # g1 at fp16: twice as fast, or only 3 % faster (< threshold)
    calls = []
    r = Replanner(
      mode="once", measure=_measured({"g0": 1.0, "g1": 3.0}, calls=calls, lifted={"g1": lifted_ms})
    )
    got[lifted_ms] = r.replan(3, _Program(cluster, INT8_G1), None, None)
    assert calls[1] == {"g1": (4, 8)}  # the lifted policy, at the sizes its running one was measured at
  new, record = got[1.5]
  assert new == {"g0": 10, "g1": 6} and record["replanned"]
  assert record["lifted"]["g1"]["new"] == PrecisionPolicy.uniform("fp16").to_json()
  assert record["lifted"]["g1"]["old"] == INT8_G1.policies["g1"].to_json()
  assert set(record["lifted"]["g1"]["measured_ms"]) >= {"4", "8", "6"}  # the new batch measured lifted
  new, record = got[2.9]  # not lifted: the split balanced on g1's running policy
  assert new == {"g0": 12, "g1": 4} and "lifted" not in record


def test_the_undo_rule_is_not_faster_with_no_margin():
  # measured_ms_old 24.5: a new step of 24.5 ms (not faster) is undone, 24.499 ms (1 µs faster) kept
  for new_ms, undone in ((24.5, True), (24.499, False), (30.0, True)):
    r = Replanner(mode="once", warmup_steps=0, window=2, measure=_measured({"g0": 1.0, "g1": 3.0}))
    assert not r.wants_measurement(1, 0, 24.0) and r.wants_measurement(2, 0, 25.0)
    new, record = r.replan(2, _Program(_cluster()), None, None)
    assert new == {"g0": 12, "g1": 4} and record["measured_ms_old"] == 24.5
    for step in (3, 4):
      r.wants_measurement(step, 0, new_ms)
    (note,) = r.take_notes()
    assert note["undone"] == undone and len(r.history) == (2 if undone else 1)


def test_decide_is_a_pure_function_of_measurements_running_split_and_undone_replans():
  running = Running({"g0": 2, "g1": 2}, {"g0": 8, "g1": 8})
  measured = {"g0": {4: 4.0, 8: 8.0}, "g1": {4: 12.0, 8: 24.0}}
  d = decide(measured, running)
  assert d.batches == {"g0": 12, "g1": 4} and d.blocked_by is None and d.undone == ()
  assert (d.record["predicted_ms_old"], d.record["predicted_ms_new"]) == (24.0, 12.0)
  assert decide(measured, running) == d  # same inputs, same decision: nothing kept between calls
  block = Undone(5, {"g0": 12, "g1": 4}, {}, {g: GroupSpeed.fit(m) for g, m in measured.items()})
  blocked = decide(measured, running, (block,))
  assert blocked.batches is None and blocked.blocked_by == 5 and blocked.undone == (block,)
  slower = {g: {b: 1.2 * ms for b, ms in m.items()} for g, m in measured.items()}  # speeds moved
  freed = decide(slower, running, (block,))
  assert freed.batches == {"g0": 12, "g1": 4} and freed.blocked_by is None and freed.undone == ()
  assert decide(measured, running, threshold=0.6).batches is None  # 24 -> 12 ms is 50 % shorter, not 60 %


def _counting(calls):
  """A fake measurement that records its calls: every group 1 ms per example."""

  def measure(program, state, host_batch, sizes, policies):
    calls.append(dict(sizes))
    return {g: {b: float(b) for b in batches} for g, batches in sizes.items() if batches}

  return measure


def test_one_group_is_never_measured_whatever_the_mode(tmp_path, capsys):
  calls = []
  r = Replanner(mode="auto", warmup_steps=1, window=1, recheck_windows=1, measure=_counting(calls))
  one = ClusterSpec((DeviceGroup("g0", "cpu", 2, 16, 8),))
  trainer = Trainer(make_task(), one, Plan(), optax.adam(1e-2), devices=jax.devices()[:2], replan=r)
  trainer.run(6)
  assert calls == [] and r.history == []
  assert "replan=auto: one device group, nothing to balance: nothing is measured" in capsys.readouterr().err


def test_a_resumed_run_keeps_a_decision_that_kept_the_plan(tmp_path):
  calls = []
  pair = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 4), DeviceGroup("g1", "cpu", 1, 16, 4)))

  def trainer(replanner, resume=False):
    return Trainer(
      make_task(),
      pair,
      Plan(),
      optax.sgd(0.1),
      out_dir=str(tmp_path / "run"),
      devices=jax.devices()[:2],
      replan=replanner,
      resume=resume,
      progress=None,
    )

  first = trainer(Replanner(mode="once", warmup_steps=1, window=1, measure=_counting(calls)))
  first.run(4)  # equal speeds: the decision at step 3 keeps 4/4
  first.close()
  assert len(calls) == 1 and first.replanner.history == [] and first.replanner.decided_step == 3
  calls.clear()
  r = Replanner(mode="once", warmup_steps=1, window=1, measure=_counting(calls))
  resumed = trainer(r, resume=True)
  assert resumed.step == 4 and r.decided_step == 3 and not r.times_steps()
  resumed.run(8)
  resumed.close()
  assert calls == []  # measured nothing again


def test_one_default_where_rebalancing_can_change_something():
  from types import SimpleNamespace

  from qsync_jax.train.replan import default_replan

  def program(platform="gpu", groups=2, micro_steps=None):
    return SimpleNamespace(
      mesh=SimpleNamespace(devices=np.asarray([SimpleNamespace(platform=platform)])),
      cluster=SimpleNamespace(groups=[None] * groups),
      plan=Plan.from_json({"micro_steps": micro_steps or {}}),
    )

  assert default_replan(program()) == "once"
  assert default_replan(program(), "global_qsgd") == "once"  # a gradient hook: the hybrid step
  assert default_replan(program(groups=1)) == "off"
  assert default_replan(program(platform="cpu")) == "off"
  assert default_replan(program(), "selsync") == "off"
  assert default_replan(program(micro_steps={"g0": 2})) == "off"
  trainer = Trainer(make_task(), _cluster(), devices=jax.devices()[:4])  # the CLI passes None too
  assert trainer.replanner.mode == "off"  # simulated CPU devices
