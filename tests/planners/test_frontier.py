"""The speed/accuracy frontier of ``auto_policy`` (planners.allocator.frontier): the order in which
ops go 8-bit, int8 before fp8 where fp8's extra speed costs more Ω than it is worth, what a budget
keeps and why it leaves the rest out, and the refusal of a bad budget."""

import math
import re

import pytest

from planners.allocator.frontier import (
  DEFAULT_BUDGET,
  SPEED,
  choose,
  frontier,
  omega_cost,
  op_hull,
  parse_budget,
)
from planners.allocator.payoff import OpPayoff
from qsync_jax.errors import PlanError

PAYOFFS = (
  # saves 4 ms at int8 (Ω 1) and 5 at fp8 (Ω 9): int8 at 0.25 Ω/ms, then fp8's extra ms at 8 Ω/ms
  OpPayoff("a:dense", 10.0, {"int8": 6.0, "fp8": 5.0}),
  # saves 2 ms at int8 (Ω 2) and 3 at fp8 (Ω 1.5): fp8 is faster and cheaper, int8 is never a move
  OpPayoff("b:dense", 10.0, {"int8": 8.0, "fp8": 7.0}),
  # saves 1 ms at int8 only (Ω 4: 4 Ω/ms); fp8 is slower than the base
  OpPayoff("c:dense", 10.0, {"int8": 9.0, "fp8": 11.0}),
  # pays at no preset
  OpPayoff("d:dense", 1.0, {"int8": 1.5, "fp8": 1.2}),
)
OMEGA = {
  "a:dense": {"bf16": 0.0, "int8": 1.0, "fp8": 9.0},
  "b:dense": {"bf16": 0.5, "int8": 2.5, "fp8": 2.0},  # Ω above bf16: int8 2, fp8 1.5
  "c:dense": {"bf16": 0.0, "int8": 4.0, "fp8": 0.1},
  "d:dense": {"bf16": 0.0, "int8": 0.1, "fp8": 0.1},
}
COST = omega_cost(OMEGA, "bf16")


def test_the_frontier_grows_in_order_of_least_omega_per_ms_saved_int8_before_fp8_where_fp8_costs_more():
  steps = [(s.op, s.preset, s.omega, s.ms) for s in frontier(PAYOFFS, COST)]
  assert steps == [
    ("a:dense", "int8", 1.0, 4.0),  # 0.25 Ω per ms
    ("b:dense", "fp8", 1.5, 3.0),  # 0.5: straight to fp8 (int8 is slower and costlier)
    ("c:dense", "int8", 4.0, 1.0),  # 4
    ("a:dense", "fp8", 8.0, 1.0),  # 8: fp8's one extra ms for 8 more Ω
  ]
  # its end is every paying op at its fastest preset: the speed-only choice
  end = choose(PAYOFFS, COST, 1.0)
  assert end.chosen == {"a:dense": "fp8", "b:dense": "fp8", "c:dense": "int8"}
  assert (
    end.spent == end.reference == pytest.approx(9.0 + 1.5 + 4.0) and end.saved_ms == end.reference_ms == 9.0
  )


def test_a_budget_keeps_the_cheapest_ms_first_and_says_why_the_rest_is_left_out():
  # 14.5 Ω in all: 0.2 allows 2.9 (a at int8 and b at fp8: 2.5)
  c = choose(PAYOFFS, COST, 0.2)
  assert c.chosen == {"a:dense": "int8", "b:dense": "fp8"}
  assert c.spent == pytest.approx(2.5) and c.allowed == pytest.approx(2.9) and c.saved_ms == 7.0
  assert c.left_out["a:dense"].startswith("at int8, not fp8: fp8 would add Ω 8 for 1.000 ms")
  assert (
    c.left_out["c:dense"].startswith("int8 would add Ω 4 for 1.000 ms")
    and "over the budget" in c.left_out["c:dense"]
  )
  assert c.left_out["d:dense"] == "no 8-bit preset is faster in the step"
  assert "b:dense" not in c.left_out
  # a step that does not fit ends its op's moves, but a cheaper op after it may still fit: at 0.45
  # (6.525) c (4 more: 6.5) fits after a at int8 and b at fp8, a's fp8 (8 more) does not
  assert choose(PAYOFFS, COST, 0.45).chosen == {"a:dense": "int8", "b:dense": "fp8", "c:dense": "int8"}
  assert choose(PAYOFFS, COST, 0.1).chosen == {"a:dense": "int8"}  # 1.45 allowed
  assert choose(PAYOFFS, COST, 0.05).chosen == {}  # 0.725 allowed: not even a's Ω 1
  # the budgets are nested: a larger one keeps a superset, each op at a preset no slower
  by_op = {p.op: p for p in PAYOFFS}
  previous: dict = {}
  for budget in (0.0, 0.05, 0.1, 0.2, 0.45, 0.99, 1.0):
    chosen = choose(PAYOFFS, COST, budget).chosen
    assert set(previous) <= set(chosen)
    assert all(by_op[op].preset_ms[chosen[op]] <= by_op[op].preset_ms[p] for op, p in previous.items())
    previous = chosen


def test_a_zero_budget_keeps_nothing_even_where_omega_is_zero():
  free = {op: {p: 0.0 for p in row} for op, row in OMEGA.items()}
  assert choose(PAYOFFS, omega_cost(free, "bf16"), 0.0).chosen == {}
  assert choose(PAYOFFS, omega_cost(free, "bf16"), 0.01).chosen == choose(PAYOFFS, COST, 1.0).chosen


def test_the_op_hull_drops_options_that_save_less_for_no_less_omega_or_lie_above_the_hull():
  assert op_hull([("int8", 2.0, 2.0), ("fp8", 3.0, 1.5)]) == [("fp8", 3.0, 1.5)]
  assert op_hull([("int8", 4.0, 1.0), ("fp8", 5.0, 9.0)]) == [("int8", 4.0, 1.0), ("fp8", 5.0, 9.0)]
  # the middle option costs more per ms than going straight to the last: above the hull
  assert op_hull([("x", 1.0, 5.0), ("y", 2.0, 6.0)]) == [("y", 2.0, 6.0)]
  assert op_hull([]) == []


def test_a_table_without_an_ops_omega_is_refused_by_name():
  cost = omega_cost({"a:dense": {"int8": 1.0}}, "bf16")
  with pytest.raises(PlanError, match=r"no Ω for op 'a:dense' at 'fp8'.*--precisions fp8"):
    cost("a:dense", "fp8")


@pytest.mark.parametrize(
  "value, expected",
  [(0, 0.0), (1, 1.0), (0.25, 0.25), ("0.3", 0.3), (" 1e-1 ", 0.1), ("speed", SPEED), (" Speed ", SPEED)],
)
def test_a_budget_is_a_fraction_in_0_1_or_speed(value, expected):
  assert parse_budget(value) == expected
  assert 0.0 < DEFAULT_BUDGET < 1.0


@pytest.mark.parametrize(
  "value, why",
  [
    (-0.1, "is outside"),
    (1.5, "is outside"),
    ("-1", "is outside"),
    (math.nan, "is not a finite"),
    ("nan", "is not a finite"),
    (math.inf, "is not a finite"),
    ("fast", "is neither a number nor 'speed'"),
    (True, "is a bool"),
    (None, "is a NoneType"),
  ],
)
def test_a_bad_budget_is_refused_naming_it_with_the_fix(value, why):
  with pytest.raises(
    PlanError, match=rf"--accuracy-budget {re.escape(repr(value))} {why}.*Fix: give a fraction"
  ):
    parse_budget(value, "--accuracy-budget")
