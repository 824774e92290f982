"""The pool's bound and the best baseline: what a plan's predicted throughput is reported against.

**Bound.** Every device of the pool computes at its fastest implemented precision — an
inference group every op at its fastest ladder level (``greedy.fastest_levels``, memory not
checked), a training group the training precision with 8 bits on the ops its profile prices
faster there (its 8-bit auto policy, ``planners.allocator.baselines.auto_training_problem``) — with the
global batch ``B`` split in proportion to speed (fractional batches allowed), no memory limit
and no communication. A device's step without communication is affine in its batch,
``t_g(b) = a_g + s_g·b``: the ops and the remainder scale with the batch (``s_g``); ``a_g`` is
what does not: the optimizer update, at its least per-device share (sharded over every device
of the pool: ``1/N`` of the update each, the least any mode of ``joint_plan`` prices) and the
casts' fixed cost per call. The bound
step ``T*`` is the least ``T`` with

    Σ_g count_g · max(0, (T − a_g) / s_g) = B

(a group whose ``a_g ≥ T*`` gets no batch: it cannot finish its update within the step). A
plan's predicted step is at least each running group's compute chain at its batch, so no
candidate of ``joint_plan`` is predicted faster than ``B / T*`` as long as each op's fastest
level is the same at every batch (op costs scale with the batch; a cast's fixed cost per
call does not, so at batches far from the spec's another level can be marginally faster).

**Best baseline.** The fastest (fitting) of ``BASELINES``: plain data parallelism (the spec's
equal batches at the training precision), dynamic batching (the fastest split) and the training
groups alone, each at the training precision, accumulating where a batch does
not fit at once, and at each group's 8-bit auto policy, in every mode and at every priced sync
(``planners.allocator.baselines``): what the pool does without precision planning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planners.allocator.greedy import fastest_levels
from planners.predictor.graph import Comm, build_graph
from qsync_jax.errors import PlanError

BASELINES = (
  "equal batches, training precision",
  "dynamic batching",
  "training groups only",
  "dynamic batching, accumulating",
  "training groups only, accumulating",
  "dynamic batching, 8-bit auto",
  "training groups only, 8-bit auto",
)
"""The candidates of ``joint_plan`` a plan's gain is measured against (the fastest of them, in
every mode and sync searched): what the pool does without precision planning."""


@dataclasses.dataclass(frozen=True)
class Bound:
  """The pool's bound (module docstring): step ``step_ms`` = ``T*``, per-device (fractional)
  batch ``batches`` of every group, and each group's affine step ``(a_g ms, s_g ms/example)``."""

  step_ms: float
  batches: tuple[float, ...]
  affine: tuple[tuple[float, float], ...]
  global_batch: int

  @property
  def samples_per_s(self) -> float:
    return self.global_batch / self.step_ms * 1e3


def bound_step_ms(affine: Sequence[tuple[float, float]], counts: Sequence[int], global_batch: int) -> float:
  """The least ``T`` with ``Σ_g counts[g]·max(0, (T − a_g)/s_g) = global_batch``, ``affine[g] =
  (a_g, s_g)``: the left side is piecewise linear and increasing in ``T``, so groups join in
  order of ``a_g`` and ``T`` solves the linear equation of the groups with ``a_g < T``."""
  if global_batch <= 0:
    raise ValueError(f"global_batch={global_batch} must be positive. Fix: pass the cluster's global batch.")
  if len(affine) != len(counts) or not affine:
    raise ValueError(
      f"affine ({len(affine)} groups) and counts ({len(counts)}) must be non-empty and of one length. Fix: "
      "pass one (a_g, s_g) and one device count per group."
    )
  for g, (_, s) in enumerate(affine):
    if s <= 0:
      raise ValueError(
        f"group {g}: slope s_g={s} ms/example must be positive (the step grows with the batch). Fix: give "
        "the group a profile with op timings."
      )
  order = sorted(range(len(affine)), key=lambda g: affine[g][0])
  # Over the groups joined so far, Σ count·(T − a)/s = rate·T − offset.
  rate = offset = 0.0
  for k, g in enumerate(order):
    a, s = affine[g]
    rate += counts[g] / s
    offset += counts[g] * a / s
    t = (global_batch + offset) / rate
    if k + 1 == len(order) or t <= affine[order[k + 1]][0]:
      return t
  raise AssertionError("unreachable: the last group always returns")


def compute_ms(search, gi: int, batch: int, row) -> float:
  """Group ``gi``'s step without communication at per-device ``batch`` under ``row`` (its
  ladder levels; None: the training precision): the sum of its compute-stream nodes
  (``planners.predictor.graph``), costed as ``search`` costs them, the optimizer update's
  divided by the pool's devices (module docstring)."""
  group = search.group_at(gi, batch, row)
  comm = Comm(1, 1.0, search.p.bucket_bytes, 0.0)
  nodes = [n for n in build_graph([group], comm, search.ev.cost) if n.stream == "compute"]
  update = sum(n.ms for n in nodes if n.kind == "optimizer")
  return sum(n.ms for n in nodes) - update + update / search.p.cluster.num_devices


def fastest_rows(problem) -> list:
  """Each group's fastest configuration: None (training precision) on a training group, every op
  at its fastest ladder level (``fastest_levels``, memory not checked) on an inference group."""
  rows = [None] * len(problem.groups)
  for gi, row in zip(problem.inference, fastest_levels(problem, fit_memory=False)):
    rows[gi] = row
  return rows


def pool_bound(search) -> Bound:
  """The pool's bound of ``search``'s problem (module docstring); ``t_g`` is fitted from the
  compute-only step at batches 1 and ``B`` (exact: it is affine)."""
  from planners.allocator.baselines import auto_training_problem
  from planners.allocator.search import Search

  problem = search.p
  auto = auto_training_problem(problem)  # the training groups at their fastest: 8 bits where it pays
  search = search if auto is problem else Search(auto, search.q)
  B = problem.cluster.global_batch
  hi = max(B, 2)
  affine = []
  for gi, row in enumerate(fastest_rows(problem)):
    t1, th = compute_ms(search, gi, 1, row), compute_ms(search, gi, hi, row)
    slope = (th - t1) / (hi - 1)
    if not slope > 0:
      g = problem.cluster.groups[gi]
      raise PlanError(
        f"group {g.name!r} ({g.device_type}): its profile prices {th:.4g} ms at {hi} examples per device and "
        f"{t1:.4g} ms at 1, a step that does not grow with the batch (a negative fitted remainder outweighs "
        "its ops). Fix: re-run `qsync profile` at a larger --batch or with more --repeats."
      )
    affine.append((t1 - slope, slope))
  counts = [g.count for g in problem.cluster.groups]
  step = bound_step_ms(affine, counts, B)
  batches = tuple(max(0.0, (step - a) / s) for a, s in affine)
  return Bound(step, batches, tuple(affine), B)


def best_baseline(candidates):
  """The fastest fitting candidate named in ``BASELINES``, or None where none fits."""
  baselines = [c for c in candidates if c.name in BASELINES and c.fits]
  return max(baselines, key=lambda c: c.samples_per_s, default=None)
