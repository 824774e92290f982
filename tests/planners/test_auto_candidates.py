"""Which candidate steps auto_policy compiles and times (planners.allocator.auto_candidates), and
how many programs a search compiles on this CPU."""

import pytest

from planners.allocator import auto_policy, auto_steps
from planners.allocator.auto_candidates import CLOSE, candidate_sets, predicted_ms, set_name, timed_sets
from planners.allocator.payoff import OpPayoff, paying_ops
from planners.profiler import timing
from tests.planners import tiny

PAYOFFS = (
  OpPayoff("a:dense", 4.0, {"int8": 3.0, "fp8": 2.0}),  # saves 1 at int8, 2 at fp8
  OpPayoff("b:dense", 2.0, {"int8": 1.5, "fp8": 1.9}),  # saves 0.5 at int8, 0.1 (5 %) at fp8
  OpPayoff("head:dense", 1.0, {"int8": 1.2, "fp8": 1.1}),  # pays at neither
)


def test_the_sets_are_each_considered_once_under_their_first_name_and_predicted_from_per_op_savings():
  paying = lambda min_gain, preset: paying_ops(PAYOFFS, min_gain, preset=preset)  # noqa: E731
  sets = candidate_sets(paying, ("int8", "fp8"), {"a:dense": "int8"})
  # "strong" (ops saving >= 10 %: a 50 %, b 25 %) equals "paying" here, so it is not considered twice
  assert sets == {
    "base": {},
    "paying_int8": {"a:dense": "int8", "b:dense": "int8"},
    "paying_fp8": {"a:dense": "fp8", "b:dense": "fp8"},
    "paying": {"a:dense": "fp8", "b:dense": "int8"},
    "frontier": {"a:dense": "int8"},
  }
  assert list(sets) == ["base", "paying_int8", "paying_fp8", "paying", "frontier"]
  assert set_name(sets, {"a:dense": "fp8", "b:dense": "int8"}) == "paying" and set_name(sets, {}) is None
  # a frontier equal to an earlier set is kept under that set's name
  assert "frontier" not in candidate_sets(paying, ("int8", "fp8"), sets["paying_int8"])
  assert predicted_ms(10.0, PAYOFFS, {}) == 10.0
  assert predicted_ms(10.0, PAYOFFS, sets["paying"]) == pytest.approx(10.0 - 2.0 - 0.5)
  # an op at a preset slower than its base adds the difference
  assert predicted_ms(10.0, PAYOFFS, {"head:dense": "int8"}) == pytest.approx(10.2)


def test_only_the_base_the_predicted_fastest_the_frontier_and_one_close_set_are_timed():
  predicted = {"base": 10.0, "paying_int8": 8.5, "paying_fp8": 8.05, "paying": 8.0, "strong": 8.3}
  # speed alone: the fastest predicted, and paying_fp8, within CLOSE (0.1 ms) of it; the rest pruned
  timed, pruned = timed_sets(predicted, None)
  assert timed == ["base", "paying", "paying_fp8"] and set(pruned) == {"paying_int8", "strong"}
  assert "0.500 ms (5.0 % of the base step) slower than paying's 8.000 ms" in pruned["paying_int8"]
  assert f"more than the {100 * CLOSE:g} %" in pruned["paying_int8"]
  # no set close enough: base and the fastest alone
  far = {**predicted, "paying_fp8": 8.2}
  assert timed_sets(far, None)[0] == ["base", "paying"]
  # with a budget: the frontier's set is timed too; an eligible set predicted faster than it is the one more
  with_frontier = {**far, "frontier": 8.6}
  timed, pruned = timed_sets(with_frontier, ["base", "paying_int8", "frontier"], "frontier")
  assert timed == ["base", "paying", "frontier", "paying_int8"] and "paying_int8" not in pruned
  # the frontier's set under an earlier name is timed under it
  timed, _ = timed_sets(far, ["base", "paying_int8"], "paying_int8")
  assert timed == ["base", "paying", "paying_int8"]
  assert timed_sets({"base": 10.0}, None) == (["base"], {})
  # at most one more: of two close sets, the closer; the other is pruned saying so
  two = {"base": 10.0, "a": 8.0, "b": 8.05, "c": 8.02}
  timed, pruned = timed_sets(two, None)
  assert timed == ["base", "a", "c"] and pruned["b"].endswith("and not the closest")


@pytest.mark.standard_promotion  # optax's update promotes bf16 with float32
def test_a_search_compiles_the_traces_programs_and_the_timed_sets_only(monkeypatch):
  """The case of a GPT at width 2048 on an H200 (per-op times given, the rest measured): every
  hidden Dense pays at int8 and more at fp8, the head at neither. The search compiles the all-base,
  all-int8 and all-fp8 programs it traces, one program for the indicator, and the one candidate
  that is not a trace's program: every op that pays at its fastest preset (the frontier's set at
  budget 1). paying_int8 is predicted 8 % slower and is neither compiled nor timed."""
  times = {
    "Dense_0:dense": (1.0, 0.8, 0.5),
    "Dense_1:dense": (1.0, 0.85, 0.6),
    "Dense_2:dense": (0.2, 0.3, 0.25),
  }
  column = {"bf16": 0, "int8": 1, "fp8": 2}
  real_legs, built, probe_compiles = auto_steps.Programs.op_legs, [], []

  def legs(self, chosen, repeats):
    assert set(real_legs(self, chosen, repeats)) >= set(times)  # traced as the search does
    return {op: {"fwd": t[column[chosen.get(op, "bf16")]], "bwd": 0.0} for op, t in times.items()}

  def build(*args, **kwargs):
    built.append(args[1])
    return build_train_step(*args, **kwargs)

  from planners.indicator import probes

  def batch_stats(*args, **kwargs):
    jitted = probe_batch_stats(*args, **kwargs)

    def run(*a):
      before = jitted._cache_size()
      out = jitted(*a)
      probe_compiles.extend([1] * (jitted._cache_size() - before))
      return out

    return run

  build_train_step, probe_batch_stats = timing.build_train_step, probes.batch_stats
  monkeypatch.setattr(auto_steps.Programs, "op_legs", legs)
  monkeypatch.setattr(timing, "build_train_step", build)
  monkeypatch.setattr(probes, "batch_stats", batch_stats)
  small = dict(trace_repeats=1, step_repeats=2, rounds=1, indicator_steps=1, indicator_batches=2)
  result = auto_policy(tiny.mlp(), 8, budget=1.0, **small)
  assert len(probe_compiles) == 1  # one indicator program scores every precision on both batches
  assert len(built) == result.compiled_steps == 4
  assert list(result.step_ms) == ["base", "paying_fp8"] and set(result.pruned) == {"paying_int8"}
  assert result.candidates["paying_fp8"] == {"Dense_0:dense": "fp8", "Dense_1:dense": "fp8"}
  assert result.frontier.chosen == result.candidates["paying_fp8"]
  assert result.predicted_ms == pytest.approx({"base": 2.2, "paying_int8": 1.85, "paying_fp8": 1.3})
