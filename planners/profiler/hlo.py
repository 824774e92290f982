"""Compiled HLO text: its instructions, and the collectives each sync strategy really sends.

``parse(text)`` reads the computations of ``compiled.as_text()`` into ``Instruction`` s (name,
result shape, opcode, operands, called computations, the JAX name stack of its ``metadata``);
``entry_instructions(text)`` is the entry computation's, in order (a scheduled module's text
order is its execution order). ``element_bytes(shape)`` gives the bytes of each top-level
element of a result shape.

``collectives(text)`` lists every collective (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute, and their async ``-start`` forms) in the computations reachable
from the entry computation of ``compiled.as_text()``. Each one's ``bytes`` is the size of the
buffer it covers: ``max(sum of operand bytes, sum of result bytes)`` -- the all-reduced
tensor, the gathered tensor, the tensor before the scatter. (A ring algorithm sends about
``2(n-1)/n`` of that per device for an all-reduce and ``(n-1)/n`` for the others.)

``async_spans(text)`` tells, for each asynchronous collective of a scheduled module's entry
computation, how much compute the schedule places between its start and its done: what it
can overlap.

``outside_conditionals(text)`` keeps only those that run on every step (not inside a
``conditional``'s branches); ``conditional_branches(text)`` gives, for each conditional, the
collectives each branch would execute. Collectives inside a ``while`` body are listed once
(this counts per program, not per loop trip).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import numpy as np

COLLECTIVE_OPS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
  "collective-broadcast",
  "ragged-all-to-all",
)
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4}
_ELEMENT_BYTES |= {"f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_REF = re.compile(r"%([\w.\-]+)(?:#(\d+))?")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INDEX = re.compile(r"\bindex=(\d+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,\s]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")  # mesh['data'=2] {'data'}


def _group_size(attrs: str) -> int:
  m = _GROUPS_MESH.search(attrs)
  if m:  # newer XLA (seen on GPU, jax 0.11): the named mesh axes the collective spans
    sizes = dict(re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1)))
    return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2))] or [1]))
  m = _GROUPS_LIST.search(attrs)
  if m:
    return len([d for d in m.group(1).split(",") if d.strip()])
  m = _GROUPS_IOTA.search(attrs)
  return int(m.group(2)) if m else 1


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction: ``op`` (e.g. "all-reduce"), element ``dtypes``, buffer ``bytes``."""

  op: str
  dtypes: tuple[str, ...]
  bytes: int
  name: str
  computation: str
  group_size: int = 1

  @property
  def wire_bytes(self) -> float:
    """Bytes each device sends with a ring algorithm: 2(n-1)/n of the buffer for an
    all-reduce, (n-1)/n for the others (a collective-permute sends its whole buffer)."""
    n = self.group_size
    if self.op.startswith("collective-"):
      return float(self.bytes)
    return (2.0 if self.op == "all-reduce" else 1.0) * (n - 1) / n * self.bytes


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a computation.

  Attributes:
    name: instruction name (also the name of its trace events on XLA:CPU).
    shape: its result shape as the text writes it (e.g. ``f32[64,8]{1,0}``).
    opcode: e.g. ``fusion``, ``parameter``.
    operands: names of its operands.
    called: the computations its attributes name (``calls=``, ``to_apply=``, branches…).
    group_size: devices in each replica group of a collective, else 1.
    op_name: its ``metadata`` op_name (the JAX name stack), else "".
    operand_elements: per operand, the element of a tuple-shaped operand it reads
      (``%fusion.3#1`` in newer XLA text), else None (the whole operand).
    tuple_index: a ``get-tuple-element``'s ``index``, else None.
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  called: tuple[str, ...] = ()
  group_size: int = 1
  op_name: str = ""
  operand_elements: tuple[int | None, ...] = ()
  tuple_index: int | None = None


def _element_bytes(dtype: str) -> int:
  if dtype.startswith("f8"):
    return 1
  return _ELEMENT_BYTES.get(dtype, 0)


def element_bytes(shape: str) -> list[int]:
  """Bytes of each top-level element of a result shape (one entry for an array):
  ``(f32[25], (s8[100], u8[4]))`` → ``[100, 104]``."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [sum(b for _, b in _arrays(shape))]
  parts, depth, current = [], 0, ""
  for ch in shape[1:-1]:
    depth += (ch in "([{") - (ch in ")]}")
    if ch == "," and depth == 0:
      parts.append(current)
      current = ""
    else:
      current += ch
  return [sum(b for _, b in _arrays(p)) for p in parts + [current]]


def _arrays(shape: str) -> list[tuple[str, int]]:
  """``[(dtype, bytes)]`` of every array in an HLO shape string (tuples flattened)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    numel = 1
    for d in filter(None, dims.split(",")):
      numel *= int(d)
    out.append((dtype, numel * _element_bytes(dtype)))
  return out


def _split_operands(rest: str) -> tuple[str, str]:
  """Splits ``"a, b), attr=..."`` at the parenthesis closing the operand list."""
  depth = 1
  for i, c in enumerate(rest):
    depth += c == "("
    depth -= c == ")"
    if depth == 0:
      return rest[:i], rest[i + 1 :]
  return rest, ""


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """``({computation name: instructions}, entry name)`` of an HLO module's text."""
  comps: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(2)
      comps[current] = []
      entry = current if header.group(1) else entry
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      operands, attrs = _split_operands(m.group(4))
      refs = _REF.findall(operands)
      op_name = _OP_NAME.search(attrs)
      index = _INDEX.search(attrs) if m.group(3) == "get-tuple-element" else None
      comps[current].append(
        Instruction(
          m.group(1),
          m.group(2),
          m.group(3),
          tuple(r for r, _ in refs),
          tuple(r for r, _ in _REF.findall(attrs)),
          _group_size(attrs),
          op_name.group(1) if op_name else "",
          tuple(int(e) if e else None for _, e in refs),
          int(index.group(1)) if index else None,
        )
      )
  return comps, entry


def entry_instructions(text: str) -> list[Instruction]:
  """The entry computation's instructions of an HLO module's text, in order."""
  comps, entry = parse(text)
  return comps.get(entry, [])


def _base_op(opcode: str) -> str | None:
  if opcode.endswith("-done"):
    return None
  base = opcode.removesuffix("-start")
  return base if base in COLLECTIVE_OPS else None


def _collect(comps, roots: Iterable[str], skip_branches: bool) -> list[Collective]:
  shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}  # parameters included
  seen, order, stack = set(), [], list(roots)
  while stack:
    name = stack.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    order.append(name)
    for instr in comps[name]:
      if skip_branches and instr.opcode == "conditional":
        continue
      stack.extend(c for c in instr.called if c in comps)
  found = []
  for comp in order:
    for instr in comps[comp]:
      op = _base_op(instr.opcode)
      if op is None:
        continue
      result = _arrays(instr.shape)
      operands = [a for o in instr.operands for a in _arrays(shapes.get(o, ""))]
      if instr.opcode.endswith("-start"):  # async: result tuple also holds the operands
        nbytes = max([b for _, b in result] + [sum(b for _, b in operands)])
      else:
        nbytes = max(sum(b for _, b in result), sum(b for _, b in operands))
      dtypes = tuple(sorted({d for d, _ in result}))
      found.append(Collective(op, dtypes, nbytes, instr.name, comp, instr.group_size))
  return found


