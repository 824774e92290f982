"""Cluster spec: the device groups one synchronous data-parallel job trains on.

A *device group* is a set of identical devices (same type, memory, per-device batch and
links). A *cluster spec* is an ordered tuple of groups; device ``i`` of the job belongs to the
group whose range of ``count`` devices covers ``i`` (groups take devices in order).

JSON form (YAML too, when PyYAML is installed and the file ends in ``.yaml``/``.yml``)::

  {"name": "hybrid",
   "groups": [{"name": "train", "device_type": "A100", "count": 4, "memory_gb": 40,
               "batch_per_device": 32, "link_gbps": 100, "intra_link_gbps": 2400},
              {"name": "infer", "device_type": "T4", "count": 4, "memory_gb": 16,
               "batch_per_device": 32, "link_gbps": 32}]}

``link_gbps`` is each device's link to the devices of other groups (the NIC); ``intra_link_gbps``
the bandwidth between two devices of the same group (NVLink, PCIe), the same as ``link_gbps``
where not given. Both in Gbit/s (2400 is NVLink's 300 GB/s).

On the CPU the simulated devices stand in for the modelled types: ``assign_devices`` maps
whatever devices the job has onto the groups by position.

Examples:
  >>> spec = ClusterSpec.from_json({"groups": [
  ...   {"name": "a", "device_type": "A100", "count": 2, "memory_gb": 40, "batch_per_device": 6},
  ...   {"name": "t", "device_type": "T4", "count": 2, "memory_gb": 16, "batch_per_device": 2}]})
  >>> spec.global_batch, spec.batch_shares()
  (16, {'a': 0.75, 't': 0.25})
  >>> spec.device_group_indices()
  (0, 0, 1, 1)
  >>> nvlink = DeviceGroup("a", "A100", 2, 40, 6, link_gbps=100, intra_link_gbps=2400)
  >>> nvlink.intra_group_gbps, spec.groups[0].intra_group_gbps
  (2400.0, 100.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from qsync_jax.devices import DEVICES
from qsync_jax.errors import ClusterSpecError
from qsync_jax.jsonio import JsonFile, reject_unknown_keys, write_text_atomic

DEFAULT_LINK_GBPS = 100.0
"""Link bandwidth (Gbit/s, as NICs are quoted) assumed when a group gives none."""


def _positive_int(where: str, field: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ClusterSpecError(
      f"{where}: {field}={value!r} must be a positive integer. Fix: set {field} to 1 or more."
    )
  return value


def _positive_number(where: str, field: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise ClusterSpecError(
      f"{where}: {field}={value!r} must be a positive finite number. Fix: give it in "
      f"{'GB' if field == 'memory_gb' else 'Gbit/s'}, e.g. {16 if field == 'memory_gb' else 100}."
    )
  return float(value)


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
  """``count`` identical devices of type ``device_type``.

  Attributes:
    name: unique name of the group (plans key their policies by it).
    device_type: a key of ``qsync_jax.devices.DEVICES`` (e.g. "A100", "T4", "cpu").
    count: number of devices in the group.
    memory_gb: memory per device, in GB.
    batch_per_device: examples each device of the group processes per step.
    link_gbps: bandwidth of each device's link to the devices of other groups, in Gbit/s.
    intra_link_gbps: bandwidth between two devices of the group (NVLink, PCIe), in Gbit/s;
      None: the same as ``link_gbps`` (``intra_group_gbps``).
  """

  name: str
  device_type: str
  count: int
  memory_gb: float
  batch_per_device: int
  link_gbps: float = DEFAULT_LINK_GBPS
  intra_link_gbps: float | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ClusterSpecError(
        f"device group name {self.name!r} must be a non-empty string. Fix: name it, e.g. 'train'."
      )
    where = f"device group {self.name!r}"
    if self.device_type not in DEVICES:
      raise ClusterSpecError(
        f"{where}: device_type={self.device_type!r} is unknown. Fix: use one of {sorted(DEVICES)}."
      )
    _positive_int(where, "count", self.count)
    _positive_int(where, "batch_per_device", self.batch_per_device)
    object.__setattr__(self, "memory_gb", _positive_number(where, "memory_gb", self.memory_gb))
    object.__setattr__(self, "link_gbps", _positive_number(where, "link_gbps", self.link_gbps))
    if self.intra_link_gbps is not None:
      intra = _positive_number(where, "intra_link_gbps", self.intra_link_gbps)
      object.__setattr__(self, "intra_link_gbps", intra)

  @property
  def batch(self) -> int:
    """Examples the whole group processes per step."""
    return self.count * self.batch_per_device

  @property
  def intra_group_gbps(self) -> float:
    """Bandwidth between two devices of the group, Gbit/s: ``intra_link_gbps``, else ``link_gbps``."""
    return self.link_gbps if self.intra_link_gbps is None else self.intra_link_gbps

  def replace(self, **changes) -> DeviceGroup:
    return dataclasses.replace(self, **changes)

  def to_json(self) -> dict[str, Any]:
    """The group's fields; ``intra_link_gbps`` only where given."""
    out = dataclasses.asdict(self)
    if self.intra_link_gbps is None:
      del out["intra_link_gbps"]
    return out


