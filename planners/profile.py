"""The cost profile of one model's training step on one device type: plain data and its JSON.

A ``Profile`` is what ``qsync profile`` writes and ``qsync predict|plan`` read: the model's
quantizable ops (``planners.ops.OpShape``), each op's standalone leg and whole-policy times
(``op_ms``), the fitted remainder of the step, the optimizer, cast models, memory, each op's
forward headroom and in-step times, and ``meta`` (versions, clocks, the fit step and XLA peaks).
``docs/predictor.md`` describes every field and which are measured, fitted or modeled.
A profile is of a device type, or, with ``group`` set, of one device group (one calibrated to
that group's measured speed, ``planners.calibrate``): in a ``{profile_key: Profile}`` mapping a
group's own profile wins over its device type's (``planners.predictor.replay.profile_for``).
``GroupCost`` is what costs one device group of a plan: a profile, its op policies and batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from planners.ops import OpShape
from qsync_jax.errors import PlanError
from qsync_jax.jsonio import parse_json, read_text, write_text_atomic
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy

FORMAT = "qsync-profile/1"
CAST_TYPES = ("fp32->bf16", "fp32->fp16", "fp32->int8", "fp32->fp8", "int8->fp32", "fp8->fp32")
"""Conversions a profile has a cost model for: into each precision (a modeled leg's operands),
and the dequantization of a saved 8-bit residual (``planners.predictor.graph``)."""


def profile_key(device_type: str, group: str | None = None) -> str:
  """The key of a profile in a ``{key: Profile}`` mapping: its device type, or ``"group:NAME"``
  for a profile of device group ``NAME`` alone (``Profile.group``)."""
  return device_type if group is None else f"group:{group}"


def cast_precisions(cast_type: str) -> tuple[str, str]:
  """``(source, destination)`` precision of a cast type such as ``"fp32->int8"``."""
  src, dst = cast_type.split("->")
  return src, dst


@dataclasses.dataclass(frozen=True)
class CastModel:
  """``ms = a · numel + b`` for one cast type; ``rel_error`` is the RMS relative fit error."""

  a: float
  b: float
  rel_error: float
  source: str = "measured"

  def ms(self, numel: float) -> float:
    return self.a * numel + self.b


@dataclasses.dataclass(frozen=True)
class Profile:
  """Cost of one model's training step on one device type (or, with ``group``, on one device
  group of it); see the module docstring."""

  model: str
  device_type: str
  source: str  # measured | traced | modeled | calibrated (modeled, calibrated to a group's measurements)
  batch_per_device: int
  ops: tuple[OpShape, ...]
  op_ms: dict[str, dict[str, dict[str, float]]]
  remainder_ms: dict[str, float]
  optimizer_ms: float
  cast: dict[str, CastModel]
  memory: dict[str, int]
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  forward_headroom: dict[str, int] = dataclasses.field(default_factory=dict)
  quantized_in_step_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  group: str | None = None  # the device group this profile is of alone (None: every group of device_type)
  fixed_share: float = 0.0
  """The share of the step's compute at the profiled batch that does not scale with the batch
  (launches, kernels too small to fill the device): one forward and backward over ``b``
  examples costs ``fixed_share + (1 − fixed_share) · b / batch_per_device`` times the profiled
  one (``GroupCost.compute_scale``). Fitted from the fit step timed at the profiled batch and at
  half of it (``planners.profiler.fit.fit_fixed_share``); 0: compute linear in the batch."""

  @property
  def op_names(self) -> tuple[str, ...]:
    return tuple(o.name for o in self.ops)

  def policies(self, policy: PrecisionPolicy) -> dict[str, OpPolicy | None]:
    """The op policy ``policy`` gives each op of this profile, as ``quantize`` applies it: an op
    no 8-bit kernel runs (``OpShape.runs_8bit``) skips a ``where_supported`` 8-bit rule. For a
    plan's group: ``profile.policies(plan.policy_on(group))``."""
    return policy.resolve(self.op_names, [o.name for o in self.ops if not o.runs_8bit])

  @property
  def key(self) -> str:
    """This profile's ``profile_key``."""
    return profile_key(self.device_type, self.group)

  def times_scaled(self, factor: float) -> Profile:
    """This profile with every time multiplied by ``factor``: each op's leg and whole-policy
    times, their in-step times, the remainder, the optimizer update and the cast models
    (``a`` and ``b``; not their relative fit error). Shapes, memory and ``meta`` unchanged."""

    def scaled(table):
      return {k: scaled(v) for k, v in table.items()} if isinstance(table, dict) else factor * table

    return dataclasses.replace(
      self,
      op_ms=scaled(self.op_ms),
      remainder_ms=scaled(self.remainder_ms),
      optimizer_ms=factor * self.optimizer_ms,
      cast={k: dataclasses.replace(c, a=factor * c.a, b=factor * c.b) for k, c in self.cast.items()},
      quantized_in_step_ms=scaled(self.quantized_in_step_ms),
    )

  def leg_ms(self, op: str, leg: str, precision: str) -> float:
    """ms of one call of ``op``'s ``leg`` at ``precision`` (at the profiled batch)."""
    table = self.op_ms[op][leg]
    if precision not in table:
      raise PlanError(
        f"profile of {self.model!r} on {self.device_type} has no {leg} time for op {op!r} at "
        f"{precision!r} (it has {sorted(table)}). Fix: profile with --precisions including {precision}."
      )
    return table[precision]

  def with_remainder(self, rest_ms: float) -> Profile:
    """This profile with the remainder of the step set to ``rest_ms``: a third in the forward,
    two thirds in the backward."""
    return dataclasses.replace(self, remainder_ms={"fwd": rest_ms / 3, "bwd": 2 * rest_ms / 3})

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    if self.group is None:  # a device type's profile: no "group" key
      del out["group"]
    return {"format": FORMAT, **out, "ops": [o.to_json() for o in self.ops]}

  def save(self, path: str) -> None:
    """Writes the profile to ``path`` atomically (``write_text_atomic``)."""
    write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n", "profile", PlanError)

  @classmethod
  def from_json(cls, obj: Any, source: str = "<profile>") -> Profile:
    """The profile of a JSON object; keys it does not know are ignored."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
      raise PlanError(
        f'{source} is not a qsync profile (no "format": "{FORMAT}"). '
        "Fix: pass a file written by `qsync profile`."
      )
    _check_times(obj, source)
    fixed = obj.get("fixed_share", 0.0)
    if not isinstance(fixed, (int, float)) or not 0.0 <= fixed <= 1.0:
      raise PlanError(
        f"{source}: fixed_share {fixed!r} is not a share between 0 and 1. Fix: re-run `qsync profile`."
      )
    try:
      return cls(
        **{k: obj[k] for k in ("model", "device_type", "source", "op_ms", "remainder_ms", "memory")},
        batch_per_device=int(obj["batch_per_device"]),
        ops=tuple(OpShape.from_json(o) for o in obj["ops"]),
        optimizer_ms=float(obj["optimizer_ms"]),
        cast={k: CastModel(**v) for k, v in obj["cast"].items()},
        meta=dict(obj.get("meta", {})),
        forward_headroom={k: int(v) for k, v in obj.get("forward_headroom", {}).items()},
        quantized_in_step_ms={
          op: {leg: float(ms) for leg, ms in legs.items()}
          for op, legs in obj.get("quantized_in_step_ms", {}).items()
        },
        group=None if obj.get("group") is None else str(obj["group"]),
        fixed_share=float(fixed),
      )
    except (KeyError, TypeError, ValueError) as e:
      raise PlanError(f"{source}: malformed profile ({e!r}). Fix: re-run `qsync profile`.") from None

  @classmethod
  def load(cls, path: str) -> Profile:
    return cls.from_json(parse_json(read_text(path, "profile", PlanError), path, PlanError), source=path)


def _check_times(obj: Mapping[str, Any], source: str) -> None:
  """``PlanError`` naming ``source`` and the first op whose measured numbers (``op_ms``: each
  leg's and whole policy's times, its bytes; ``quantized_in_step_ms``) are not finite numbers of
  at least 0, or an ``optimizer_ms`` that is not: a time below 0 makes every prediction that
  sums it wrong. (The fitted remainder and cast models may be below 0: they are corrections.)"""

  def bad(table, path):
    if isinstance(table, Mapping):
      for key, value in table.items():
        found = bad(value, (*path, str(key)))
        if found:
          return found
      return None
    number = isinstance(table, (int, float)) and not isinstance(table, bool)
    return None if number and math.isfinite(table) and table >= 0 else (path, table)

  fix = "Fix: re-run `qsync profile` for this model and device (a file edited by hand or by a tool broke it)."
  for field in ("op_ms", "quantized_in_step_ms"):
    table = obj.get(field, {})
    found = bad(table, ()) if isinstance(table, Mapping) else None
    if found:
      (op, *where), value = found
      raise PlanError(
        f"{source}: op {op!r} has {field} {'/'.join(where)} = {value!r}, not a finite number of at least 0. {fix}"
      )
  optimizer = obj.get("optimizer_ms", 0.0)
  if bad(optimizer, ()):
    raise PlanError(f"{source}: optimizer_ms = {optimizer!r} is not a finite time of at least 0. {fix}")


@dataclasses.dataclass(frozen=True)
class GroupCost:
  """What costs one device group's share of a step: its name, its device type's profile, its op
  policies (op name → OpPolicy; None or absent: the unmodified float op), per-device batch and
  the micro-steps it runs that batch in (``Plan.micro_steps``: ``micro_batch`` examples each).

  Compute is priced at ``compute_scale`` times the profiled batch's (each micro-step pays the
  profile's batch-independent share again); memory on ``micro_batch``
  (``planners.predictor.memory_model``)."""

  name: str
  profile: Profile
  op_policies: Mapping[str, OpPolicy | None]
  batch_per_device: int
  micro_steps: int = 1

  @property
  def compute_scale(self) -> float:
    """The group's forward and backward over the profiled batch's: ``k·f + (1 − f)·b/p`` for
    ``k`` micro-steps over a per-device batch ``b``, the profile's batch ``p`` and fixed share
    ``f`` (``Profile.fixed_share``); ``b/p`` where ``f`` is 0."""
    f = self.profile.fixed_share
    return self.micro_steps * f + (1.0 - f) * self.batch_per_device / self.profile.batch_per_device

  @property
  def micro_batch(self) -> int:
    """The examples one forward/backward of the group holds: ``batch_per_device / micro_steps``."""
    return self.batch_per_device // self.micro_steps
