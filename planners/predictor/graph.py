"""The op graph of one synchronous training step, costed for a plan.

``build_graph(groups, comm)`` returns a DAG of ``Node`` s in topological order. Each
``GroupCost`` contributes a chain on its own ``compute`` stream: forward ops in order →
remainder (forward, backward) → for each op in reverse: [cast] → dlhs → drhs → … → optimizer.

* An op costs its standalone timings (``standalone_costs``): under a preset op policy the
  whole-policy program's forward and backward (the backward split between dlhs and drhs in
  proportion to their leg times), else its legs, each with its own operand conversions, and a
  cast node (the saved 8-bit operands dequantized) where an int8/fp8 forward has a gradient leg
  at another precision. The first op takes the model input: it has no dlhs leg.
* Where the profile traced the op inside the all-int8 step, its int8/fp8 legs cost their
  standalone time times the op's in-step factors (``in_step_factors``).
* Gradients are all-reduced in buckets of at most ``bucket_bytes`` (``buckets``): one ``comm``
  node per bucket, shared by all groups, starts when every group's backward has produced the
  bucket and after the previous bucket, overlapping the rest of the backward. Each group's
  optimizer update of a bucket runs after that bucket's all-reduce.

Times scale linearly with the group's batch over the profiled batch. ``longest_path`` gives
every node's start and end; the synchronous step is the latest end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from planners.catalog import allreduce_ms
from planners.profile import GroupCost, Profile
from qsync_jax.precision import PRESETS, QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.sync.allreduce import pack

DEFAULT_BUCKET_BYTES = 30 * 2**20
"""XLA:GPU's default all-reduce combine threshold (``xla_gpu_all_reduce_combine_threshold_bytes``)."""
DEFAULT_LATENCY_US = 10.0
"""Fixed cost of one all-reduce collective when no link microbenchmark measured it."""
PRESET_NAMES = {pol: name for name, pol in PRESETS.items()}
LEG_NAMES = ("dlhs", "drhs")


class Node(NamedTuple):
  """One timed step of the graph. ``deps`` are indices of earlier nodes."""

  name: str
  kind: str  # fwd | dlhs | drhs | cast | remainder | optimizer | comm
  group: str  # device group, or "allreduce" for comm nodes
  stream: str  # compute | comm
  ms: float
  deps: tuple[int, ...] = ()
  op: str | None = None
  precision: str | None = None


@dataclasses.dataclass(frozen=True)
class Comm:
  """The shared gradient all-reduce: ``n_devices`` in a ring over the slowest link, in buckets
  of ``bucket_bytes`` packed in ``bucket_order`` (``buckets``)."""

  n_devices: int
  link_gbps: float
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  latency_us: float = DEFAULT_LATENCY_US
  bucket_order: str = "tree"


def float_precision(profile: Profile) -> str:
  """Precision of an unmodified float op: XLA's default (tf32 on GPUs that have it)."""
  return "tf32" if "tf32" in profile.op_ms.get(profile.ops[0].name, {}).get("fwd", {}) else "fp32"


QUANTIZED_TRACE_PRESET = "int8"
"""The uniform preset whose step the profiler traces for ``Profile.quantized_in_step_ms``."""


def op_costs(group: GroupCost, op_index: int) -> dict[str, tuple[float, str]]:
  """``{node kind: (ms, precision)}`` of one op of one group inside the step: its standalone
  costs as the step runs them (``in_step``)."""
  prof = group.profile
  op = prof.ops[op_index]
  pol = group.op_policies.get(op.name) or OpPolicy.uniform(float_precision(prof))
  costs = standalone_costs(prof, op_index, pol, group.batch_per_device / prof.batch_per_device)
  return in_step(costs, in_step_factors(prof, op_index))