_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceGroup))
_REQUIRED_GROUP_FIELDS = ("name", "device_type", "count", "memory_gb", "batch_per_device")


@dataclasses.dataclass(frozen=True)
class ClusterSpec(JsonFile):
  """Ordered device groups of one job. Device ``i`` belongs to ``device_group_indices()[i]``."""

  JSON_WHAT = "cluster spec"
  JSON_ERROR = ClusterSpecError

  groups: tuple[DeviceGroup, ...]
  name: str = "cluster"

  def __post_init__(self):
    object.__setattr__(self, "groups", tuple(self.groups))
    if not self.groups:
      raise ClusterSpecError(
        "cluster spec has no device groups. Fix: list at least one group under 'groups'."
      )
    seen = set()
    for i, g in enumerate(self.groups):
      if not isinstance(g, DeviceGroup):
        raise ClusterSpecError(
          f"groups[{i}] is a {type(g).__name__}, not a DeviceGroup. Fix: use DeviceGroup(...)."
        )
      if g.name in seen:
        raise ClusterSpecError(
          f"groups[{i}]: name {g.name!r} is used by more than one group. Fix: give each group a unique name."
        )
      seen.add(g.name)

  # -- sizes ----------------------------------------------------------------------------
  @property
  def num_devices(self) -> int:
    return sum(g.count for g in self.groups)

  @property
  def global_batch(self) -> int:
    """Examples per synchronous step, over all devices."""
    return sum(g.batch for g in self.groups)

  @property
  def group_names(self) -> tuple[str, ...]:
    return tuple(g.name for g in self.groups)

  @property
  def max_batch_per_device(self) -> int:
    return max(g.batch_per_device for g in self.groups)

  def group(self, name: str) -> DeviceGroup:
    for g in self.groups:
      if g.name == name:
        return g
    raise ClusterSpecError(f"no device group named {name!r}. Fix: use one of {list(self.group_names)}.")

  def group_index(self, name: str) -> int:
    return self.group_names.index(self.group(name).name)

  def batch_shares(self) -> dict[str, float]:
    """Each group's share of the global batch (the shares sum to 1)."""
    total = self.global_batch
    return {g.name: g.batch / total for g in self.groups}

  def device_group_indices(self) -> tuple[int, ...]:
    """Group index of each device of the job, in device order."""
    return tuple(i for i, g in enumerate(self.groups) for _ in range(g.count))

  def device_batch_sizes(self) -> tuple[int, ...]:
    """Per-device batch of each device of the job, in device order."""
    return tuple(self.groups[i].batch_per_device for i in self.device_group_indices())

  def with_batch_per_device(self, batches: Mapping[str, int]) -> ClusterSpec:
    """A copy with some groups' per-device batch replaced; a batch of 0 leaves the group out
    (its devices sit the job out)."""
    for name in batches:
      self.group(name)
    kept = tuple(
      g.replace(batch_per_device=batches.get(g.name, g.batch_per_device))
      for g in self.groups
      if batches.get(g.name) != 0
    )
    if not kept:
      raise ClusterSpecError(
        f"every group of cluster {self.name!r} has batch 0. Fix: give at least one group a positive batch."
      )
    return dataclasses.replace(self, groups=kept)

  def devices_of(self, kept: ClusterSpec, devices: Sequence[Any]) -> list[Any]:
    """The devices of ``kept``'s groups among ``devices`` (this spec's devices, in order): a
    group left out by ``with_batch_per_device`` leaves its devices out."""
    names = set(kept.group_names)
    return [d for d, gi in zip(devices, self.device_group_indices()) if self.groups[gi].name in names]

  # -- JSON / YAML ----------------------------------------------------------------------
  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "groups": [g.to_json() for g in self.groups]}

  def save(self, path: str) -> None:
    """JSON, or YAML where ``path`` ends in ``.yaml`` / ``.yml``; written atomically."""
    if str(path).endswith((".yaml", ".yml")):
      text = _yaml(path).safe_dump(self.to_json(), sort_keys=False)
      write_text_atomic(path, text, self.JSON_WHAT, self.JSON_ERROR)
    else:
      super().save(path)

  @classmethod
  def parse(cls, text: str, source: str) -> Any:
    """JSON, or YAML where ``source`` ends in ``.yaml`` / ``.yml``."""
    if not source.endswith((".yaml", ".yml")):
      return super().parse(text, source)
    yaml = _yaml(source)
    try:
      return yaml.load(text, Loader=_unique_key_loader(yaml))
    except _DuplicateYamlKey as e:
      raise ClusterSpecError(
        f"{source} gives key {e.key!r} twice in one mapping (line {e.line}); YAML readers keep one of "
        "the two silently. Fix: keep the one you mean and delete the other."
      ) from None
    except yaml.YAMLError as e:
      raise ClusterSpecError(f"{source} is not valid YAML ({e}). Fix: correct the YAML syntax.") from None

  @classmethod
  def from_json(cls, obj: Any) -> ClusterSpec:
    if not isinstance(obj, Mapping):
      raise ClusterSpecError(
        f"a cluster spec must be an object, got {type(obj).__name__}. "
        'Fix: write {"name": "...", "groups": [{"name": ..., "device_type": ..., ...}]}.'
      )
    reject_unknown_keys(obj, ("name", "groups"), "cluster spec", ClusterSpecError, "'name' and 'groups'")
    groups = obj.get("groups")
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
      raise ClusterSpecError(
        f"cluster spec: 'groups' must be a list, got {type(groups).__name__}. "
        "Fix: list the device groups under 'groups'."
      )
    name = obj.get("name", "cluster")
    if not isinstance(name, str):
      raise ClusterSpecError(f"cluster spec: name={name!r} must be a string. Fix: quote it.")
    return cls(groups=tuple(_group_from_json(i, g) for i, g in enumerate(groups)), name=name)

  @classmethod
  def uniform(
    cls, device_type: str, count: int, batch_per_device: int, memory_gb: float = 16.0, name: str = "all"
  ) -> ClusterSpec:
    """One group of ``count`` identical devices."""
    return cls(groups=(DeviceGroup(name, device_type, count, memory_gb, batch_per_device),))


