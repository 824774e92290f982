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
* The gradients are combined and the parameters updated as ``Comm`` says (formulas in
  ``planners.predictor.collectives``; every ``comm`` node carries its ``phase``):

  - ``flat`` + ``replicated``: the gradients are all-reduced in buckets of at most
    ``bucket_bytes`` (``buckets``): one ``all-reduce`` node per bucket, shared by all groups,
    starts when every group's backward has produced the bucket and after the previous bucket,
    overlapping the rest of the backward. Each group's optimizer update of a bucket runs after
    that bucket's all-reduce.
  - ``flat`` + ``sharded``: the same buckets are reduce-scattered (``reduce-scatter`` nodes, in
    place of the all-reduce); each group's update of a bucket's shard (``optimizer_ms / N`` of
    its share) runs after its reduce-scatter; a bucket's updated shards are all-gathered
    (``all-gather`` nodes) once every group has updated them and after the last reduce-scatter.
  - ``flat`` with a ``sync`` other than fp32 (``planners.predictor.payload``): once every
    group's backward is done, each group runs the sync's passes before the collective (a
    ``sync`` node on its compute stream), one shared node runs its collectives over the whole
    gradient, each group runs the passes after it, then its whole optimizer update. No overlap.
  - ``two_level`` (+ ``replicated``): the same buckets (the trainer's two-level sum packs its
    own, ``replay.comm_for``), each reduced inside every group by a tree (an ``intra reduce``
    node), all-reduced among the group leaders (``inter all-reduce``) and broadcast back inside
    every group (``intra broadcast``), each stage a shared node over all of the comm's groups.
    A bucket's first stage starts when every group's backward has produced the bucket and after
    the previous bucket's last stage, overlapping the rest of the backward; each group's
    optimizer update of a bucket runs after that bucket's broadcast.

Where the groups run more than one branch of the trainer's step, or micro-steps
(``gradients_together``), every bucket is ready only at its group's last backward node: the
step's ``lax.switch`` / ``lax.scan`` returns all gradients at once, so nothing overlaps.

A group's compute times are the profiled ones times ``GroupCost.compute_scale``: linear in its
batch over the profiled batch, plus the profile's batch-independent share again for every
micro-step after the first. ``longest_path`` gives
every node's start and end; the synchronous step is the latest end. ``step_ms`` computes that
latest end without building the graph (what a planner replays per candidate plan).
"""

from __future__ import annotations

import dataclasses
import math
import types
import weakref
from collections.abc import Sequence
from typing import NamedTuple

from planners.predictor.collectives import (
  all_gather_ms,
  allreduce_ms,
  reduce_scatter_ms,
  round_ring_allreduce_ms,
  tree_ms,
)
from planners.predictor.payload import check_sync, pass_ms, whole_buffer_ms
from planners.profile import GroupCost, Profile
from qsync_jax.errors import PlanError
from qsync_jax.plan import OPTIMIZER_UPDATES, REDUCTIONS
from qsync_jax.precision import PRESETS, QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.sync.allreduce import pack

DEFAULT_BUCKET_BYTES = 30 * 2**20
"""XLA:GPU's default all-reduce combine threshold (``xla_gpu_all_reduce_combine_threshold_bytes``)."""
DEFAULT_LATENCY_US = 10.0
"""Fixed cost of one all-reduce collective when no link microbenchmark measured it."""
PRESET_NAMES = {pol: name for name, pol in PRESETS.items()}
LEG_NAMES = ("dlhs", "drhs")
SHARED = "allreduce"
"""``Node.group`` of the collectives every group takes part in."""


class Node(NamedTuple):
  """One timed step of the graph. ``deps`` are indices of earlier nodes."""

  name: str
  kind: str  # fwd | dlhs | drhs | cast | remainder | optimizer | comm | sync (a sync's passes)
  group: str  # device group, or "allreduce" for comm nodes
  stream: str  # compute | comm
  ms: float
  deps: tuple[int, ...] = ()
  op: str | None = None
  precision: str | None = None
  phase: str | None = None  # comm nodes: all-reduce | reduce-scatter | all-gather | intra reduce | …


