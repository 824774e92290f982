"""``planners.profiler.timing``'s step timing: the pipelined clock and the round-robin timing of policies."""

import itertools
import time

import jax
import jax.numpy as jnp
import pytest

from planners.profiler import timing
from qsync_jax.policy import PrecisionPolicy
from tests.planners import tiny


def recorded(sleeps):
  """``(fn, calls, waited)``: ``fn()`` records its call, sleeps the next of ``sleeps`` seconds
  and returns a stand-in for a jax array that records, in ``waited``, how many calls there had
  been when the timer blocked on it."""
  calls, waited = [], []

  class Result:
    def block_until_ready(self):
      waited.append(len(calls))
      return self

  def fn():
    calls.append(time.perf_counter())
    time.sleep(next(sleeps))
    return Result()

  return fn, calls, waited


def test_pipelined_clock_dispatches_every_call_and_waits_once():
  """``repeats`` calls after the warm-up, back to back: no call waits for the one before, so a
  host cost per call (here a 20 ms sleep) is counted once per call, and the one sample is the
  mean per call."""
  fn, calls, waited = recorded(itertools.repeat(0.02))

  ms, samples = timing.timed_ms(fn, repeats=5, warmup=2, clock=timing.PIPELINED_CLOCK)
  assert len(calls) == 7 and samples == [ms]
  assert waited == [1, 2, 7]  # each warm-up call, then only the last timed one
  assert 20 <= ms < 40  # the mean per call of five 20 ms calls (generous above: a busy CI host)


@pytest.mark.standard_promotion  # optax's Adam in the training step
def test_interleaved_steps_are_timed_on_every_clock_over_every_round():
  task = tiny.mlp()
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(16, 0)))
  policies = {"fp32": PrecisionPolicy.uniform("fp32"), "bf16": PrecisionPolicy.uniform("bf16")}
  seen = []
  out = timing.time_train_steps_interleaved(
    task, policies, batch, 3, 3, clocks=("wall", timing.PIPELINED_CLOCK), progress=seen.append
  )
  assert set(out) == {"wall", timing.PIPELINED_CLOCK}
  for by_name in out.values():
    assert set(by_name) == set(policies)
    for ms, medians, peak in by_name.values():
      assert len(medians) == 3 and ms == sorted(medians)[1] and ms > 0
      assert peak is None or peak > 0
  assert sum(m.startswith("round 3/3") for m in seen) == 2  # one progress line per clock


def test_round_robin_numbers_its_rounds_within_a_longer_run():
  order, seen = [], []
  runs = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
  out = timing.time_round_robin(runs, 2, 2, progress=seen.append, first_round=3, total_rounds=4)
  assert list(out) == ["wall"] and {n: len(m) for n, m in out["wall"].items()} == {"a": 2, "b": 2}
  assert order == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4  # 2 warm-up + 2 timed per round
  assert [line.split(",")[0] for line in seen] == ["round 3/4", "round 4/4"]


def test_pipelined_clock_takes_the_median_of_its_windows(monkeypatch):
  """25 repeats in windows of 10: two windows (the 5 left over are not run), each waited for
  once at its end; a stall in one window does not move the median of three."""
  monkeypatch.setattr(timing, "PIPELINE_WINDOW", 10)
  fn, calls, waited = recorded(itertools.repeat(0.0))

  ms, samples = timing.timed_ms(fn, repeats=25, warmup=1, clock=timing.PIPELINED_CLOCK)
  assert len(calls) == 21 and waited == [1, 11, 21] and len(samples) == 2
  assert ms == pytest.approx(sum(samples) / 2)

  stalling, _, _ = recorded(iter([0.0] * 10 + [0.03] + [0.0] * 19))

  ms, samples = timing.timed_ms(stalling, repeats=30, warmup=0, clock=timing.PIPELINED_CLOCK)
  assert len(samples) == 3 and max(samples) >= 3  # the second window: 30 ms over 10 calls
  assert ms < 1.5  # the median window has no stall (generous: a busy CI host)
