"""Replay simulator: predicted step time and peak memory of a plan on a cluster.

``predict(cluster, profiles, plan)`` costs the step graph of ``planners.predictor.graph`` for every
device group (its profile, policy and batch) and the memory model of ``planners.predictor.memory_model``,
and returns a ``Prediction``: ``step_ms`` (the synchronous step, the longest path),
``group_step_ms`` (each group's step were every device like it: the straggler),
``group_compute_ms`` (forward + backward + optimizer, no communication), ``memory_bytes``
(peak per device of each group: the plan's one program holds every group's branch,
``program_memory_bytes``), and where the step's time goes: ``comm_ms_by_phase``,
``exposed_comm_ms`` and ``optimizer_tail_ms`` (``Prediction``). The plan's ``reduction``,
``optimizer_update`` and ``sync`` (fp32 where it states none) choose the collectives
(``comm_for``; ``planners.predictor.graph``). A group whose device type has no profile gets one
modeled from the catalog
(``planners.predictor.modeled``), labelled so in ``sources``; a group with a profile of its own
(``Profile.group``, calibrated to its measurements) is costed from that one (``profile_for``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from planners.predictor.graph import (
  DEFAULT_BUCKET_BYTES,
  DEFAULT_LATENCY_US,
  Comm,
  GroupLink,
  Node,
  build_graph,
  chain_times,
  gradients_together,
  longest_path,
  op_costs,
  step_ms,
)
from planners.predictor.memory_model import program_memory_bytes
from planners.predictor.modeled import modeled_profile
from planners.profile import GroupCost, Profile, profile_key
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.sync.two_level import BUCKET_BYTES as TWO_LEVEL_BUCKET_BYTES


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted step of a plan; see the module docstring. Times in ms, memory in bytes.

  ``comm_ms_by_phase``: the time of each phase of the collectives (``Node.phase``: ``all-reduce``;
  ``reduce-scatter``, ``all-gather``; ``intra reduce``, ``inter all-reduce``, ``intra
  broadcast``), summed over its buckets; ``comm_ms`` is their sum. ``exposed_comm_ms``: per
  group, the time collectives run while its devices compute nothing (not overlapped).
  ``optimizer_tail_ms``: per group, the optimizer update's time on each of its devices (all of
  it replicated, a ``1/N`` share sharded)."""

  step_ms: float
  group_step_ms: dict[str, float]
  group_compute_ms: dict[str, float]
  memory_bytes: dict[str, int]
  memory_limit_bytes: dict[str, int]
  comm_ms: float
  sources: dict[str, str]
  comm_ms_by_phase: dict[str, float] = dataclasses.field(default_factory=dict)
  exposed_comm_ms: dict[str, float] = dataclasses.field(default_factory=dict)
  optimizer_tail_ms: dict[str, float] = dataclasses.field(default_factory=dict)
  nodes: tuple[Node, ...] = ()
  times: tuple[tuple[float, float], ...] = ()

  @property
  def fits(self) -> bool:
    return all(self.memory_bytes[g] <= self.memory_limit_bytes[g] for g in self.memory_bytes)

  def to_json(self) -> dict:
    fields = (
      "step_ms",
      "group_step_ms",
      "group_compute_ms",
      "memory_bytes",
      "memory_limit_bytes",
      "comm_ms",
      "comm_ms_by_phase",
      "exposed_comm_ms",
      "optimizer_tail_ms",
    )
    return {**{f: getattr(self, f) for f in fields}, "cost_source": self.sources}


def profile_for(profiles: Mapping[str, Profile], device_type: str, group: str | None = None) -> Profile:
  """The profile of device group ``group`` alone (``profile_key(device_type, group)``: one
  calibrated to its measurements), else of ``device_type``, else one modeled from a measured
  profile of the model (``base_profile``)."""
  own = profiles.get(profile_key(device_type, group)) if group is not None else None
  if own is not None:
    return own
  if device_type in profiles:
    return profiles[device_type]
  if not profiles:
    raise PlanError("no cost profile given. Fix: pass at least one file from `qsync profile`.")
  return modeled_profile(base_profile(profiles), device_type)