class GroupLink(NamedTuple):
  """A device group as the two-level reduction sees it: its running devices and the bandwidth
  between two of them (Gbit/s)."""

  n_devices: int
  intra_link_gbps: float


@dataclasses.dataclass(frozen=True)
class Comm:
  """How the step combines gradients and updates parameters (module docstring).

  ``flat``: ``n_devices`` in one ring over ``link_gbps`` (the slowest link the ring crosses), in
  buckets of ``bucket_bytes`` packed in ``bucket_order`` (``buckets``), all-reduced
  (``optimizer_update="replicated"``) or reduce-scattered and all-gathered (``"sharded"``).
  ``two_level``: per bucket (the same packing), a tree inside each of ``groups`` over its
  ``intra_link_gbps`` and a ring of the groups' leaders over ``leader_link_gbps``; replicated
  update only. Every collective (every
  round of a two-level stage) pays ``latency_us``. ``sync``: the gradient sync
  (``planners.predictor.payload``); one other than fp32 runs flat with the replicated update,
  as the trainer runs it."""

  n_devices: int
  link_gbps: float
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  latency_us: float = DEFAULT_LATENCY_US
  bucket_order: str = "tree"
  reduction: str = "flat"
  optimizer_update: str = "replicated"
  groups: tuple[GroupLink, ...] = ()
  leader_link_gbps: float | None = None
  sync: str = "fp32"

  def __post_init__(self):
    check_sync(self.sync)
    if self.sync != "fp32" and (self.reduction, self.optimizer_update) != ("flat", "replicated"):
      raise PlanError(
        f"sync {self.sync!r} with reduction={self.reduction!r}, optimizer_update={self.optimizer_update!r} is "
        "not a combination the trainer runs: a sync of its own replaces the default fp32 reduction, which the "
        "sharded update and the two-level sum replace too. Fix: use reduction='flat' with "
        "optimizer_update='replicated' for that sync, or sync='fp32'."
      )
    for field, allowed in (("reduction", REDUCTIONS), ("optimizer_update", OPTIMIZER_UPDATES)):
      if getattr(self, field) not in allowed:
        raise PlanError(
          f"{field}={getattr(self, field)!r} is not one of {list(allowed)}. Fix: use one of them."
        )
    if (self.reduction, self.optimizer_update) == ("two_level", "sharded"):
      raise PlanError(
        "reduction='two_level' with optimizer_update='sharded' is not a combination the trainer runs. "
        "Fix: use reduction='flat' with optimizer_update='sharded', or reduction='two_level' with "
        "optimizer_update='replicated'."
      )
    if self.reduction == "two_level" and (not self.groups or self.leader_link_gbps is None):
      raise ValueError(
        "Comm(reduction='two_level') needs groups and leader_link_gbps. "
        "Fix: build it with planners.predictor.replay.comm_for."
      )


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
  costs = standalone_costs(prof, op_index, pol, group.compute_scale)
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


_BUCKETS: dict[tuple[int, int, str], tuple[Profile, tuple[tuple[int, int], ...]]] = {}
"""``buckets``' results by (profile identity, bucket_bytes, order): a planner replays one
profile's buckets thousands of times (the entry holds the profile, so its id is not reused)."""


def buckets(profile: Profile, bucket_bytes: int, order: str = "tree") -> list[tuple[int, int]]:
  """``_pack_buckets``, memoized per profile object (profiles are frozen)."""
  key = (id(profile), bucket_bytes, order)
  hit = _BUCKETS.get(key)
  if hit is None or hit[0] is not profile:
    if len(_BUCKETS) >= 256:
      _BUCKETS.clear()
    hit = _BUCKETS[key] = (profile, tuple(_pack_buckets(profile, bucket_bytes, order)))
  return list(hit[1])


def _pack_buckets(profile: Profile, bucket_bytes: int, order: str) -> list[tuple[int, int]]:
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


