"""Memory over time in a compiled training step: how far below its peak each op's forward runs.

A quantized op's forward holds transients an fp32 op does not (on XLA:CPU an im2col
convolution's fp32 patch matrix, its 8-bit GEMM operand and the dequantized residual, all
at once), so a plan can peak *during the forward* rather than where the backward starts.
Whether that forward peak exceeds the fp32 step's depends on what else is live at that
moment: the profiler therefore records, for the fp32 step it fits, how many bytes below its
peak the step is while each op's forward runs (``forward_headroom``), and the replay adds
the plan's extra bytes on top of that (``planners.replay.memory_bytes``).

* ``buffer_bytes(shape)`` — bytes of an HLO result shape (tuples summed);
* ``live_ranges(instructions)`` — every temporary buffer with the schedule indices it lives
  through; ``live_bytes(instructions)`` — temporary bytes live at each ENTRY instruction, from the
  schedule (the text order of a compiled module): a value lives from its instruction to its
  last use, a library call's scratch buffer (``scratch_bytes``) only while the call runs;
  parameters, constants and values the step returns are not temporaries, and
  ``bitcast`` / ``get-tuple-element`` / ``tuple`` alias their operands;
* ``forward_memory(hlo, ops)`` — per op, the step's peak of ``live_bytes`` minus its largest
  value during the op's forward instructions (those of its JAX name stack outside
  ``transpose(...)``: ``headroom``), and the op's own bytes at that moment (``own``);
* ``scratch_bytes(hlo)`` — the largest scratch buffer a library call of a compiled program
  asks for (cuDNN convolutions, cuBLAS / cuBLASLt GEMMs on GPUs).

The liveness is the schedule's, not XLA's heap packing: XLA may place buffers with some
fragmentation, which this ignores.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple

from planners.ops import OpShape
from planners.steptrace import ALIASING, Instruction, entry_instructions, leg_of, op_of

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
NOT_TEMPORARY = ("parameter", "constant")


def buffer_bytes(shape: str) -> int:
  """Bytes of an HLO result shape such as ``f32[64,8]{1,0}`` or ``(f32[4], s32[4])``."""
  total = 0
  for dtype, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape):
    total += DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
  return total


SCRATCH = re.compile(r"= \(.*, [su]8\[(\d+)\]\{0\}\) custom-call\(")
"""A library custom call's result: a tuple whose last element is its scratch, ``u8[n]``
(cuDNN) or ``s8[n]`` (cuBLAS), e.g. ``(f32[512,8,8,64]{3,2,1,0}, u8[55263248]{0}) custom-call(``."""


def scratch_bytes(hlo: str) -> int:
  """The largest scratch buffer (bytes) of any library custom call in the compiled ``hlo``, in
  any computation; 0 where there is none (XLA:CPU). XLA:GPU packs a step's scratch buffers
  with its other temporaries by liveness, each live while its call runs: the largest is what
  the step must find room for. In the fp32 step of a 64-256-channel VGG on an H100 a 55 MB
  cuDNN filter-gradient scratch, where the bf16 step's largest was 1.8 MB and the all-int8 step
  (our own GEMM kernels) had none (buffer assignment, ``docs/results.md``)."""
  return max((int(m.group(1)) for m in SCRATCH.finditer(hlo)), default=0)


def element_bytes(shape: str) -> list[int]:
  """Bytes of each top-level element of an HLO result shape (one entry for an array):
  ``(f32[25], (s8[100], u8[4]))`` → ``[100, 104]``."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [buffer_bytes(shape)]
  parts, depth, current = [], 0, ""
  for ch in shape[1:-1]:
    depth += (ch in "([{") - (ch in ")]}")
    if ch == "," and depth == 0:
      parts.append(current)
      current = ""
    else:
      current += ch
  return [buffer_bytes(p) for p in parts + [current]]


class LiveRange(NamedTuple):
  """One temporary buffer of a scheduled ENTRY computation: element ``element`` of the result
  of ``instruction`` (its index ``start`` in the schedule), ``size`` bytes, live through the
  instruction at index ``end``."""

  instruction: str
  element: int
  size: int
  start: int
  end: int


def live_ranges(instructions: Sequence[Instruction]) -> list[LiveRange]:
  """Every temporary buffer of a scheduled ENTRY computation with its live range. Each element
  of a tuple-shaped result (a multi-output fusion's outputs, a library call's result and
  scratch) lives until its own last use."""
  index = {ins.name: i for i, ins in enumerate(instructions)}

  def owners(name: str, element: int | None = None) -> list[tuple[str, int | None]]:
    """The (instruction, element; None: all of them) whose buffers a reference reads."""
    ins = instructions[index[name]] if name in index else None
    if ins is None or ins.opcode not in ALIASING:
      return [(name, element)]
    if ins.opcode == "get-tuple-element":  # of a nested tuple: the whole top-level element
      return owners(ins.operands[0], ins.tuple_index)
    refs = list(zip(ins.operands, ins.operand_elements or (None,) * len(ins.operands)))
    if ins.opcode == "tuple" and element is not None:
      refs = [refs[element]]
    elif ins.opcode == "bitcast" and element is not None:
      refs = [(refs[0][0], element)]
    return [o for x, e in refs for o in owners(x, e)]

  sizes = {ins.name: element_bytes(ins.shape) for ins in instructions}
  last_use: dict[tuple[str, int], int] = {}
  for i, ins in enumerate(instructions):
    if ins.opcode in ALIASING:  # read through: its readers use what it aliases
      continue
    for x, e in zip(ins.operands, ins.operand_elements or (None,) * len(ins.operands)):
      for name, element in owners(x, e):
        for k in range(len(sizes.get(name, ()))) if element is None else (element,):
          last_use[name, k] = max(last_use.get((name, k), i), i)
  returned = set()
  for name, element in owners(instructions[-1].name) if instructions else ():
    returned |= {(name, k) for k in (range(len(sizes.get(name, ()))) if element is None else (element,))}
  out = []
  for i, ins in enumerate(instructions):
    if ins.opcode in ALIASING or ins.opcode in NOT_TEMPORARY:
      continue
    elements = sizes[ins.name]
    scratch = scratch_bytes(f"= {ins.shape} {ins.opcode}(") if ins.opcode == "custom-call" else 0
    for k, size in enumerate(elements):
      if (ins.name, k) in returned:
        continue
      # a library call's scratch (its last element) lives while the call runs
      end = i if scratch and k == len(elements) - 1 else last_use.get((ins.name, k), i)
      out.append(LiveRange(ins.name, k, size, i, end))
  return out


def live_bytes(instructions: Sequence[Instruction]) -> list[int]:
  """Temporary bytes live at each instruction of a scheduled ENTRY computation: the sum of
  the ``live_ranges`` that cover it."""
  return live_totals(live_ranges(instructions), len(instructions))


def live_totals(ranges: Sequence[LiveRange], length: int) -> list[int]:
  """Bytes of ``ranges`` live at each of ``length`` schedule indices."""
  live = [0] * length
  for r in ranges:
    for t in range(r.start, r.end + 1):
      live[t] += r.size
  return live


def busiest_moments(instructions: Sequence[Instruction], live: Sequence[int], ops: Sequence[OpShape]):
  """``({(op name, leg): schedule index}, {instruction: (op name, leg)})``: where each op's
  forward / gradient instructions (``steptrace.leg_of``) have the most bytes live, and whose
  leg each of those instructions is."""
  owner: dict[str, tuple[str, str]] = {}
  busiest: dict[tuple[str, str], int] = {}
  for i, ins in enumerate(instructions):
    leg = leg_of(ins.op_name)
    op = op_of(ins.op_name, ops) if leg else None
    if op is not None:
      owner[ins.name] = (op.name, leg)
      if (op.name, leg) not in busiest or live[i] > live[busiest[op.name, leg]]:
        busiest[op.name, leg] = i
  return busiest, owner


class ForwardMemory(NamedTuple):
  """Of each op's forward in a compiled step (ops whose forward is not found are left out):

  Attributes:
    headroom: ``{op name: bytes}``, the step's peak live temporaries minus the most live while
      the op's forward runs.
    own: ``{op name: bytes}``, of those most live bytes, the op's own: the results and library
      scratch of its forward instructions (an fp32 conv's output and cuDNN workspace).
  """

  headroom: dict[str, int]
  own: dict[str, int]


def forward_memory(hlo: str, ops: Sequence[OpShape]) -> ForwardMemory:
  """The ``ForwardMemory`` of the compiled step ``hlo``: the forward instructions of an op are
  those its JAX name stack names outside ``transpose(...)``."""
  instructions = entry_instructions(hlo)
  ranges = live_ranges(instructions)
  live = live_totals(ranges, len(instructions))
  if not live:
    return ForwardMemory({}, {})
  moments, owner = busiest_moments(instructions, live, ops)
  busiest = {name: i for (name, leg), i in moments.items() if leg == "fwd"}
  own = {name: 0 for name in busiest}
  for r in ranges:
    name, leg = owner.get(r.instruction, (None, None))
    if leg == "fwd" and r.start <= busiest[name] <= r.end:
      own[name] += r.size
  peak = max(live)
  return ForwardMemory({name: peak - live[i] for name, i in busiest.items()}, own)
