"""Hand-built profiles and indicator tables for planner tests (no measuring)."""

from __future__ import annotations

from planners.ops import OpShape
from planners.profile import CAST_TYPES, CastModel, Profile

SPEED = {"fp32": 1.0, "tf32": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.3, "fp8": 0.3}
"""Default cost of a leg at each precision relative to fp32."""


def fake_profile(
  leg_ms,
  rhs_elems=1000,
  device_type="cpu",
  batch=8,
  speed=None,
  remainder_ms=0.0,
  optimizer_ms=0.0,
  cast_a=0.0,
  other_bytes=0,
  extra_param_bytes=0,
  lhs_elems=1000,
  model="fake",
) -> Profile:
  """One dense op per entry of ``leg_ms`` = ``[(fwd, dlhs, drhs) ms at fp32], …``."""
  speed = speed or SPEED
  ops, op_ms = [], {}
  for i, (fwd, dlhs, drhs) in enumerate(leg_ms):
    name = f"Dense_{i}:dense"
    ops.append(OpShape(name, "dense", 1, batch, 10, 100, 1, lhs_elems, rhs_elems, batch * 100))
    base = {"fwd": fwd, "dlhs": dlhs, "drhs": drhs}
    op_ms[name] = {leg: {p: t * s for p, s in speed.items()} for leg, t in base.items()}
  param_bytes = 4 * rhs_elems * len(ops) + extra_param_bytes
  return Profile(
    model=model,
    device_type=device_type,
    source="measured",
    batch_per_device=batch,
    ops=tuple(ops),
    op_ms=op_ms,
    remainder_ms={"fwd": remainder_ms / 3, "bwd": 2 * remainder_ms / 3},
    optimizer_ms=optimizer_ms,
    cast={c: CastModel(cast_a, 0.0, 0.0) for c in CAST_TYPES},
    memory={
      "param_bytes": param_bytes,
      "opt_state_bytes": 2 * param_bytes,
      "batch_bytes": 0,
      "other_bytes": other_bytes,
    },
  )


def fake_indicator(op_names, sensitivities):
  """Ω: op i at int8 = s_i, fp16 / bf16 = s_i / 10, fp8 = s_i / 2, fp32 = 0."""
  return {
    "omega": {
      n: {"int8": s, "fp8": s / 2, "fp16": s / 10, "bf16": s / 10, "fp32": 0.0}
      for n, s in zip(op_names, sensitivities)
    }
  }
