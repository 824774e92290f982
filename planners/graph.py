"""The op graph of one synchronous training step, costed for a plan.

``build_graph(groups)`` returns a DAG of ``Node`` s (in topological order). Each
``GroupCost`` (one device group: its profile, its op policies, its batch) contributes a chain
on its own ``compute`` stream:

  forward ops in order → forward remainder → backward remainder → for each op in reverse:
  [restore cast] → dlhs → drhs → … → optimizer

* A *restore cast* node sits before an op's gradient legs when its forward ran int8/fp8: the
  backward dequantizes the saved 1-byte operands back to fp32 (the ``"int8->fp32"`` /
  ``"fp8->fp32"`` cast model). Conversions of fp32 operands into a leg's own precision are
  part of that leg's profiled time (``qsync_jax.qdot.leg_dot`` runs them).
* The first op takes the model input, which is not differentiated: it has no dlhs leg.
* Gradients are all-reduced in buckets (``bucket_bytes``, e.g. 25 MB of fp32 weight
  gradients, in backward order): one ``comm`` node per bucket, shared by all groups, starts
  when *every* group's backward has produced the bucket (its last drhs) and after the
  previous bucket (one comm stream), and overlaps the remaining backward. Parameters outside
  quantizable ops (biases, norms) join the last bucket.
* Each group's optimizer node waits for its own backward and the last bucket.

Times scale linearly with the group's batch relative to the profiled batch. ``longest_path``
gives every node's start and end; the synchronous step is the latest end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from planners.catalog import allreduce_ms
from planners.profiler import Profile
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclasses.dataclass(frozen=True)
class Node:
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
class GroupCost:
  """What costs one device group's share of a step.

  Attributes:
    name: group name.
    profile: the cost profile of the group's device type.
    op_policies: op name → OpPolicy (None or absent: the unmodified float op).
    batch_per_device: the group's per-device batch.
  """

  name: str
  profile: Profile
  op_policies: Mapping[str, OpPolicy | None]
  batch_per_device: int


@dataclasses.dataclass(frozen=True)
class Comm:
  """The shared gradient all-reduce: ``n_devices`` in a ring over the slowest link."""

  n_devices: int
  link_gbps: float
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  latency_us: float = 10.0


def float_precision(profile: Profile) -> str:
  """Precision of an unmodified float op: XLA's default (tf32 on GPUs that have it)."""
  return "tf32" if "tf32" in profile.op_ms[profile.ops[0].name]["fwd"] else "fp32"


def op_costs(group: GroupCost, op_index: int) -> dict[str, tuple[float, str]]:
  """``{fwd|cast|dlhs|drhs: (ms, precision)}`` of one op of one group (cast absent if none)."""
  prof = group.profile
  op = prof.ops[op_index]
  scale = group.batch_per_device / prof.batch_per_device
  pol = group.op_policies.get(op.name)
  if pol is None:
    p = float_precision(prof)
    legs, sr = {"fwd": p, "dlhs": p, "drhs": p}, False
  else:
    legs, sr = {"fwd": pol.fwd, "dlhs": pol.dlhs, "drhs": pol.drhs}, pol.grad_rounding == "stochastic"
  out = {}
  out["fwd"] = (op.calls * scale * prof.leg_ms(op.name, "fwd", legs["fwd"]), legs["fwd"])
  if legs["fwd"] in QUANTIZED_PRECISIONS:
    lhs = op.batch * op.m * op.k if op.kind == "conv" else op.lhs_elems
    cast = prof.cast[f"{legs['fwd']}->fp32"]
    out["cast"] = (op.calls * (cast.ms(lhs * scale) + cast.ms(op.rhs_elems)), legs["fwd"])
  if op_index > 0:
    out["dlhs"] = (op.calls * scale * prof.leg_ms(op.name, "dlhs", legs["dlhs"], sr), legs["dlhs"])
  out["drhs"] = (op.calls * scale * prof.leg_ms(op.name, "drhs", legs["drhs"], sr), legs["drhs"])
  return out


def buckets(profile: Profile, bucket_bytes: int) -> list[tuple[int, int]]:
  """``[(index of the op whose drhs closes the bucket, fp32 gradient bytes)]`` in backward order.

  The last bucket (closed by the first op, or the end of the backward) also carries the
  parameters outside quantizable ops.
  """
  out, acc = [], 0
  ops = profile.ops
  for i in reversed(range(len(ops))):
    acc += 4 * ops[i].param_elems
    if acc >= bucket_bytes:
      out.append((i, acc))
      acc = 0
  rest = profile.memory["param_bytes"] - sum(4 * o.param_elems for o in ops)
  if acc + rest > 0 or not out:
    out.append((0, acc + max(rest, 0)))
  return out


def build_graph(groups: Sequence[GroupCost], comm: Comm) -> list[Node]:
  """The step graph of all ``groups`` with their shared all-reduce; see the module docstring."""
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
    costs = [op_costs(g, i) for i in range(len(prof.ops))]
    for op, c in zip(prof.ops, costs):
      ms, p = c["fwd"]
      prev = (add(Node(f"{op.name} fwd", "fwd", g.name, "compute", ms, prev, op.name, p)),)
    for part in ("fwd", "bwd"):
      ms = scale * prof.remainder_ms[part]
      prev = (add(Node(f"remainder {part}", "remainder", g.name, "compute", ms, prev)),)
    for i in reversed(range(len(prof.ops))):
      op, c = prof.ops[i], costs[i]
      for leg in ("cast", "dlhs", "drhs"):
        if leg in c:
          ms, p = c[leg]
          prev = (add(Node(f"{op.name} {leg}", leg, g.name, "compute", ms, prev, op.name, p)),)
      drhs_nodes[i] = prev[0]
    closing.append(drhs_nodes)
    last.append(prev[0])

  comm_prev: tuple[int, ...] = ()
  plan = buckets(groups[0].profile, comm.bucket_bytes)
  for b, (op_index, nbytes) in enumerate(plan):
    ready = tuple(closing[j][op_index] for j in range(len(groups)))
    if b == len(plan) - 1:
      ready = tuple(last)
    ms = allreduce_ms(nbytes, comm.n_devices, comm.link_gbps, comm.latency_us)
    comm_prev = (
      add(
        Node(
          f"all-reduce bucket {b} ({nbytes / 2**20:.1f} MiB)",
          "comm",
          "allreduce",
          "comm",
          ms,
          ready + comm_prev,
        )
      ),
    )

  for j, g in enumerate(groups):
    add(Node("optimizer", "optimizer", g.name, "compute", g.profile.optimizer_ms, (last[j], *comm_prev)))
  return nodes


def longest_path(nodes: Sequence[Node]) -> list[tuple[float, float]]:
  """``(start, end)`` ms of every node: it starts when all its deps have ended."""
  times: list[tuple[float, float]] = []
  for node in nodes:
    start = max((times[d][1] for d in node.deps), default=0.0)
    times.append((start, start + node.ms))
  return times