def build_graph(
  groups: Sequence[GroupCost], comm: Comm, cost_fn=None, together: bool | None = None
) -> list[Node]:
  """The step graph of all ``groups`` with their shared all-reduce; see the module docstring.

  ``cost_fn(group, op_index)`` defaults to ``op_costs`` (a caller replaying many plans may
  pass a memoized one). ``together``: whether every gradient bucket is ready only at the end of
  its group's backward (default ``gradients_together(groups)``; a caller pricing part of a
  larger step passes the whole step's)."""
  cost_fn = cost_fn or op_costs
  nodes: list[Node] = []
  closing = []  # per group: {op index: node index of its drhs}
  last = []
  for g in groups:
    prof = g.profile
    scale = g.compute_scale
    prev: tuple[int, ...] = ()
    drhs_nodes = {}
    costs = [cost_fn(g, i) for i in range(len(prof.ops))]
    for op, c in zip(prof.ops, costs):
      ms, p = c["fwd"]
      prev = (_add(nodes, Node(f"{op.name} fwd", "fwd", g.name, "compute", ms, prev, op.name, p)),)
    for part in ("fwd", "bwd"):
      ms = scale * prof.remainder_ms[part]
      prev = (_add(nodes, Node(f"remainder {part}", "remainder", g.name, "compute", ms, prev)),)
    for i in reversed(range(len(prof.ops))):
      op, c = prof.ops[i], costs[i]
      for kind in ("cast_bwd", "dlhs", "drhs"):
        if kind in c:
          ms, p = c[kind]
          node_kind = "cast" if kind.startswith("cast") else kind
          prev = (_add(nodes, Node(f"{op.name} {kind}", node_kind, g.name, "compute", ms, prev, op.name, p)),)
      drhs_nodes[i] = prev[0]
    closing.append(drhs_nodes)
    last.append(prev[0])

  if (
    gradients_together(groups) if together is None else together
  ):  # buckets leave the switch / scan at its end
    closing = [dict.fromkeys(drhs_nodes, end) for drhs_nodes, end in zip(closing, last)]
  plan = buckets(groups[0].profile, comm.bucket_bytes, comm.bucket_order)
  if comm.reduction == "two_level":
    _two_level(nodes, groups, comm, plan, closing, last)
  elif comm.sync != "fp32":
    _whole_buffer(nodes, groups, comm, plan, last)
  else:
    _flat(nodes, groups, comm, plan, closing, last)
  return nodes


def gradients_together(groups: Sequence[GroupCost]) -> bool:
  """Whether the trainer's step produces every gradient leaf at once, at the end of each device's
  backward: where its groups run more than one branch (``qsync_jax.train.branch``: distinct op
  policies, per-device batches or micro-steps), each device's forward and backward is one branch
  of a ``lax.switch``, and micro-steps run in a ``lax.scan``; a collective can start only once
  the switch or the scan has returned all of its outputs."""
  first = groups[0]
  return first.micro_steps > 1 or any(
    (g.batch_per_device, g.micro_steps, _resolved_policies(g))
    != (first.batch_per_device, first.micro_steps, _resolved_policies(first))
    for g in groups[1:]
  )


def _resolved_policies(group: GroupCost) -> tuple:
  """Each op's policy as ``op_costs`` runs it (an op without one at its profile's float precision)."""
  prof = group.profile
  return tuple(group.op_policies.get(n) or OpPolicy.uniform(float_precision(prof)) for n in prof.op_names)


def _add(nodes: list[Node], node: Node) -> int:
  nodes.append(node)
  return len(nodes) - 1


def _bucket_collectives(nodes, plan, ready, phase: str, ms_of, after: tuple[int, ...] = ()) -> list[int]:
  """One shared ``comm`` node per bucket of ``plan``, in order: bucket ``b`` after ``ready(b)``
  and the previous one (the first after ``after``), costing ``ms_of(bytes)``."""
  out, prev = [], after
  for b, (_, nbytes) in enumerate(plan):
    name = f"{phase} bucket {b} ({nbytes / 2**20:.1f} MiB)"
    prev = (_add(nodes, Node(name, "comm", SHARED, "comm", ms_of(nbytes), ready(b) + prev, phase=phase)),)
    out.append(prev[0])
  return out


