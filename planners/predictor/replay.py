"""Replay simulator: predicted step time and peak memory of a plan on a cluster.

``predict(cluster, profiles, plan)`` costs the step graph of ``planners.predictor.graph`` for every
device group (its profile, policy and batch) and the memory model of ``planners.predictor.memory_model``,
and returns a ``Prediction``: ``step_ms`` (the synchronous step, the longest path),
``group_step_ms`` (each group's step were every device like it: the straggler),
``group_compute_ms`` (forward + backward + optimizer, no communication) and ``memory_bytes``
(peak per device of each group). A group whose device type has no profile gets one modeled
from the catalog (``planners.predictor.modeled``), labelled so in ``sources``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from planners.predictor.graph import (
  DEFAULT_BUCKET_BYTES,
  DEFAULT_LATENCY_US,
  Comm,
  Node,
  build_graph,
  longest_path,
)
from planners.predictor.memory_model import memory_bytes
from planners.predictor.modeled import modeled_profile
from planners.profile import GroupCost, Profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted step of a plan; see the module docstring. Times in ms, memory in bytes."""

  step_ms: float
  group_step_ms: dict[str, float]
  group_compute_ms: dict[str, float]
  memory_bytes: dict[str, int]
  memory_limit_bytes: dict[str, int]
  comm_ms: float
  sources: dict[str, str]
  nodes: tuple[Node, ...] = ()
  times: tuple[tuple[float, float], ...] = ()

  @property
  def fits(self) -> bool:
    return all(self.memory_bytes[g] <= self.memory_limit_bytes[g] for g in self.memory_bytes)

  def to_json(self) -> dict:
    fields = ("step_ms", "group_step_ms", "group_compute_ms", "memory_bytes", "memory_limit_bytes", "comm_ms")
    return {**{f: getattr(self, f) for f in fields}, "cost_source": self.sources}


def profile_for(profiles: Mapping[str, Profile], device_type: str) -> Profile:
  """The profile of ``device_type``, else one modeled from a measured profile of the model."""
  if device_type in profiles:
    return profiles[device_type]
  if not profiles:
    raise PlanError("no cost profile given. Fix: pass at least one file from `qsync profile`.")
  return modeled_profile(base_profile(profiles), device_type)


def base_profile(profiles: Mapping[str, Profile]) -> Profile:
  """The profile a device type without one of its own is modeled from: the first measured one
  (in the order given), else the first."""
  return sorted(profiles.values(), key=lambda p: p.source != "measured")[0]


def group_costs(cluster: ClusterSpec, profiles: Mapping[str, Profile], plan: Plan) -> list[GroupCost]:
  """One ``GroupCost`` per group of ``cluster``, with the plan's policies and batches."""
  plan.validate_for(cluster)
  cluster = plan.apply_to(cluster)
  out = []
  for g in cluster.groups:
    prof = profile_for(profiles, g.device_type)
    out.append(GroupCost(g.name, prof, plan.policy_for(g.name).resolve(prof.op_names), g.batch_per_device))
  return out


def comm_for(
  cluster: ClusterSpec,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  latency_us: float = DEFAULT_LATENCY_US,
  bucket_order: str = "tree",
) -> Comm:
  """The all-reduce of ``cluster``: all its devices, in a ring limited by the slowest link,
  each collective paying ``latency_us``, in buckets packed in ``bucket_order``
  (``planners.predictor.graph.buckets``)."""
  links = min(g.link_gbps for g in cluster.groups)
  return Comm(cluster.num_devices, links, bucket_bytes, latency_us, bucket_order)


def sync_step_ms(groups: Sequence[GroupCost], comm: Comm, cost_fn=None) -> float:
  """The synchronous step time (ms) of ``groups`` sharing ``comm``: the longest path."""
  return max(end for _, end in longest_path(build_graph(groups, comm, cost_fn)))


def predict(
  cluster: ClusterSpec,
  profiles: Mapping[str, Profile],
  plan: Plan,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  latency_us: float = DEFAULT_LATENCY_US,
  bucket_order: str = "tree",
) -> Prediction:
  """Predicted step time and memory of ``plan`` on ``cluster``; see the module docstring.
  ``latency_us`` is the fixed cost of each all-reduce bucket; ``bucket_order`` how the
  gradients are packed into buckets: ``"tree"`` by XLA's combiner (the trainer's default),
  ``"backward"`` by an all-reduce with ``bucket_bytes``."""
  groups = group_costs(cluster, profiles, plan)
  comm = comm_for(plan.apply_to(cluster), bucket_bytes, latency_us, bucket_order)
  nodes = build_graph(groups, comm)
  times = longest_path(nodes)
  return Prediction(
    step_ms=max(end for _, end in times),
    group_step_ms={g.name: sync_step_ms([g], comm) for g in groups},
    group_compute_ms={
      g.name: sum(n.ms for n in nodes if n.group == g.name and n.stream == "compute") for g in groups
    },
    memory_bytes={g.name: memory_bytes(g) for g in groups},
    memory_limit_bytes={g.name: int(g.memory_gb * 1e9) for g in cluster.groups},
    comm_ms=sum(n.ms for n in nodes if n.stream == "comm"),
    sources={g.name: f"{g.profile.source} ({g.profile.device_type})" for g in groups},
    nodes=tuple(nodes),
    times=tuple(times),
  )
