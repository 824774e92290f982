"""Profiles derived without timing: ``traced_profile`` — the ops and memory of a model, no
costs (its fp32 step compiled once) — and ``modeled_profile`` — a measured or traced profile's
model on a device not at hand, costed from the catalog (roofline over peak rate per precision
and bandwidth), always labelled ``"modeled"``."""

from __future__ import annotations

import dataclasses

from planners import catalog, step
from planners.casts import CAST_TYPES, modeled_cast
from planners.profiler import Profile, local_device_type, other_bytes, step_memory, task_ops, versions
from qsync_jax.precision import FP32_LIKE, LEGS


def traced_profile(task, batch_per_device: int, seed: int = 0) -> Profile:
  """A profile with the ops and memory of ``task`` but no timings (``source="traced"``):
  the base ``modeled_profile`` costs. Compiles the fp32 step once (nothing is timed)."""
  batch, variables, ops = task_ops(task, batch_per_device, seed)
  optimizer = step.default_optimizer()
  opt_state = optimizer.init(variables["params"])
  memory = {
    "param_bytes": step.tree_bytes(variables["params"]),
    "opt_state_bytes": step.tree_bytes(opt_state),
    "batch_bytes": step.tree_bytes(batch),
    "other_bytes": 0,
  }
  peak, forward = step_memory(task, batch, variables, ops, seed)
  skeleton = Profile(
    task.name,
    local_device_type(),
    "traced",
    batch_per_device,
    ops,
    {},
    {},
    0.0,
    {},
    memory,
    forward_headroom=forward.headroom,
    forward_own_bytes=forward.own,
  )
  memory["other_bytes"] = other_bytes(skeleton, peak)
  return dataclasses.replace(skeleton, meta={**versions(), "fp32_xla_peak_bytes": peak})


ELEMENTWISE_PASSES = 12
"""Modeled remainder: fp32 passes over every op output per step (≈ 4 forward, 8 backward)."""


def modeled_profile(base: Profile, device_type: str) -> Profile:
  """The profile of ``base``'s model on ``device_type`` from the catalog (roofline)."""
  spec = catalog.device_spec(device_type)
  casts = {c: modeled_cast(spec, c) for c in CAST_TYPES}
  op_ms = {}
  for op in base.ops:
    table = {}
    for leg in LEGS:
      b, m, k, n = (
        op.batch,
        *{"fwd": (op.m, op.k, op.n), "dlhs": (op.m, op.n, op.k), "drhs": (op.k, op.m, op.n)}[leg],
      )
      row = {}
      for p in spec.peak_tflops:
        t = catalog.gemm_roofline_ms(spec, p, m, k, n, b)
        if p not in FP32_LIKE:  # the leg converts its two fp32 operands
          t += casts[f"fp32->{p}"].ms(b * m * k) + casts[f"fp32->{p}"].ms(b * k * n)
        row[p] = t
      table[leg] = row
    op_ms[op.name] = table
  out_bytes = sum(4 * o.out_elems * o.calls for o in base.ops)
  rest = ELEMENTWISE_PASSES * out_bytes / (spec.mem_bw_gbps * 1e9 * spec.derate) * 1e3
  opt_bytes = 7 * base.memory["param_bytes"]  # adam reads p, g, m, v and writes p, m, v
  optimizer_ms = opt_bytes / (spec.mem_bw_gbps * 1e9 * spec.derate) * 1e3 + spec.launch_us * 1e-3
  memory = dict(base.memory)
  return Profile(
    model=base.model,
    device_type=device_type,
    source="modeled",
    batch_per_device=base.batch_per_device,
    ops=base.ops,
    op_ms=op_ms,
    remainder_ms={},
    optimizer_ms=optimizer_ms,
    cast=casts,
    memory=memory,
    meta={"derived_from": base.device_type, "catalog": dataclasses.asdict(spec)},
  ).with_remainder(rest)