def _flat(nodes, groups, comm: Comm, plan, closing, last) -> None:
  """The ``flat`` collectives and the optimizer nodes after them (module docstring)."""
  n, link, lat = comm.n_devices, comm.link_gbps, comm.latency_us
  sharded = comm.optimizer_update == "sharded"

  def produced(b: int) -> tuple[int, ...]:
    return tuple(closing[j][plan[b][0]] for j in range(len(groups)))

  if sharded:
    first = _bucket_collectives(
      nodes, plan, produced, "reduce-scatter", lambda s: reduce_scatter_ms(s, n, link, lat)
    )
  else:
    first = _bucket_collectives(nodes, plan, produced, "all-reduce", lambda s: allreduce_ms(s, n, link, lat))
  share, label = (1 / n, "optimizer shard") if sharded else (1.0, "optimizer")
  updated = _bucket_updates(nodes, groups, plan, first, last, share, label)
  if sharded:

    def all_updated(b: int) -> tuple[int, ...]:
      return tuple(mine[b] for mine in updated)

    _bucket_collectives(
      nodes, plan, all_updated, "all-gather", lambda s: all_gather_ms(s, n, link, lat), after=(first[-1],)
    )


def _bucket_updates(nodes, groups, plan, reduced, last, share: float, label: str) -> list[list[int]]:
  """Per group, one ``optimizer`` node per bucket of ``plan`` (``share`` of the bucket's part of
  its ``optimizer_ms``), after the group's backward (``last``), its previous bucket's update and
  the bucket's collective (``reduced``); the node indices, per group."""
  total = sum(nbytes for _, nbytes in plan)
  updated = []
  for j, g in enumerate(groups):
    prev, mine = (last[j],), []
    for b, (_, nbytes) in enumerate(plan):
      name = label if len(plan) == 1 else f"{label} (bucket {b})"
      ms = g.profile.optimizer_ms * share * nbytes / total
      prev = (_add(nodes, Node(name, "optimizer", g.name, "compute", ms, (*prev, reduced[b]))),)
      mine.append(prev[0])
    updated.append(mine)
  return updated


def _two_level_stages(comm: Comm, nbytes: int) -> tuple[tuple[str, float], ...]:
  """``(phase, ms)`` of the three two-level stages of one bucket of ``nbytes``."""
  tree = tree_ms(nbytes, comm.groups, comm.latency_us)
  ring = round_ring_allreduce_ms(nbytes, len(comm.groups), comm.leader_link_gbps, comm.latency_us)
  return ("intra reduce", tree), ("inter all-reduce", ring), ("intra broadcast", tree)


def _two_level(nodes, groups, comm: Comm, plan, closing, last) -> None:
  """Per bucket of ``plan``, the three ``two_level`` stages, the first once every group has
  produced the bucket and after the previous bucket's last stage; each group's update of a bucket
  after its broadcast (module docstring)."""
  done, prev = [], ()
  for b, (i, nbytes) in enumerate(plan):
    prev = tuple(closing[j][i] for j in range(len(groups))) + prev
    for phase, ms in _two_level_stages(comm, nbytes):
      name = f"{phase} bucket {b} ({nbytes / 2**20:.1f} MiB)"
      prev = (_add(nodes, Node(name, "comm", SHARED, "comm", ms, prev, phase=phase)),)
    done.append(prev[0])
  _bucket_updates(nodes, groups, plan, done, last, 1.0, "optimizer")


def _sync_costs(groups, comm: Comm, plan) -> tuple[float, list[tuple[float, float]]]:
  """``(collective ms, [(passes before, after) ms per group])`` of ``comm.sync`` over the whole
  gradient (``plan``'s bytes, fp32)."""
  elements = sum(nbytes for _, nbytes in plan) / 4
  n = comm.n_devices
  passes = [pass_ms(comm.sync, g.profile.device_type, elements, n) for g in groups]
  ms = whole_buffer_ms(comm.sync, elements, n, comm.link_gbps, comm.latency_us, comm.bucket_bytes)
  return ms, passes