def collectives(text: str) -> list[Collective]:
  """Every collective reachable from the entry computation (each listed once)."""
  comps, entry = parse(text)
  return _collect(comps, [entry], skip_branches=False)


def outside_conditionals(text: str) -> list[Collective]:
  """The collectives that run on every execution: reachable without entering a conditional."""
  comps, entry = parse(text)
  return _collect(comps, [entry], skip_branches=True)


def conditional_branches(text: str) -> list[list[list[Collective]]]:
  """For each ``conditional`` in the module: one list of collectives per branch."""
  comps, _ = parse(text)
  out = []
  for instrs in comps.values():
    for instr in instrs:
      if instr.opcode == "conditional":
        out.append([_collect(comps, [b], skip_branches=False) for b in instr.called if b in comps])
  return out


def summarize(found: Iterable[Collective]) -> dict:
  """``{"count", "bytes", "wire_bytes", "by_op": {op: bytes}, "by_dtype": {dtype: bytes}}``."""
  found = list(found)
  by_op: dict[str, int] = {}
  by_dtype: dict[str, int] = {}
  for c in found:
    by_op[c.op] = by_op.get(c.op, 0) + c.bytes
    key = ",".join(c.dtypes)
    by_dtype[key] = by_dtype.get(key, 0) + c.bytes
  return {
    "count": len(found),
    "bytes": sum(c.bytes for c in found),
    "wire_bytes": sum(c.wire_bytes for c in found),
    "by_op": by_op,
    "by_dtype": by_dtype,
  }


COMPUTE_OPCODES = ("fusion", "custom-call", "dot", "convolution")
"""Opcodes that launch device compute (kernels) in a compiled GPU module."""


@dataclasses.dataclass(frozen=True)
class AsyncSpan:
  """One asynchronous collective: the compute instructions between its start and its done in
  the schedule (``custom_calls`` of them custom calls, e.g. Pallas kernels)."""

  name: str
  op: str
  bytes: int
  compute: int
  custom_calls: int


def async_spans(text: str) -> list[AsyncSpan]:
  """The asynchronous collectives of the entry computation of a scheduled module
  (``compiled.as_text()``, whose instruction order is the execution order): a
  ``<collective>-start`` with its ``-done``, or an ``async-start`` / ``async-done`` pair whose
  called computation holds a collective. An empty list, or spans of 0 compute, mean the
  collectives run exposed."""
  comps, entry = parse(text)
  sizes = {c.name: c for c in _collect(comps, [entry], skip_branches=False)}  # as collectives(text)
  instrs = comps.get(entry, [])
  spans = []
  for i, start in enumerate(instrs):
    if start.opcode.endswith("-start") and start.opcode != "async-start" and start.name in sizes:
      inner = sizes[start.name]
    elif start.opcode == "async-start":
      inner = next((c for c in sizes.values() if c.computation in start.called), None)
      if inner is None:
        continue
    else:
      continue
    done = next((j for j in range(i + 1, len(instrs)) if start.name in instrs[j].operands), len(instrs))
    between = [x.opcode for x in instrs[i + 1 : done]]
    spans.append(
      AsyncSpan(
        start.name,
        inner.op,
        inner.bytes,
        sum(op in COMPUTE_OPCODES for op in between),
        between.count("custom-call"),
      )
    )
  return spans


def compiled_text(fn, *args, **kwargs) -> str:
  """The optimized HLO text of ``jax.jit(fn)`` (or of an already jitted ``fn``) on these args."""
  import jax

  lower = fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower
  return lower(*args, **kwargs).compile().as_text()