def resolve_profiles(cluster: ClusterSpec, profiles: Mapping[str, Profile]) -> dict[str, Profile]:
  """``profiles`` with, for every device type of ``cluster`` that has none, the profile
  ``profile_for`` would model from the catalog, each modeled once: a planner that replays many
  plans of one cluster costs every group from one profile object (so its memos, keyed on the
  profile's identity, hold), instead of modeling it again for every replay."""
  out = dict(profiles)
  for device_type in sorted({g.device_type for g in cluster.groups} - set(profiles)):
    out[device_type] = profile_for(profiles, device_type)
  return out


def base_profile(profiles: Mapping[str, Profile]) -> Profile:
  """The profile a device type without one of its own is modeled from: the first measured
  profile of a device type (in the order given), else the first of a device type, else the
  first of a group (``Profile.group``: one group's speed is not its device type's)."""
  return sorted(profiles.values(), key=lambda p: (p.group is not None, p.source != "measured"))[0]


def one_device_compute_ms(group: GroupCost) -> float:
  """One device's training step of ``group`` without collectives — its forward, backward and
  whole optimizer update (what ``qsync_jax.train.replan.measure_groups`` times) — modeled: the
  sum of the group's compute nodes in ``build_graph`` with a replicated update,
  ``chain_times(group, op_costs).end + group.profile.optimizer_ms``."""
  return chain_times(group, op_costs).end + group.profile.optimizer_ms


def group_costs(cluster: ClusterSpec, profiles: Mapping[str, Profile], plan: Plan) -> list[GroupCost]:
  """One ``GroupCost`` per group of ``cluster``, with the plan's policies, batches and micro-steps."""
  plan.validate_for(cluster)
  profiles = resolve_profiles(cluster, profiles)
  cluster = plan.apply_to(cluster)
  out = []
  for g in cluster.groups:
    prof = profile_for(profiles, g.device_type, g.name)
    policies = prof.policies(plan.policy_on(g))
    out.append(GroupCost(g.name, prof, policies, g.batch_per_device, plan.micro_steps_of(g.name)))
  return out


def flat_ring_gbps(cluster: ClusterSpec) -> float:
  """The link of a ring over every device of ``cluster``: the slowest link it crosses. Inside one
  group its ``intra_group_gbps``; across groups the slowest ``link_gbps`` and
  ``intra_group_gbps`` of every group."""
  if len(cluster.groups) == 1:
    return cluster.groups[0].intra_group_gbps
  return min(min(g.link_gbps, g.intra_group_gbps) for g in cluster.groups)


def comm_for(
  cluster: ClusterSpec,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  latency_us: float = DEFAULT_LATENCY_US,
  bucket_order: str = "tree",
  *,
  reduction: str = "flat",
  optimizer_update: str = "replicated",
  sync: str = "fp32",
) -> Comm:
  """The collectives of ``cluster`` (its running groups: a plan's ``apply_to``), each paying
  ``latency_us``: ``flat``, one ring over all its devices on ``flat_ring_gbps``, in buckets of
  ``bucket_bytes`` packed in ``bucket_order`` (``planners.predictor.graph.buckets``);
  ``two_level``, per bucket a tree inside each group on its ``intra_group_gbps`` and a ring of the
  group leaders on the slowest ``link_gbps``, in the trainer's two-level buckets
  (``qsync_jax.sync.two_level.BUCKET_BYTES`` in backward order, whatever ``bucket_bytes`` and
  ``bucket_order`` say: they describe the flat all-reduce's); ``sync`` the gradient sync
  (``planners.predictor.payload``). ``PlanError`` for ``two_level`` with a ``sharded`` update,
  and for a sync other than fp32 with either."""
  two_level = reduction == "two_level"
  return Comm(
    cluster.num_devices,
    flat_ring_gbps(cluster),
    TWO_LEVEL_BUCKET_BYTES if two_level else bucket_bytes,
    latency_us,
    "backward" if two_level else bucket_order,
    reduction,
    optimizer_update,
    tuple(GroupLink(g.count, g.intra_group_gbps) for g in cluster.groups),
    min(g.link_gbps for g in cluster.groups),
    sync,
  )


def sync_step_ms(
  groups: Sequence[GroupCost], comm: Comm, cost_fn=None, together: bool | None = None
) -> float:
  """The synchronous step time (ms) of ``groups`` sharing ``comm``: the longest path's end,
  ``max(end for _, end in longest_path(build_graph(groups, comm, cost_fn, together)))``
  bit-for-bit, without building the graph (``planners.predictor.graph.step_ms``)."""
  return step_ms(groups, comm, cost_fn, together)


