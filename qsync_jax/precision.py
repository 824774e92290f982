"""Precision vocabulary: precisions, roundings, op policies, device capabilities.

An *op policy* says at which precision each of the three GEMMs of an op's training step
runs: ``fwd`` (Y = X·W), ``dlhs`` (dX = dY·Wᵀ) and ``drhs`` (dW = Xᵀ·dY), how values are
rounded when quantized, and whether int8/fp8 scales are per tensor or per channel.

Examples:
  >>> OpPolicy.preset("int8_fwd")      # QSync's int8 op: int8 forward, fp16 backward
  OpPolicy(fwd='int8', dlhs='fp16', drhs='fp16', rounding='nearest', grad_rounding='nearest', granularity='per_channel')
  >>> OpPolicy.preset("int8").grad_rounding
  'stochastic'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qsync_jax.errors import PolicyError
from qsync_jax.jsonio import reject_unknown_keys

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "int8", "fp8")
"""Every precision a GEMM leg may run at, from most to least precise (roughly)."""

FLOAT_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
FP32_LIKE = ("fp32", "tf32")
"""The precisions that keep fp32 storage (tf32 rounds only inside the product)."""
QUANTIZED_PRECISIONS = ("int8", "fp8")
ROUNDINGS = ("nearest", "stochastic")
GRANULARITIES = ("per_tensor", "per_channel")
LEGS = ("fwd", "dlhs", "drhs")

# Precision "ladder" used by the allocator: lower index = faster / less precise.
# fp8 and int8 share a level (both 8-bit), tf32 sits between the 16-bit types and fp32.
PRECISION_BITS = {"int8": 8, "fp8": 8, "fp16": 16, "bf16": 16, "tf32": 19, "fp32": 32}

def _check_choice(what: str, value: Any, choices: tuple[str, ...], context: str) -> None:
  if not isinstance(value, str) or value not in choices:
    raise PolicyError(
      f"{context}: {what}={value!r} is not one of {list(choices)}. "
      f"Fix: set {what} to one of {', '.join(choices)}."
    )


@dataclasses.dataclass(frozen=True)
class OpPolicy:
  """Precision of each GEMM of one op's training step.

  Attributes (``fwd``, ``dlhs`` and ``drhs`` are required, as in the JSON form):
    fwd: precision of the forward product Y = X·W.
    dlhs: precision of the product that gives the gradient to the activation, dY·Wᵀ.
    drhs: precision of the product that gives the gradient to the weight, Xᵀ·dY.
    rounding: rounding of forward operands (X, W) when quantized to int8 / fp8.
    grad_rounding: rounding of the gradient dY when quantized to int8 / fp8 (stochastic
      rounding is unbiased and needs a PRNG key).
    granularity: int8 / fp8 scale per tensor, or per channel (one scale per row of the
      left operand and per column of the right operand, reduced over the contraction).
  """

  fwd: str | None = None
  dlhs: str | None = None
  drhs: str | None = None
  rounding: str = "nearest"
  grad_rounding: str = "nearest"
  granularity: str = "per_channel"

  def __post_init__(self):
    missing = [leg for leg in LEGS if getattr(self, leg) is None]
    if missing:
      raise PolicyError(
        f"OpPolicy: missing leg(s) {missing}. Fix: give a precision for each of fwd, dlhs, drhs "
        f"(one of {list(PRECISIONS)}), e.g. OpPolicy(fwd='int8', dlhs='fp32', drhs='fp32'), or use "
        "OpPolicy.uniform(precision) / OpPolicy.preset(name)."
      )
    for leg in LEGS:
      _check_choice(leg, getattr(self, leg), PRECISIONS, "OpPolicy")
    _check_choice("rounding", self.rounding, ROUNDINGS, "OpPolicy")
    _check_choice("grad_rounding", self.grad_rounding, ROUNDINGS, "OpPolicy")
    _check_choice("granularity", self.granularity, GRANULARITIES, "OpPolicy")

  @property
  def precisions(self) -> tuple[str, str, str]:
    return (self.fwd, self.dlhs, self.drhs)

  @property
  def needs_rng(self) -> bool:
    """True when any quantization of this op rounds stochastically."""
    quantized = [p in QUANTIZED_PRECISIONS for p in self.precisions]
    return (self.rounding == "stochastic" and any(quantized)) or (
      self.grad_rounding == "stochastic" and any(quantized[1:])
    )

  @property
  def forward_needs_rng(self) -> bool:
    """True when the forward product rounds its operands stochastically (its gradient legs alone
    may need a key otherwise: ``needs_rng``)."""
    return self.rounding == "stochastic" and self.fwd in QUANTIZED_PRECISIONS

  @property
  def is_fp32(self) -> bool:
    return self.precisions == ("fp32", "fp32", "fp32")

  def replace(self, **changes) -> OpPolicy:
    return dataclasses.replace(self, **changes)

  def to_json(self) -> dict[str, str]:
    return dataclasses.asdict(self)

  @classmethod
  def uniform(cls, precision: str, **kwargs) -> OpPolicy:
    """All three legs at ``precision``."""
    return cls(fwd=precision, dlhs=precision, drhs=precision, **kwargs)

  @classmethod
  def preset(cls, name: str) -> OpPolicy:
    """A named op policy; see ``PRESETS``."""
    if name not in PRESETS:
      raise PolicyError(
        f"op policy preset {name!r} is unknown. Fix: use one of {sorted(PRESETS)} "
        "or give an object with keys fwd, dlhs, drhs."
      )
    return PRESETS[name]

  @classmethod
  def from_json(cls, obj: Any, context: str = "op policy") -> OpPolicy:
    """Parses a preset name or a mapping with ``fwd``, ``dlhs``, ``drhs`` (+ optional keys)."""
    if isinstance(obj, str):
      if obj not in PRESETS:
        raise PolicyError(
          f"{context}: preset {obj!r} is unknown. Fix: use one of {sorted(PRESETS)} "
          "or an object with keys fwd, dlhs, drhs."
        )
      return PRESETS[obj]
    if not isinstance(obj, Mapping):
      raise PolicyError(
        f"{context}: expected a preset name or an object, got {type(obj).__name__} "
        f'{obj!r}. Fix: write e.g. {{"fwd": "int8", "dlhs": "fp16", "drhs": "fp16"}}.'
      )
    fields = {f.name for f in dataclasses.fields(cls)}
    reject_unknown_keys(obj, fields, context, PolicyError)
    missing = [leg for leg in LEGS if leg not in obj]
    if missing:
      raise PolicyError(
        f"{context}: missing leg(s) {missing}. Fix: give a precision for each of "
        f"fwd, dlhs, drhs (one of {list(PRECISIONS)})."
      )
    try:
      return cls(**obj)
    except PolicyError as e:
      raise PolicyError(f"{context}: {e}") from None


PRESETS: dict[str, OpPolicy] = {
  "fp32": OpPolicy.uniform("fp32"),
  "tf32": OpPolicy.uniform("tf32"),
  "bf16": OpPolicy.uniform("bf16"),
  "fp16": OpPolicy.uniform("fp16"),
  # Full int8 training: stochastic rounding on gradients keeps them unbiased.
  "int8": OpPolicy.uniform("int8", grad_rounding="stochastic"),
  # QSync's int8 operator: int8 forward, fp16 backward.
  "int8_fwd": OpPolicy(fwd="int8", dlhs="fp16", drhs="fp16"),
  "fp8": OpPolicy.uniform("fp8"),
}
