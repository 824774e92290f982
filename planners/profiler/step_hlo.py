"""What a compiled training step's HLO says about its ops: whose each instruction is, and how
much memory is live while each op's forward runs.

An instruction (``planners.profiler.hlo.entry_instructions``, in schedule order) belongs to the op its
JAX name stack names (``op_of``), in its forward or gradient legs (``leg_of``).
``per_op_ms`` charges a trace's instruction times to ops and legs; ``live_ranges`` /
``live_totals`` give the schedule's liveness (a value lives from its instruction to its last
use, a library call's scratch only while the call runs; parameters, constants and returned
values are not temporaries; ``ALIASING`` opcodes alias their operands); ``forward_headroom``
gives, per op, the step's peak of live temporaries minus the most live during its forward.
The liveness is the schedule's, not XLA's heap packing.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from planners.ops import ATTENTION_EINSUMS, OpShape
from planners.profiler.hlo import Instruction, element_bytes, entry_instructions

ALIASING = ("bitcast", "get-tuple-element", "tuple")
"""Opcodes whose result is (a view of) their operands' buffers."""
NOT_TEMPORARY = ("parameter", "constant")
RANDOM_KEY_MARKERS = ("threefry", "random_")
"""jax.random's functions in a JAX name stack."""
LIBRARY_SCRATCH = re.compile(r"^\(.*, [su]8\[\d+\]\{0\}\)$")
"""The result of a library custom call whose last element is its scratch, ``u8[n]`` (cuDNN) or
``s8[n]`` (cuBLAS), e.g. ``(f32[512,8,8,64]{3,2,1,0}, u8[55263248]{0})``."""


def leg_of(op_name: str) -> str | None:
  """The leg an instruction's JAX name stack ``op_name`` runs in: ``"bwd"`` under
  ``transpose(`` (a gradient leg), ``"fwd"`` under ``jvp(`` outside it, else None (the
  optimizer, unnamed instructions)."""
  if "transpose(" in op_name:
    return "bwd"
  return "fwd" if "jvp(" in op_name else None


def _is_subsequence(parts: Sequence[str], of: Sequence[str]) -> bool:
  it = iter(of)
  return all(p in it for p in parts)


def scope_names(op_name: str) -> list[str]:
  """The names in a JAX name stack, transformations unwrapped: JAX prints a transformation around
  the first scope under it, so ``jit(step)/transpose(jvp(blocks/0/attn))/dot_general`` is
  ``jit, step, transpose, jvp, blocks, 0, attn, dot_general``. (A linen model's first scope is its
  top-level module, ``jvp(LM)/block0/…``; an nnx model's is the op's own path, which
  ``qsync_jax.models.nnx_quant`` opens.)"""
  return [p for p in re.split(r"[/()]", op_name) if p]


def op_of(op_name: str, ops: Sequence[OpShape]) -> OpShape | None:
  """The op whose product an instruction's JAX name stack ``op_name`` belongs to: its module
  path's components appear in its ``scope_names`` in order (Flax repeats a module's name for its
  method) and attention products name their einsum; the longest path wins."""
  parts = scope_names(op_name)
  attention = any(e in op_name for e in ATTENTION_EINSUMS.values())
  best = None
  for op in ops:
    path = op.name.split(":")[0].split("/")
    einsum = ATTENTION_EINSUMS.get(op.kind)
    if (einsum in op_name if einsum else not attention) and _is_subsequence(path, parts):
      if best is None or len(path) > len(best.name.split(":")[0].split("/")):
        best = op
  return best


def rounding_keys_for_backward(instructions: Sequence[Instruction]) -> set[str]:
  """Names of the forward instructions that derive random keys (``RANDOM_KEY_MARKERS``) which
  only the gradient legs read, directly or through other such instructions: the keys of a
  quantized gradient leg's stochastic rounding, split under the op's forward. Reads through
  ``ALIASING`` instructions count as their readers' reads; a value the module returns is read
  by the forward."""
  readers: dict[str, list[str]] = defaultdict(list)
  for ins in instructions:
    for operand in ins.operands:
      readers[operand].append(ins.name)
  by_name = {ins.name: ins for ins in instructions}
  root = instructions[-1].name if instructions else None
  out: set[str] = set()

  def read_by_backward(name: str) -> bool:
    ins = by_name[name]
    if name == root:
      return False
    if leg_of(ins.op_name) == "bwd" or name in out:
      return True
    if ins.opcode in ALIASING:
      return bool(readers[name]) and all(read_by_backward(r) for r in readers[name])
    return False

  for ins in reversed(instructions):  # an instruction's readers come after it in the schedule
    keys = leg_of(ins.op_name) == "fwd" and any(m in ins.op_name for m in RANDOM_KEY_MARKERS)
    if keys and readers[ins.name] and all(read_by_backward(r) for r in readers[ins.name]):
      out.add(ins.name)
  return out