def _group_from_json(i: int, obj: Any) -> DeviceGroup:
  where = f"groups[{i}]"
  if not isinstance(obj, Mapping):
    raise ClusterSpecError(
      f"{where} must be an object, got {type(obj).__name__}. Fix: write "
      '{"name": "infer", "device_type": "T4", "count": 4, "memory_gb": 16, "batch_per_device": 32}.'
    )
  reject_unknown_keys(obj, _GROUP_FIELDS, where, ClusterSpecError, str(list(_GROUP_FIELDS)))
  missing = [k for k in _REQUIRED_GROUP_FIELDS if k not in obj]
  if missing:
    raise ClusterSpecError(
      f"{where}: missing key(s) {missing}. Fix: every group needs {list(_REQUIRED_GROUP_FIELDS)}."
    )
  try:
    return DeviceGroup(**obj)
  except ClusterSpecError as e:
    raise ClusterSpecError(f"{where}: {e}") from None


class _DuplicateYamlKey(Exception):
  def __init__(self, key: Any, line: int):
    super().__init__(key)
    self.key, self.line = key, line


def _unique_key_loader(yaml):
  """``yaml.SafeLoader`` that raises ``_DuplicateYamlKey`` for a key given twice in one mapping
  (``safe_load`` keeps the last silently). Keys a merge (``<<: *anchor``) brings in may be
  overridden, as YAML defines."""

  class UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
      seen = set()
      for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
          continue
        key = self.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
          continue  # SafeLoader refuses it next, naming the line
        if key in seen:
          raise _DuplicateYamlKey(key, key_node.start_mark.line + 1)
        seen.add(key)
      return super().construct_mapping(node, deep=deep)

  return UniqueKeyLoader


def _yaml(source: str):
  try:
    import yaml
  except ImportError:
    raise ClusterSpecError(
      f"{source}: YAML needs PyYAML, which is not installed. Fix: `pip install pyyaml` or use JSON."
    ) from None
  return yaml


def assign_devices(spec: ClusterSpec, devices: Sequence[Any]) -> tuple[int, ...]:
  """Group index of each of ``devices`` (in order): the first ``count`` go to group 0, etc.

  Real devices stand in for the modelled types (e.g. 8 simulated CPU devices for 4 A100 + 4 T4).
  Raises ``ClusterSpecError`` if the number of devices differs from the spec's.
  """
  if len(devices) != spec.num_devices:
    counts = ", ".join(f"{g.name}={g.count}" for g in spec.groups)
    raise ClusterSpecError(
      f"cluster spec {spec.name!r} has {spec.num_devices} devices ({counts}) but the job has "
      f"{len(devices)}. Fix: change the group counts to sum to {len(devices)}, or run on "
      f"{spec.num_devices} devices (on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count="
      f"{spec.num_devices})."
    )
  return spec.device_group_indices()
