"""QSync's allocator — the greedy precision search (``make_problem``, ``greedy``, checked against
``exhaustive``) — and the joint batch × precision search (``joint_plan``)."""

from planners.allocator.greedy import INT8_OPS, exhaustive, greedy, make_problem, omega_table
from planners.allocator.joint import joint_plan, plan_of, precision_counts

__all__ = [
  "INT8_OPS",
  "exhaustive", "greedy", "joint_plan", "make_problem", "omega_table", "plan_of", "precision_counts"]
