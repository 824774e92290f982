"""Memory over time in a compiled training step: how far below its peak each op's forward runs.

A quantized op's forward holds transients an fp32 op does not (on XLA:CPU an im2col
convolution's fp32 patch matrix, its 8-bit GEMM operand and the dequantized residual, all
at once), so a plan can peak *during the forward* rather than where the backward starts.
Whether that forward peak exceeds the fp32 step's depends on what else is live at that
moment: the profiler therefore records, for the fp32 step it fits, how many bytes below its
peak the step is while each op's forward runs (``forward_headroom``), and the replay adds
the plan's extra bytes on top of that (``planners.replay.memory_bytes``).

* ``buffer_bytes(shape)`` — bytes of an HLO result shape (tuples summed);
* ``live_bytes(instructions)`` — temporary bytes live at each ENTRY instruction, from the
  schedule (the text order of a compiled module): a value lives from its instruction to its
  last use; parameters, constants and values the step returns are not temporaries, and
  ``bitcast`` / ``get-tuple-element`` / ``tuple`` alias their operands;
* ``forward_headroom(hlo, ops)`` — ``{op name: bytes}``: the step's peak of ``live_bytes``
  minus its largest value during the op's forward instructions (those of its JAX name stack
  outside ``transpose(...)``).

The liveness is the schedule's, not XLA's heap packing: XLA may place buffers with some
fragmentation, which this ignores.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from planners.ops import OpShape
from planners.steptrace import Instruction, entry_instructions, op_of

DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3": 1,
  "f8e4m3fnuz": 1,
  "f8e5m2fnuz": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
ALIASING = ("bitcast", "get-tuple-element", "tuple")
"""Opcodes whose result is (a view of) their operands' buffers."""
NOT_TEMPORARY = ("parameter", "constant")


def buffer_bytes(shape: str) -> int:
  """Bytes of an HLO result shape such as ``f32[64,8]{1,0}`` or ``(f32[4], s32[4])``."""
  total = 0
  for dtype, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape):
    total += DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
  return total


def live_bytes(instructions: Sequence[Instruction]) -> list[int]:
  """Temporary bytes live at each instruction of a scheduled ENTRY computation."""
  index = {ins.name: i for i, ins in enumerate(instructions)}

  def owners(name: str) -> list[str]:
    ins = instructions[index[name]] if name in index else None
    if ins is None or ins.opcode not in ALIASING:
      return [name]
    return [o for x in ins.operands for o in owners(x)]

  last_use = {ins.name: i for i, ins in enumerate(instructions)}
  for i, ins in enumerate(instructions):
    for x in ins.operands:
      for o in owners(x):
        last_use[o] = max(last_use.get(o, i), i)
  returned = set(owners(instructions[-1].name)) if instructions else set()
  live = [0] * len(instructions)
  for i, ins in enumerate(instructions):
    if ins.opcode in ALIASING or ins.opcode in NOT_TEMPORARY or ins.name in returned:
      continue
    size = buffer_bytes(ins.shape)
    for t in range(i, last_use[ins.name] + 1):
      live[t] += size
  return live


def forward_headroom(hlo: str, ops: Sequence[OpShape]) -> dict[str, int]:
  """``{op name: bytes}``: the compiled step's peak live temporaries minus the most live
  while the op's forward runs (ops whose forward is not found are left out)."""
  instructions = entry_instructions(hlo)
  live = live_bytes(instructions)
  if not live:
    return {}
  peak = max(live)
  during: dict[str, int] = {}
  for i, ins in enumerate(instructions):
    if "jvp(" not in ins.op_name or "transpose(" in ins.op_name:
      continue
    op = op_of(ins.op_name, ops)
    if op is not None:
      during[op.name] = max(during.get(op.name, 0), live[i])
  return {name: peak - bytes_ for name, bytes_ in during.items()}