def standalone_costs(
  prof: Profile, op_index: int, pol: OpPolicy, scale: float = 1.0
) -> dict[str, tuple[float, str]]:
  """``{node kind: (ms, precision)}`` of one op under ``pol`` at ``scale`` times the profiled
  batch, from its standalone programs: ``fwd``, ``cast_bwd``, ``dlhs`` (not for the first op),
  ``drhs``; see the module docstring."""
  op = prof.ops[op_index].scaled(scale)
  p, calls = pol.fwd, op.calls * scale
  legs = {"dlhs": pol.dlhs, "drhs": pol.drhs} if op_index > 0 else {"drhs": pol.drhs}
  preset = PRESET_NAMES.get(pol)
  whole = prof.op_ms[op.name].get(f"policy:{preset}") if preset else None
  if whole is not None:  # the op timed under its whole policy: split bwd by the legs' shares
    shares = {name: prof.leg_ms(op.name, name, getattr(pol, name)) for name in LEG_NAMES}
    costs = {"fwd": (calls * whole["fwd"], p)}
    for name, q in legs.items():
      costs[name] = (calls * whole["bwd"] * shares[name] / sum(shares.values()), q)
    return costs
  costs = {"fwd": (calls * prof.leg_ms(op.name, "fwd", p), p)}
  if p in QUANTIZED_PRECISIONS and any(q != p for q in legs.values()):
    lhs = op.batch * op.m * op.k if op.kind == "conv" else op.lhs_elems  # a conv saved its patches
    dequantize = prof.cast[f"{p}->fp32"]
    costs["cast_bwd"] = (op.calls * (dequantize.ms(lhs) + dequantize.ms(op.rhs_elems)), p)
  for name, q in legs.items():
    costs[name] = (calls * prof.leg_ms(op.name, name, q), q)
  return costs


def in_step_factors(prof: Profile, op_index: int) -> tuple[float, float] | None:
  """``(forward, backward)``: the op's time inside the all-int8 step charged to it by a trace
  (``Profile.quantized_in_step_ms``) over its standalone all-int8 costs, forward and gradient
  legs apart; None where the profile has no trace of the op (or it ran in float: a grouped conv)
  or a leg came out without time."""
  traced = prof.quantized_in_step_ms.get(prof.ops[op_index].name)
  if (
    not traced or not prof.ops[op_index].runs_8bit or min(traced.get("fwd", 0.0), traced.get("bwd", 0.0)) <= 0
  ):
    return None
  costs = standalone_costs(prof, op_index, PRESETS[QUANTIZED_TRACE_PRESET])
  bwd = sum(ms for kind, (ms, _) in costs.items() if kind != "fwd")
  return traced["fwd"] / costs["fwd"][0], traced["bwd"] / bwd


def in_step(costs: dict[str, tuple[float, str]], factors: tuple[float, float] | None):
  """``costs`` as the step runs them: given the op's in-step ``factors`` (``in_step_factors``),
  its int8/fp8 forward leg times the forward factor and its int8/fp8 gradient legs times the
  backward factor; the rest unchanged."""
  if factors is None:
    return costs
  return {
    kind: (ms * factors[kind != "fwd"] if p in QUANTIZED_PRECISIONS and kind != "cast_bwd" else ms, p)
    for kind, (ms, p) in costs.items()
  }


def tree_position(op_name: str) -> tuple[str, ...]:
  """Sort key of an op's parameters in the parameter tree: its module path's components
  (``jax.tree`` flattens dicts by sorted keys: ``block0/mlp_in`` before ``block1/attn``)."""
  return tuple(op_name.split(":")[0].split("/"))


def buckets(profile: Profile, bucket_bytes: int, order: str = "tree") -> list[tuple[int, int]]:
  """``[(index of the op whose drhs completes the bucket, fp32 gradient bytes)]``, in the order
  the collectives run (the one completed first first).

  The weights are packed greedily (``qsync_jax.sync.allreduce.pack``) into buckets of at most
  ``bucket_bytes`` in ``order``: ``"tree"`` — parameter-tree order (``tree_position``), as XLA's
  combiner packs the trainer's ``psum``; ``"backward"`` — the order the backward produces them.
  A bucket is complete when its earliest op in the forward has its gradient. The parameters
  outside quantizable ops (biases, norms) join the bucket completed last.
  """
  if order not in ("tree", "backward"):
    raise ValueError(f"bucket order {order!r} must be 'tree' or 'backward'.")
  ops = profile.ops
  weighted = [i for i in range(len(ops)) if ops[i].param_elems > 0]
  if order == "tree":
    weighted.sort(key=lambda i: tree_position(ops[i].name))
  else:
    weighted.reverse()
  sizes = [4 * ops[i].param_elems for i in weighted]
  runs = [[weighted[j] for j in run] for run in pack(sizes, bucket_bytes)]
  out = sorted(((min(run), sum(4 * ops[i].param_elems for i in run)) for run in runs), reverse=True)
  rest = max(profile.memory["param_bytes"] - sum(4 * o.param_elems for o in ops), 0)
  if out and out[-1][0] == 0:
    out[-1] = (0, out[-1][1] + rest)
  elif rest > 0 or not out:
    out.append((0, rest))
  return out


