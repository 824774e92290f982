"""Profiles of devices not at hand, modeled from the device catalog.

``modeled_profile(base, device_type)`` costs the ops of a measured or traced profile on a
catalog device by the roofline (``planners.catalog``): every leg at every precision the device
runs as ``max(flops / peak, bytes / bandwidth)`` (derated) plus one launch, with the
conversions of its two fp32 operands for a non-fp32 leg (``modeled_cast``); the remainder as
``ELEMENTWISE_PASSES`` fp32 passes over every op output; the optimizer as Adam's reads and
writes of the parameters. Memory is the base profile's. The profile is labelled ``"modeled"``.
"""

from __future__ import annotations

import dataclasses

from planners import catalog
from planners.profile import CAST_TYPES, CastModel, Profile, cast_precisions
from qsync_jax.precision import FP32_LIKE, LEGS, QUANTIZED_PRECISIONS

ELEMENTWISE_PASSES = 12
"""Modeled remainder: fp32 passes over every op output per step (≈ 4 forward, 8 backward)."""


def modeled_cast(spec: catalog.DeviceSpec, cast_type: str) -> CastModel:
  """Roofline cast model: bytes read + written over bandwidth (a quantization reads its input
  twice: absmax, then scale and round), plus one launch."""
  src, dst = cast_precisions(cast_type)
  nbytes = (
    catalog.BYTES[src] + catalog.BYTES[dst] + (catalog.BYTES[src] if dst in QUANTIZED_PRECISIONS else 0)
  )
  return CastModel(
    nbytes / (spec.mem_bw_gbps * 1e9 * spec.derate) * 1e3, spec.launch_us * 1e-3, 0.0, "modeled"
  )


def modeled_profile(base: Profile, device_type: str) -> Profile:
  """The profile of ``base``'s model on ``device_type``; see the module docstring."""
  spec = catalog.device_spec(device_type)
  casts = {c: modeled_cast(spec, c) for c in CAST_TYPES}
  op_ms = {}
  for op in base.ops:
    table = {}
    for leg in LEGS:
      m, k, n = {"fwd": (op.m, op.k, op.n), "dlhs": (op.m, op.n, op.k), "drhs": (op.k, op.m, op.n)}[leg]
      row = {}
      for p in spec.peak_tflops:
        t = catalog.gemm_roofline_ms(spec, p, m, k, n, op.batch)
        if p not in FP32_LIKE:  # the leg converts its two fp32 operands
          t += casts[f"fp32->{p}"].ms(op.batch * m * k) + casts[f"fp32->{p}"].ms(op.batch * k * n)
        row[p] = t
      table[leg] = row
    op_ms[op.name] = table
  bandwidth = spec.mem_bw_gbps * 1e9 * spec.derate
  rest = ELEMENTWISE_PASSES * sum(4 * o.out_elems * o.calls for o in base.ops) / bandwidth * 1e3
  opt_bytes = 7 * base.memory["param_bytes"]  # adam reads p, g, m, v and writes p, m, v
  return Profile(
    model=base.model,
    device_type=device_type,
    source="modeled",
    batch_per_device=base.batch_per_device,
    ops=base.ops,
    op_ms=op_ms,
    remainder_ms={},
    optimizer_ms=opt_bytes / bandwidth * 1e3 + spec.launch_us * 1e-3,
    cast=casts,
    memory=dict(base.memory),
    meta={"derived_from": base.device_type, "catalog": dataclasses.asdict(spec)},
  ).with_remainder(rest)
