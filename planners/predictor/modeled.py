"""Profiles of devices not at hand, modeled from the device catalog (``docs/catalog.md``).

``modeled_profile(base, device_type)`` costs the ops of a measured or traced profile on a catalog
device: every leg at every precision the device runs by the roofline (``leg_ms``); the remainder
as ``ELEMENTWISE_PASSES`` fp32 passes over every op output; the optimizer as Adam's reads and
writes of the parameters. Memory is the base profile's. The profile is labelled ``"modeled"``.
"""

from __future__ import annotations

import dataclasses

from planners import catalog
from planners.ops import OpShape
from planners.profile import CAST_TYPES, CastModel, Profile, cast_precisions
from qsync_jax.devices import DeviceType, device
from qsync_jax.precision import FP32_LIKE, LEGS, QUANTIZED_PRECISIONS

# Each leg's two operands and its result, as the forward's tensors (dX = dY·Wᵀ, dW = Xᵀ·dY).
LEG_TENSORS = {"fwd": ("lhs", "rhs", "out"), "dlhs": ("out", "rhs", "lhs"), "drhs": ("lhs", "out", "rhs")}
# Remainder passes over every op output per step (≈ 4 forward, 8 backward), fp32 under every plan:
# activations between ops stay fp32 (an op converts its own operands).
ELEMENTWISE_PASSES = 12


def modeled_cast(spec: DeviceType, cast_type: str) -> CastModel:
  """Roofline cast model. A conversion to a float type fuses into the kernel that produces its
  source and costs the write of the copy; a quantization reads its source twice (absmax, then
  scale and round), writes the copy, and is a kernel of its own (one launch)."""
  src, dst = cast_precisions(cast_type)
  quantize = dst in QUANTIZED_PRECISIONS
  nbytes = catalog.BYTES[dst] + 2 * catalog.BYTES[src] * quantize
  return CastModel(catalog.memory_ms(spec, nbytes), spec.launch_us * 1e-3 * quantize, 0.0, "modeled")


def leg_ms(spec: DeviceType, op: OpShape, leg: str, precision: str) -> float:
  """Modeled ms of one call of ``op``'s ``leg`` at ``precision``: the roofline of its product over
  the tensors it moves, plus, off fp32, half the conversion of each operand (each tensor feeds two
  of the op's legs, which share its converted copy). An embedding lookup is a gather and its table
  gradient a scatter-add: the bytes they move."""
  if op.kind == "embed":  # fwd: rows read, output written; drhs: table zeroed, dY read, rows updated
    nbytes = {"fwd": 8 * op.out_elems, "dlhs": 0, "drhs": 4 * (op.rhs_elems + 3 * op.out_elems)}[leg]
    return catalog.memory_ms(spec, nbytes) + spec.launch_us * 1e-3 * (nbytes > 0)
  m, k, n = {"fwd": (op.m, op.k, op.n), "dlhs": (op.m, op.n, op.k), "drhs": (op.k, op.m, op.n)}[leg]
  sizes = {"lhs": op.lhs_elems, "rhs": op.rhs_elems, "out": op.out_elems}
  a, b, out = (sizes[t] for t in LEG_TENSORS[leg])
  ms = catalog.gemm_roofline_ms(spec, precision, m, k, n, op.batch, (a, b, out), op.kind == "conv")
  if precision not in FP32_LIKE:
    cast = modeled_cast(spec, f"fp32->{precision}")
    ms += (cast.ms(a) + cast.ms(b)) / 2
  return ms


def modeled_profile(base: Profile, device_type: str) -> Profile:
  """The profile of ``base``'s model on ``device_type``; see the module docstring."""
  spec = device(device_type)
  op_ms = {
    op.name: {
      leg: {
        p: leg_ms(spec, op, leg, p) for p in spec.peak_tflops if op.runs_8bit or p not in QUANTIZED_PRECISIONS
      }
      for leg in LEGS
    }
    for op in base.ops
  }
  rest = ELEMENTWISE_PASSES * catalog.memory_ms(spec, sum(4 * o.out_elems * o.calls for o in base.ops))
  opt_bytes = 7 * base.memory["param_bytes"]  # adam reads p, g, m, v and writes p, m, v
  return dataclasses.replace(
    base,
    device_type=device_type,
    source="modeled",
    op_ms=op_ms,
    optimizer_ms=catalog.memory_ms(spec, opt_bytes) + spec.launch_us * 1e-3,
    cast={c: modeled_cast(spec, c) for c in CAST_TYPES},
    memory=dict(base.memory),
    meta={"derived_from": base.device_type, "catalog": dataclasses.asdict(spec)},
    forward_headroom={},
    quantized_in_step_ms={},
  ).with_remainder(rest)
