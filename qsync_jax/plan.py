"""Plan: one precision policy per device group, plus what justified it.

The allocator writes a plan, a person may edit it, the trainer executes it. A group the plan
does not name runs the unmodified float model (an empty policy). ``batch_per_device``
optionally overrides the cluster spec's per-device batch of some groups (0 leaves a group's
devices out of the job); ``micro_steps`` splits a group's per-device batch ``b`` into ``k``
micro-batches of ``b/k`` whose weighted gradients are summed before the step's one gradient
sync (gradient accumulation: the full-batch gradient, with BatchNorm statistics per
micro-batch; default 1, none); ``reduction`` says how gradients are combined (``"flat"``: one
all-reduce over every device; ``"two_level"``: within each group, then across groups);
``optimizer_update`` where the optimizer runs (``"replicated"``: every device updates every
parameter; ``"sharded"``: each device updates an equal share and the updated parameters are
gathered, ZeRO-1); ``sync`` the gradient sync the plan was made for (a strategy of
``qsync_jax.sync``, e.g. ``"bf16"``; absent: not stated, the trainer runs the sync it is given,
fp32 by default), which the trainer runs unless told another one (``sync_for``: a contradiction
is refused); ``predictions`` is free-form JSON (predicted step time, memory, the alternatives
the planner compared…) that the trainer stores but never reads.

The per-device batches (the cluster spec's, with the plan's overrides) must add up to the
spec's global batch (``validate_for``): a plan moves examples between groups, it does not change
how many a step trains on.

JSON form::

  {"policies": {"infer": {"rules": [...], "__default__": "int8_fwd"}, "train": "fp32"},
   "batch_per_device": {"infer": 16}, "micro_steps": {"train": 2},
   "reduction": "flat", "optimizer_update": "replicated", "sync": "fp32",
   "predictions": {"step_time_s": 0.21}}

(a policy may also be given as a preset name, meaning that preset for every op).

Examples:
  >>> plan = Plan.from_json({"policies": {"infer": "int8_fwd"}})
  >>> plan.policy_for("infer").default.fwd, plan.policy_for("train").default is None
  ('int8', True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from qsync_jax.cluster import ClusterSpec, DeviceGroup, assign_devices
from qsync_jax.errors import PlanError, PolicyError, UnsupportedPrecisionError
from qsync_jax.jsonio import JsonFile, reject_unknown_keys
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy

REDUCTIONS = ("flat", "two_level")
"""How the step combines gradients: one all-reduce over every device, or within each device
group first and then across groups."""
OPTIMIZER_UPDATES = ("replicated", "sharded")
"""Where the optimizer runs: on every device for every parameter, or an equal share per device."""


@dataclasses.dataclass(frozen=True)
class Plan(JsonFile):
  """Precision policy per device group name; optional per-device batch overrides; predictions."""

  JSON_WHAT = "plan"
  JSON_ERROR = PlanError

  policies: Mapping[str, PrecisionPolicy] = dataclasses.field(default_factory=dict)
  batch_per_device: Mapping[str, int] = dataclasses.field(default_factory=dict)
  micro_steps: Mapping[str, int] = dataclasses.field(default_factory=dict)
  predictions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  reduction: str = "flat"
  optimizer_update: str = "replicated"
  sync: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "policies", dict(self.policies))
    object.__setattr__(self, "batch_per_device", dict(self.batch_per_device))
    object.__setattr__(self, "micro_steps", dict(self.micro_steps))
    object.__setattr__(self, "predictions", dict(self.predictions))
    for group, policy in self.policies.items():
      if not isinstance(policy, PrecisionPolicy):
        raise PlanError(
          f"plan: policy of group {group!r} is a {type(policy).__name__}, not a PrecisionPolicy. "
          "Fix: use PrecisionPolicy(...) or PrecisionPolicy.uniform(preset)."
        )
    for field, allowed in (("reduction", REDUCTIONS), ("optimizer_update", OPTIMIZER_UPDATES)):
      if getattr(self, field) not in allowed:
        raise PlanError(
          f"plan: {field}={getattr(self, field)!r} is not one of {list(allowed)}. Fix: use one of them."
        )
    if self.sync is not None:
      from qsync_jax.sync import STRATEGIES

      if self.sync not in STRATEGIES:
        raise PlanError(
          f"plan: sync={self.sync!r} is not a gradient sync strategy. Fix: use one of {sorted(STRATEGIES)}, "
          "or leave it out."
        )
    for group, b in self.batch_per_device.items():
      if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise PlanError(
          f"plan: batch_per_device[{group!r}]={b!r} must be an integer ≥ 0 (0: the group sits out). "
          "Fix: set it to 0 or more."
        )
    for group, k in self.micro_steps.items():
      if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(
          f"plan: micro_steps[{group!r}]={k!r} must be an integer ≥ 1 (1: no accumulation). "
          "Fix: set it to 1 or more."
        )

  def micro_steps_of(self, group: str) -> int:
    """How many micro-batches the group splits its per-device batch into (1 when the plan has none)."""
    return self.micro_steps.get(group, 1)

  def sync_for(self, requested: str | None) -> str | None:
    """The gradient sync to run when ``requested`` (a strategy name, ``"psum"`` meaning
    ``"fp32"``; None: none asked for) meets this plan's ``sync``: ``requested`` where the plan
    states none or the same; the plan's where none is requested (None for ``"fp32"``, the
    trainer's default reduction); ``PlanError`` naming both where they differ."""
    requested = "fp32" if requested == "psum" else requested
    if self.sync is None or requested == self.sync:
      return requested
    if requested is None:
      return None if self.sync == "fp32" else self.sync
    raise PlanError(
      f"the sync {requested!r} contradicts the plan's sync {self.sync!r}: the plan was made for "
      f"{self.sync!r} (its step time, memory and optimizer update are priced with it). Fix: run the plan's "
      f"sync (leave --sync out), or plan again for {requested!r} (`qsync plan --sync {requested}`)."
    )

  def policy_for(self, group: str) -> PrecisionPolicy:
    """The group's policy; an empty policy (unmodified float model) when the plan has none."""
    return self.policies.get(group, PrecisionPolicy())

  def policy_on(self, group: DeviceGroup) -> PrecisionPolicy:
    """The policy ``group``'s devices run: ``policy_for(group.name)`` without the
    ``where_supported`` rules its device type cannot run (``PrecisionPolicy.for_device``) — what
    the trainer compiles for the group and what the planners cost."""
    return self.policy_for(group.name).for_device(group.device_type)

  def validate_for(self, cluster: ClusterSpec) -> None:
    """Raises ``PlanError`` if the plan names unknown groups or a group's device can't run its policy."""
    names = set(cluster.group_names)
    for field in ("policies", "batch_per_device", "micro_steps"):
      unknown = sorted(set(getattr(self, field)) - names)
      if unknown:
        raise PlanError(
          f"plan: {field} names group(s) {unknown} that cluster {cluster.name!r} does not have. "
          f"Fix: use the cluster's group names {list(cluster.group_names)}."
        )
    for group in cluster.groups:
      try:
        self.policy_for(group.name).validate_for_device(group.device_type)
      except (UnsupportedPrecisionError, PolicyError) as e:
        raise PlanError(f"plan: group {group.name!r} ({group.device_type}): {e}") from None
      b, k = self.batch_per_device.get(group.name, group.batch_per_device), self.micro_steps_of(group.name)
      if b % k:
        raise PlanError(
          f"plan: group {group.name!r} splits its per-device batch {b} into micro_steps={k} "
          f"micro-batches, but {k} does not divide {b}. Fix: make micro_steps[{group.name!r}] a "
          f"divisor of {b}, or the batch a multiple of {k}."
        )
    total = sum(g.count * self.batch_per_device.get(g.name, g.batch_per_device) for g in cluster.groups)
    if total != cluster.global_batch:
      raise PlanError(
        f"plan: its per-device batches add up to a global batch of {total} (count × batch_per_device over "
        f"the groups), but cluster {cluster.name!r} trains on {cluster.global_batch} examples a step. Fix: "
        f"make the plan's batch_per_device add up to {cluster.global_batch} (plan again with `qsync plan`), or "
        "change the cluster spec's batch_per_device to the global batch you mean."
      )

  def apply_to(self, cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with this plan's per-device batch overrides applied (after validation)."""
    self.validate_for(cluster)
    return cluster.with_batch_per_device(self.batch_per_device)

  def place(self, cluster: ClusterSpec, devices: Sequence[Any]) -> tuple[ClusterSpec, list[Any]]:
    """``(apply_to(cluster), the devices that run it)``: ``devices`` are the whole spec's, in
    order (``ClusterSpecError`` if their number differs); a group with batch 0 leaves its own out."""
    assign_devices(cluster, devices)
    kept = self.apply_to(cluster)
    return kept, cluster.devices_of(kept, devices)

  @property
  def needs_fp16_loss_scaling(self) -> bool:
    """True when any group's policy runs some leg in fp16 (the trainer then scales the loss)."""
    return any(_has_fp16(p) for p in self.policies.values())

  def runs_fp16(self, group: str) -> bool:
    """True when the group's policy runs some leg in fp16."""
    return _has_fp16(self.policy_for(group))

  def fingerprint(self) -> str:
    """Hash of what changes training (policies, batches, micro-steps other than 1, reduction, a
    sync other than fp32);
    predictions and ``optimizer_update`` excluded (the sharded update equals the replicated one)."""
    obj = {
      "policies": self.to_json()["policies"],
      "batch_per_device": dict(sorted(self.batch_per_device.items())),
    }
    accumulating = {g: k for g, k in sorted(self.micro_steps.items()) if k != 1}
    if accumulating:  # (absent when none accumulates: plans without micro-steps keep their hash)
      obj["micro_steps"] = accumulating
    if self.reduction != REDUCTIONS[0]:  # (where the optimizer runs does not change the training)
      obj["reduction"] = self.reduction
    if self.sync not in (None, "fp32"):  # (absent or fp32: the default reduction keeps the hash)
      obj["sync"] = self.sync
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]

  # -- construction ---------------------------------------------------------------------
  @classmethod
  def uniform(cls, cluster: ClusterSpec, policy: PrecisionPolicy | str) -> Plan:
    """Every group of ``cluster`` runs ``policy`` (a PrecisionPolicy or preset name)."""
    if isinstance(policy, str):
      policy = PrecisionPolicy.uniform(policy)
    return cls(policies={g: policy for g in cluster.group_names})

  # -- JSON -----------------------------------------------------------------------------
  def to_json(self) -> dict[str, Any]:
    return {
      "policies": {g: p.to_json() for g, p in sorted(self.policies.items())},
      "batch_per_device": dict(self.batch_per_device),
      "micro_steps": dict(self.micro_steps),
      "reduction": self.reduction,
      "optimizer_update": self.optimizer_update,
      **({} if self.sync is None else {"sync": self.sync}),
      "predictions": dict(self.predictions),
    }

  @classmethod
  def from_json(cls, obj: Any) -> Plan:
    if not isinstance(obj, Mapping):
      raise PlanError(
        f"a plan must be a JSON object, got {type(obj).__name__}. "
        'Fix: write {"policies": {"<group>": {...}}, "batch_per_device": {}, "predictions": {}}.'
      )
    keys = (
      "policies",
      "batch_per_device",
      "micro_steps",
      "reduction",
      "optimizer_update",
      "sync",
      "predictions",
    )
    reject_unknown_keys(obj, keys, "plan", PlanError, ", ".join(repr(k) for k in keys))
    for key in ("policies", "batch_per_device", "micro_steps", "predictions"):
      if not isinstance(obj.get(key, {}), Mapping):
        raise PlanError(
          f"plan: {key!r} must be an object keyed by group name, got {type(obj[key]).__name__}. "
          f'Fix: write "{key}": {{"<group>": ...}}.'
        )
    policies = {}
    for group, p in obj.get("policies", {}).items():
      try:
        policies[group] = PrecisionPolicy.uniform(p) if isinstance(p, str) else PrecisionPolicy.from_json(p)
      except PolicyError as e:
        raise PlanError(f"plan: policy of group {group!r}: {e}") from None
    return cls(
      policies=policies,
      batch_per_device=dict(obj.get("batch_per_device", {})),
      micro_steps=dict(obj.get("micro_steps", {})),
      predictions=dict(obj.get("predictions", {})),
      reduction=obj.get("reduction", REDUCTIONS[0]),
      optimizer_update=obj.get("optimizer_update", OPTIMIZER_UPDATES[0]),
      sync=obj.get("sync"),
    )


def _has_fp16(policy: PrecisionPolicy) -> bool:
  ops: list[OpPolicy] = [r.policy for r in policy.rules] + ([policy.default] if policy.default else [])
  return any("fp16" in op.precisions for op in ops)
