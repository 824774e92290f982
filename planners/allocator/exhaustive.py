"""The allocator's exhaustive search: the least-Ω assignment over every ladder combination
(small graphs only), the oracle ``greedy`` is tested against."""

from __future__ import annotations

import itertools
import math

from planners.allocator.greedy import Allocation, Evaluator, Problem, finish, start_assignment
from qsync_jax.errors import PlanError


def exhaustive(problem: Problem, max_combinations: int = 200_000, rel_tol: float = 1e-9) -> Allocation:
  """The least-Ω assignment over every ladder combination that fits and keeps pace with T*."""
  ev = Evaluator(problem)
  start = start_assignment(problem, ev)
  target = ev.training_step_ms()
  start_step = ev.step_ms(start)
  straggles = start_step > target * (1 + rel_tol)
  if straggles or not problem.inference:
    target = max(target, start_step)
  limit = target * (1 + rel_tol)
  choices = [range(len(lad)) for ladders in problem.ladders for lad in ladders]
  if math.prod(len(c) for c in choices) > max_combinations:
    raise PlanError(
      f"exhaustive search over {math.prod(len(c) for c in choices)} plans exceeds "
      f"max_combinations={max_combinations}. Fix: use the greedy allocator for graphs this size."
    )
  n = len(problem.op_names)
  best, best_omega = start, ev.omega(start)
  for flat in itertools.product(*choices):
    cand = tuple(tuple(flat[j * n : (j + 1) * n]) for j in range(len(problem.inference)))
    w = ev.omega(cand)
    if w >= best_omega or not ev.fits(cand) or ev.step_ms(cand) > limit:
      continue
    best, best_omega = cand, w
  return finish(problem, ev, best, target, straggles)