def per_op_ms(
  hlo: str, instruction_ms: dict[str, float], ops: Sequence[OpShape]
) -> dict[str, dict[str, float]]:
  """``{op name or "rest": {"fwd": ms, "bwd": ms}}``: each instruction's time charged to the op
  its JAX name stack names, to ``bwd`` under ``transpose(`` or where it derives keys only the
  gradient legs read (``rounding_keys_for_backward``), else to ``fwd``; an instruction of no op
  (activations, norms, the loss, the optimizer, fusions XLA named after a neighbour) to
  ``rest``. Work fused across an op boundary lands on the side XLA's fusion name says."""
  instructions = entry_instructions(hlo)
  names = {ins.name: ins.op_name for ins in instructions}
  for_backward = rounding_keys_for_backward(instructions)
  out: dict[str, dict[str, float]] = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0})
  for instruction, ms in instruction_ms.items():
    stack = names.get(instruction, "")
    op = op_of(stack, ops) if stack else None
    backward = leg_of(stack) == "bwd" or instruction in for_backward
    out[op.name if op else "rest"]["bwd" if backward else "fwd"] += ms
  return dict(out)


class LiveRange(NamedTuple):
  """Element ``element`` of ``instruction``'s result (schedule index ``start``), ``size`` bytes,
  live through schedule index ``end``."""

  instruction: str
  element: int
  size: int
  start: int
  end: int


def live_ranges(instructions: Sequence[Instruction]) -> list[LiveRange]:
  """Every temporary buffer of a scheduled entry computation with its live range. Each element
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

  def elements(name, element):
    return range(len(sizes.get(name, ()))) if element is None else (element,)

  last_use: dict[tuple[str, int], int] = {}
  for i, ins in enumerate(instructions):
    if ins.opcode in ALIASING:  # read through: its readers use what it aliases
      continue
    for x, e in zip(ins.operands, ins.operand_elements or (None,) * len(ins.operands)):
      for name, element in owners(x, e):
        for k in elements(name, element):
          last_use[name, k] = max(last_use.get((name, k), i), i)
  returned = {
    (n, k) for n, e in (owners(instructions[-1].name) if instructions else ()) for k in elements(n, e)
  }
  out = []
  for i, ins in enumerate(instructions):
    if ins.opcode in ALIASING or ins.opcode in NOT_TEMPORARY:
      continue
    elements_bytes = sizes[ins.name]
    scratch = ins.opcode == "custom-call" and LIBRARY_SCRATCH.match(ins.shape.strip()) is not None
    for k, size in enumerate(elements_bytes):
      if (ins.name, k) in returned:
        continue
      # a library call's scratch (its last element) lives while the call runs
      end = i if scratch and k == len(elements_bytes) - 1 else last_use.get((ins.name, k), i)
      out.append(LiveRange(ins.name, k, size, i, end))
  return out


def live_totals(ranges: Sequence[LiveRange], length: int) -> list[int]:
  """Bytes of ``ranges`` live at each of ``length`` schedule indices."""
  live = [0] * length
  for r in ranges:
    for t in range(r.start, r.end + 1):
      live[t] += r.size
  return live


def busiest_moments(instructions: Sequence[Instruction], live: Sequence[int], ops: Sequence[OpShape]):
  """``({(op name, leg): schedule index}, {instruction: (op name, leg)})``: where each op's
  forward / gradient instructions (``leg_of``) have the most bytes live, and whose leg each of
  those instructions is."""
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


def forward_headroom(hlo: str, ops: Sequence[OpShape]) -> dict[str, int]:
  """``{op name: bytes}``: the compiled step's peak of live temporaries minus the most live while
  the op's forward instructions run (ops whose forward is not found are left out)."""
  instructions = entry_instructions(hlo)
  live = live_totals(live_ranges(instructions), len(instructions))
  if not live:
    return {}
  moments, _ = busiest_moments(instructions, live, ops)
  return {name: max(live) - live[i] for (name, leg), i in moments.items() if leg == "fwd"}