def build_graph(groups: Sequence[GroupCost], comm: Comm, cost_fn=None) -> list[Node]:
  """The step graph of all ``groups`` with their shared all-reduce; see the module docstring.

  ``cost_fn(group, op_index)`` defaults to ``op_costs`` (a caller replaying many plans may
  pass a memoized one)."""
  cost_fn = cost_fn or op_costs
  nodes: list[Node] = []

  def add(node: Node) -> int:
    nodes.append(node)
    return len(nodes) - 1

  closing = []  # per group: {op index: node index of its drhs}
  last = []
  for g in groups:
    prof = g.profile
    scale = g.batch_per_device / prof.batch_per_device
    prev: tuple[int, ...] = ()
    drhs_nodes = {}
    costs = [cost_fn(g, i) for i in range(len(prof.ops))]
    for op, c in zip(prof.ops, costs):
      ms, p = c["fwd"]
      prev = (add(Node(f"{op.name} fwd", "fwd", g.name, "compute", ms, prev, op.name, p)),)
    for part in ("fwd", "bwd"):
      ms = scale * prof.remainder_ms[part]
      prev = (add(Node(f"remainder {part}", "remainder", g.name, "compute", ms, prev)),)
    for i in reversed(range(len(prof.ops))):
      op, c = prof.ops[i], costs[i]
      for kind in ("cast_bwd", "dlhs", "drhs"):
        if kind in c:
          ms, p = c[kind]
          node_kind = "cast" if kind.startswith("cast") else kind
          prev = (add(Node(f"{op.name} {kind}", node_kind, g.name, "compute", ms, prev, op.name, p)),)
      drhs_nodes[i] = prev[0]
    closing.append(drhs_nodes)
    last.append(prev[0])

  comm_prev: tuple[int, ...] = ()
  comm_nodes = []
  plan = buckets(groups[0].profile, comm.bucket_bytes, comm.bucket_order)
  for b, (op_index, nbytes) in enumerate(plan):
    ready = tuple(closing[j][op_index] for j in range(len(groups)))
    ms = allreduce_ms(nbytes, comm.n_devices, comm.link_gbps, comm.latency_us)
    name = f"all-reduce bucket {b} ({nbytes / 2**20:.1f} MiB)"
    comm_prev = (add(Node(name, "comm", "allreduce", "comm", ms, ready + comm_prev)),)
    comm_nodes.append(comm_prev[0])

  total = sum(nbytes for _, nbytes in plan)
  for j, g in enumerate(groups):
    prev = (last[j],)
    for b, (_, nbytes) in enumerate(plan):
      name = "optimizer" if len(plan) == 1 else f"optimizer (bucket {b})"
      ms = g.profile.optimizer_ms * nbytes / total
      prev = (add(Node(name, "optimizer", g.name, "compute", ms, (*prev, comm_nodes[b]))),)
  return nodes


def longest_path(nodes: Sequence[Node]) -> list[tuple[float, float]]:
  """``(start, end)`` ms of every node: it starts when all its deps have ended (at 0 without
  deps). A negative remainder (fitted where standalone op timings exceed their cost inside the
  step) moves everything after it earlier by its full amount, even past 0, so that the fit
  reproduces the step it is fitted to."""
  times: list[tuple[float, float]] = []
  for node in nodes:
    start = max((times[d][1] for d in node.deps), default=0.0)
    times.append((start, start + node.ms))
  return times
