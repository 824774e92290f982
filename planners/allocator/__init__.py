"""QSync's allocator — the greedy precision search (``make_problem``, ``greedy``, checked against
``exhaustive``) — the joint batch × precision search (``joint_plan``), and, for one device type,
8-bit only where it is measured to pay (``auto_policy``)."""

from planners.allocator.exhaustive import exhaustive
from planners.allocator.greedy import INT8_OPS, greedy, make_problem, omega_table
from planners.allocator.joint import joint_plan, plan_of
from planners.allocator.payoff import AutoPolicy, auto_policy
from planners.allocator.search import precision_counts

__all__ = [
  "INT8_OPS",
  "AutoPolicy",
  "auto_policy",
  "exhaustive",
  "greedy",
  "joint_plan",
  "make_problem",
  "omega_table",
  "plan_of",
  "precision_counts",
]