def _whole_buffer(nodes, groups, comm: Comm, plan, last) -> None:
  """A sync other than fp32 on the whole gradient, then each group's optimizer (module docstring)."""
  ms, passes = _sync_costs(groups, comm, plan)
  before = [
    _add(nodes, Node(f"{comm.sync} passes before", "sync", g.name, "compute", pre, (last[j],)))
    for j, (g, (pre, _)) in enumerate(zip(groups, passes))
  ]
  size = f"{sum(nbytes for _, nbytes in plan) / 2**20:.1f} MiB fp32"
  reduced = _add(
    nodes,
    Node(f"{comm.sync} all-reduce ({size})", "comm", SHARED, "comm", ms, tuple(before), phase="all-reduce"),
  )
  for j, (g, (_, post)) in enumerate(zip(groups, passes)):
    after = _add(
      nodes, Node(f"{comm.sync} passes after", "sync", g.name, "compute", post, (before[j], reduced))
    )
    _add(nodes, Node("optimizer", "optimizer", g.name, "compute", g.profile.optimizer_ms, (after,)))


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


class ChainTimes(NamedTuple):
  """End times (ms) on one group's compute chain (forward, remainder, backward; not its
  optimizer), as ``longest_path`` gives them: ``closed[i]`` where op ``i``'s backward ends (its
  drhs node), ``end`` where the chain's last node ends, ``peak`` the latest end of any of its
  nodes (later than ``end`` where a negative remainder moves the nodes after it earlier)."""

  closed: tuple[float, ...]
  end: float
  peak: float


def chain_times(group: GroupCost, cost_fn) -> ChainTimes:
  """``ChainTimes`` of ``group``'s chain in ``build_graph``: its nodes' ``ms`` summed in chain
  order from 0, as ``longest_path`` sums them (bit-for-bit the same floats)."""
  prof = group.profile
  costs = [cost_fn(group, i) for i in range(len(prof.ops))]
  scale = group.compute_scale
  forward = [c["fwd"][0] for c in costs] + [scale * prof.remainder_ms[part] for part in ("fwd", "bwd")]
  backward = [[c[kind][0] for kind in ("cast_bwd", "dlhs", "drhs") if kind in c] for c in costs]
  t, peak = 0.0, -math.inf
  for ms in forward:
    t += ms
    if t > peak:
      peak = t
  closed = [0.0] * len(costs)
  for i in reversed(range(len(costs))):
    for ms in backward[i]:
      t += ms
      if t > peak:
        peak = t
    closed[i] = t
  return ChainTimes(tuple(closed), t, peak)


_CHAINS: dict[tuple, tuple[tuple, ChainTimes]] = {}
"""``chain_times``' results by (weak reference to ``cost_fn``, group name, profile identity,
batch, the identities of the ops' policies), emptied when it reaches 4,096 entries. Each entry
holds the profile and the policies, so that no other object takes their ids while it lives; it
refers to ``cost_fn`` (often a planner's bound memo method) weakly, so that it keeps no planner
alive."""


def memoized_chain_times(group: GroupCost, cost_fn) -> ChainTimes:
  """``chain_times(group, cost_fn)``, memoized: ``cost_fn`` must be a pure function of the
  group's name, profile, batch and op policies (``op_costs`` or a memo of it)."""
  prof = group.profile
  policies = tuple(map(group.op_policies.get, prof.op_names))
  fn_ref = weakref.WeakMethod(cost_fn) if isinstance(cost_fn, types.MethodType) else weakref.ref(cost_fn)
  key = (fn_ref, group.name, id(prof), group.batch_per_device, group.micro_steps, tuple(map(id, policies)))
  hit = _CHAINS.get(key)
  if hit is None:
    if len(_CHAINS) >= 4096:
      _CHAINS.clear()
    hit = _CHAINS[key] = ((prof, policies), chain_times(group, cost_fn))
  return hit[1]


