"""Refitting a saved profile's memory model where it was measured, without timing anything.

``refit_memory(prof, task)`` compiles what the memory model reads from a device — each
whole-policy program's library scratch, the fp32 step's liveness and peak, the all-bf16 step's
peak — for profiles measured before the model read them (``planners.profiler`` records them
when it measures a profile).
"""

from __future__ import annotations

import dataclasses

from planners.op_programs import policy_programs, program_scratch_bytes
from planners.profiler import (
  SIXTEEN_BIT_FIT_PRESET,
  Profile,
  local_device_type,
  other_bytes,
  policy_key,
  step_memory,
  task_ops,
  with_16bit_other_bytes,
)
from qsync_jax.errors import PlanError
from qsync_jax.precision import PRESETS


def refit_memory(prof: Profile, task, seed: int = 0, progress=None) -> Profile:
  """``prof`` (measured on this device type, of ``task`` at its batch) with its memory model
  refitted here, nothing timed: each whole-policy entry's ``"scratch_bytes"`` where it lacks
  one (its forward + gradients program compiled, ``op_programs.program_scratch_bytes``, as
  ``measure_profile`` records it), then the fp32 step compiled for ``forward_headroom``,
  ``forward_own_bytes`` and ``other_bytes``, and, where bf16 is profiled, the all-bf16 step for
  ``other_bytes_16bit``
  (``step_memory``). For profiles measured before scratch buffers were
  recorded, or with an older liveness model; ``meta["scratch_bytes"]`` says it is done."""
  if prof.device_type != local_device_type():
    raise PlanError(
      f"profile of {prof.device_type} cannot be refitted on this {local_device_type()}. "
      "Fix: run this where the profile was measured (the same device type)."
    )
  say = progress or (lambda msg: None)
  precast = prof.meta.get("policy_operands") == "precast"
  op_ms = {name: {k: dict(v) for k, v in t.items()} for name, t in prof.op_ms.items()}
  cache: dict[tuple, int] = {}
  for i, op in enumerate(prof.ops):
    entries = {
      e.removeprefix("policy:"): timing
      for e, timing in op_ms[op.name].items()
      if e.startswith("policy:") and e.removeprefix("policy:") in PRESETS and "scratch_bytes" not in timing
    }
    if entries:
      say(f"[{i + 1}/{len(prof.ops)}] {op.name}: scratch buffers")
    for name, timing in entries.items():
      key = policy_key(name, op)
      if key not in cache:
        programs, *_ = policy_programs(PRESETS[name], op.batch, op.m, op.k, op.n, seed, op, precast)
        cache[key] = program_scratch_bytes(programs[1])
      timing["scratch_bytes"] = float(cache[key])
  say("fp32 step: memory")
  batch, variables, ops = task_ops(task, prof.batch_per_device, seed)
  if [o.name for o in ops] != list(prof.op_names):
    raise PlanError(
      f"task {task.name!r} has ops {[o.name for o in ops][:3]}…, not those of the profile of "
      f"{prof.model!r}. Fix: pass the task the profile was measured on."
    )
  peak, forward = step_memory(task, batch, variables, ops, seed)
  out = dataclasses.replace(
    prof,
    op_ms=op_ms,
    forward_headroom=forward.headroom,
    forward_own_bytes=forward.own,
    meta={**prof.meta, "scratch_bytes": True, "fp32_xla_peak_bytes": peak},
  )
  out = dataclasses.replace(out, memory={**prof.memory, "other_bytes": other_bytes(out, peak)})
  if "policy:" + SIXTEEN_BIT_FIT_PRESET not in next(iter(op_ms.values()), {}):
    return out
  say(f"{SIXTEEN_BIT_FIT_PRESET} step: memory")
  return with_16bit_other_bytes(
    out, step_memory(task, batch, variables, ops, seed, SIXTEEN_BIT_FIT_PRESET)[0]
  )