def predict(
  cluster: ClusterSpec,
  profiles: Mapping[str, Profile],
  plan: Plan,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  latency_us: float = DEFAULT_LATENCY_US,
  bucket_order: str = "tree",
) -> Prediction:
  """Predicted step time and memory of ``plan`` on ``cluster``; see the module docstring.
  ``latency_us`` is the fixed cost of each collective (each round of a two-level stage);
  ``bucket_order`` how the flat all-reduce's gradients are packed into buckets: ``"tree"`` by
  XLA's combiner (the trainer's default), ``"backward"`` by an all-reduce with ``bucket_bytes``
  (a two-level plan runs the trainer's own buckets, ``comm_for``)."""
  comm = comm_for(
    plan.apply_to(cluster),
    bucket_bytes,
    latency_us,
    bucket_order,
    reduction=plan.reduction,
    optimizer_update=plan.optimizer_update,
    sync=plan.sync or "fp32",
  )
  groups = group_costs(cluster, profiles, plan)
  together = gradients_together(groups)
  nodes = build_graph(groups, comm)
  times = longest_path(nodes)
  by_phase = comm_ms_by_phase(nodes)
  shards = comm.n_devices if plan.optimizer_update == "sharded" else 1
  return Prediction(
    step_ms=max(end for _, end in times),
    group_step_ms={g.name: sync_step_ms([g], comm, together=together) for g in groups},
    group_compute_ms={
      g.name: sum(n.ms for n in nodes if n.group == g.name and n.stream == "compute") for g in groups
    },
    memory_bytes=program_memory_bytes(groups, optimizer_shards=shards, devices=comm.n_devices),
    memory_limit_bytes={g.name: int(g.memory_gb * 1e9) for g in cluster.groups},
    comm_ms=sum(by_phase.values()),
    sources={g.name: f"{g.profile.source} ({g.profile.device_type})" for g in groups},
    comm_ms_by_phase=by_phase,
    exposed_comm_ms={g.name: exposed_comm_ms(nodes, times, g.name) for g in groups},
    optimizer_tail_ms={
      g.name: sum(n.ms for n in nodes if n.group == g.name and n.kind == "optimizer") for g in groups
    },
    nodes=tuple(nodes),
    times=tuple(times),
  )


def comm_ms_by_phase(nodes: Sequence[Node]) -> dict[str, float]:
  """``{phase: ms}``: the comm nodes' times summed per ``Node.phase``."""
  out: dict[str, float] = {}
  for n in nodes:
    if n.stream == "comm":
      out[n.phase] = out.get(n.phase, 0.0) + n.ms
  return out


def exposed_comm_ms(nodes: Sequence[Node], times: Sequence[tuple[float, float]], group: str) -> float:
  """ms during which a collective runs (every one is shared by all groups) and ``group``'s
  compute stream is idle: the length of the union of the collectives' intervals less its
  overlap with the union of the group's compute intervals."""
  comm = [t for n, t in zip(nodes, times) if n.stream == "comm"]
  return exposed_length(comm, [t for n, t in zip(nodes, times) if n.stream == "compute" and n.group == group])


def exposed_length(comm: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]) -> float:
  """Length of the points covered by an interval of ``comm`` and by none of ``compute``:
  ``len(∪ comm) − len(∪ comm ∩ ∪ compute)`` (one sweep over the sorted unions)."""
  comm, compute = union_intervals(comm), union_intervals(compute)
  covered, j = 0.0, 0
  for s, e in comm:
    while j < len(compute) and compute[j][1] <= s:
      j += 1
    k = j
    while k < len(compute) and compute[k][0] < e:
      covered += min(e, compute[k][1]) - max(s, compute[k][0])
      k += 1
  return sum(e - s for s, e in comm) - covered


def union_intervals(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  """Disjoint sorted intervals covering the same points as ``intervals`` (empty ones dropped)."""
  out: list[tuple[float, float]] = []
  for s, e in sorted(t for t in intervals if t[1] > t[0]):
    if out and s <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], e))
    else:
      out.append((s, e))
  return out