def step_ms(groups: Sequence[GroupCost], comm: Comm, cost_fn=None, together: bool | None = None) -> float:
  """The synchronous step (ms) of ``groups`` sharing ``comm``: bit-for-bit
  ``max(end for _, end in longest_path(build_graph(groups, comm, cost_fn)))``, computed from each
  group's ``ChainTimes`` (memoized, ``memoized_chain_times``) and the shared collectives and
  optimizer nodes as ``_flat`` / ``_two_level`` chain them, without building the graph."""
  if not groups:
    raise ValueError("step_ms needs at least one group. Fix: pass the GroupCost of every group that runs.")
  chains = [memoized_chain_times(g, cost_fn or op_costs) for g in groups]
  if gradients_together(groups) if together is None else together:
    chains = [c._replace(closed=(c.end,) * len(c.closed)) for c in chains]
  plan = buckets(groups[0].profile, comm.bucket_bytes, comm.bucket_order)
  if comm.reduction == "two_level":
    tail = _two_level_ends
  else:
    tail = _flat_ends if comm.sync == "fp32" else _whole_buffer_ends
  return max(max(c.peak for c in chains), *tail(groups, comm, plan, chains))


def _whole_buffer_ends(groups, comm: Comm, plan, chains: Sequence[ChainTimes]) -> list[float]:
  """The end of every node ``_whole_buffer`` adds, in the order it adds them."""
  ms, passes = _sync_costs(groups, comm, plan)
  before = [c.end + pre for c, (pre, _) in zip(chains, passes)]
  reduced = max(before) + ms
  ends = [*before, reduced]
  for g, (_, post) in zip(groups, passes):
    ends += [reduced + post, reduced + post + g.profile.optimizer_ms]
  return ends


def _flat_ends(groups, comm: Comm, plan, chains: Sequence[ChainTimes]) -> list[float]:
  """The end of every node ``_flat`` adds, in the order it adds them."""
  n, link, lat = comm.n_devices, comm.link_gbps, comm.latency_us
  sharded = comm.optimizer_update == "sharded"
  collective_ms = reduce_scatter_ms if sharded else allreduce_ms
  first, prev = [], -math.inf  # -inf: the first bucket has no previous one
  for i, nbytes in plan:
    prev = max(max(c.closed[i] for c in chains), prev) + collective_ms(nbytes, n, link, lat)
    first.append(prev)
  updated = _bucket_update_ends(groups, plan, chains, first, 1 / n if sharded else 1.0)
  ends = first + [t for mine in updated for t in mine]
  if sharded:
    prev = first[-1]
    for b, (_, nbytes) in enumerate(plan):
      prev = max(max(mine[b] for mine in updated), prev) + all_gather_ms(nbytes, n, link, lat)
      ends.append(prev)
  return ends


def _bucket_update_ends(
  groups, plan, chains: Sequence[ChainTimes], reduced, share: float
) -> list[list[float]]:
  """The end of every node ``_bucket_updates`` adds, per group (``reduced``: the collectives' ends)."""
  total = sum(nbytes for _, nbytes in plan)
  updated = []
  for g, chain in zip(groups, chains):
    t, mine = chain.end, []
    for (_, nbytes), end in zip(plan, reduced):
      t = max(t, end) + g.profile.optimizer_ms * share * nbytes / total
      mine.append(t)
    updated.append(mine)
  return updated


def _two_level_ends(groups, comm: Comm, plan, chains: Sequence[ChainTimes]) -> list[float]:
  """The end of every node ``_two_level`` adds, in the order it adds them."""
  ends, done, t = [], [], -math.inf  # -inf: the first bucket has no previous one
  for i, nbytes in plan:
    t = max(max(c.closed[i] for c in chains), t)
    for _, ms in _two_level_stages(comm, nbytes):
      t += ms
      ends.append(t)
    done.append(t)
  return ends + [t for mine in _bucket_update_ends(groups, plan, chains, done, 1.0) for t in mine]
