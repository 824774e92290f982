"""Relayouts of saved activations in a compiled training step, and what they cost in it.

A gradient leg contracts a saved activation over another axis than the forward did (drhs:
Xᵀ·dY contracts the tokens / pixels), so XLA lays the activation out anew for it: a
*relayout* fusion (a transposing copy). When the op saved the producer's output itself (an
fp32 op) XLA re-runs the producer inside that fusion, reading the producer's inputs with a
stride; on XLA:CPU this cost 7 ms of a 65 ms transformer step (a GELU re-run twice), ~20×
a standalone copy, and it disappears when the op saves a bf16 copy or an int8 residual
instead. Standalone op timings cannot see it (there the operand is a program input), so the
profiler measures it inside the fp32 step — the plan it fits — from XLA's per-instruction
trace, and attributes each relayout to the op whose gradient product reads it:

* ``entry_instructions(hlo)`` / ``relayout_fusions(hlo)`` — the ENTRY instructions of a
  compiled module's text and its relayout fusions;
* ``step_instruction_ms(task, policy, batch, repeats)`` — ``(hlo text, {instruction: ms per
  step})`` of the jitted training step (``planners.step``), from a ``jax.profiler`` trace with
  XLA:CPU's per-instruction trace events (CPU only);
* ``relayout_ms(hlo, instruction_ms, ops)`` — ``{op name: ms}`` of the relayouts each op's
  gradient products read;
* ``with_policy_step_relayouts(task, batch, ops, op_ms)`` — the relayouts of the non-fp32
  policies that re-run the producer too, measured in their own uniform steps;
* ``traced_step(task, policy, batch, repeats)`` / ``per_op_ms(hlo, instruction_ms, ops)`` — a
  step's instructions timed on any backend (GPU kernels or XLA:CPU events) and charged to the
  ops and legs they belong to (``op_leg_ms``: ``Profile.quantized_in_step_ms``;
  ``benchmarks/step_ops.py``).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import re
import tempfile
from collections import defaultdict
from collections.abc import Sequence

import jax
import numpy as np

from planners import step
from planners.ops import ATTENTION_EINSUMS, OpShape
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import FP32_LIKE, PRESETS

ALIASING = ("bitcast", "get-tuple-element", "tuple")
"""Opcodes whose result is (a view of) their operands' buffers."""


def leg_of(op_name: str) -> str | None:
  """The leg an instruction's JAX name stack ``op_name`` runs in: ``"bwd"`` under
  ``transpose(`` (a gradient leg), ``"fwd"`` under ``jvp(`` outside it, else None (neither:
  the optimizer, unnamed instructions)."""
  if "transpose(" in op_name:
    return "bwd"
  return "fwd" if "jvp(" in op_name else None


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a module's ENTRY computation.

  Attributes:
    name: instruction name (also the name of its trace events on XLA:CPU).
    opcode: e.g. ``fusion``, ``parameter``.
    operands: names of its operands.
    calls: the computation it calls (fusions), else None.
    op_name: its ``metadata`` op_name (the JAX name stack), else "".
    operand_params: parameter numbers of the ENTRY parameters among its operands.
    shape: its result shape as the text writes it (e.g. ``f32[64,8,8,16]{3,2,1,0}``).
    operand_elements: per operand, the element of a tuple-shaped operand it reads
      (``%fusion.3#1`` in newer XLA text), else None (the whole operand).
    tuple_index: a ``get-tuple-element``'s ``index``, else None.
  """

  name: str
  opcode: str
  operands: tuple[str, ...]
  calls: str | None
  op_name: str
  operand_params: tuple[int, ...] = ()
  shape: str = ""
  operand_elements: tuple[int | None, ...] = ()
  tuple_index: int | None = None


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")


def _computations(hlo: str) -> dict[str, str]:
  """``{computation name: body text}``; the ENTRY computation under ``"ENTRY"``."""
  out, name, body = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", line)
    if head and name is None:
      name, body = ("ENTRY" if head.group(1) else head.group(2)), []
    elif line.startswith("}") and name is not None:
      out[name] = "\n".join(body)
      name = None
    elif name is not None:
      body.append(line)
  return out


def _operand_text(rest: str) -> str:
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i]
  return rest


def entry_instructions(hlo: str) -> list[Instruction]:
  """The ENTRY instructions of the text of a compiled HLO module, in order."""
  body = _computations(hlo).get("ENTRY", "")
  parsed, params = [], {}
  for line in body.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, opcode, rest = m.groups()
    operand_text = _operand_text(rest)
    if opcode == "parameter":
      params[name] = int(operand_text)
    calls = re.search(r"calls=%([\w.\-]+)", rest)
    meta = re.search(r'op_name="([^"]*)"', rest)
    refs = re.findall(r"%([\w.\-]+)(?:#(\d+))?", operand_text)
    index = re.search(r"index=(\d+)", rest) if opcode == "get-tuple-element" else None
    parsed.append(
      (
        name,
        opcode,
        tuple(r for r, _ in refs),
        calls.group(1) if calls else None,
        meta.group(1) if meta else "",
        shape,
        tuple(int(e) if e else None for _, e in refs),
        int(index.group(1)) if index else None,
      )
    )
  return [
    Instruction(n, o, ops, c, m, tuple(params[x] for x in ops if x in params), s, e, t)
    for n, o, ops, c, m, s, e, t in parsed
  ]


def relayout_fusions(hlo: str) -> list[Instruction]:
  """Loop fusions of the ENTRY computation that write a transposed copy (a relayout)."""
  bodies = _computations(hlo)
  out = []
  for ins in entry_instructions(hlo):
    body = bodies.get(ins.calls or "", "")
    if ins.opcode == "fusion" and " transpose(" in body and " copy(" in body:
      out.append(ins)
  return out


def _is_subsequence(parts: Sequence[str], of: Sequence[str]) -> bool:
  it = iter(of)
  return all(p in it for p in parts)


def op_of(op_name: str, ops: Sequence[OpShape]) -> OpShape | None:
  """The op whose product an instruction's JAX name stack ``op_name`` belongs to: its module
  path's components appear in it in order (Flax repeats a module's name for its method) and
  attention products name their einsum; the longest path wins."""
  parts = op_name.split("/")
  attention = any(e in op_name for e in ATTENTION_EINSUMS.values())
  best = None
  for op in ops:
    path = op.name.split(":")[0].split("/")
    einsum = ATTENTION_EINSUMS.get(op.kind)
    if (einsum in op_name if einsum else not attention) and _is_subsequence(path, parts):
      if best is None or len(path) > len(best.name.split(":")[0].split("/")):
        best = op
  return best


def relayout_ms(hlo: str, instruction_ms: dict[str, float], ops: Sequence[OpShape]) -> dict[str, float]:
  """``{op name: ms}``: the step time of the relayout fusions whose result a gradient product
  of the op reads (each relayout counted once, for its first such reader)."""
  instructions = entry_instructions(hlo)
  readers = defaultdict(list)
  for ins in instructions:
    for operand in ins.operands:
      readers[operand].append(ins)
  out: dict[str, float] = {}
  for fusion in relayout_fusions(hlo):
    for reader in readers[fusion.name]:
      if "transpose(jvp" not in reader.op_name or "dot_general" not in reader.op_name:
        continue
      op = op_of(reader.op_name, ops)
      if op is not None:
        out[op.name] = out.get(op.name, 0.0) + instruction_ms.get(fusion.name, 0.0)
        break
  return out


TRACE_OPTIONS = {"xla_cpu_enable_xprof_traceme": True}
"""XLA:CPU compile option: one trace event per executed instruction."""


def step_instruction_ms(task, policy, batch, repeats: int = 10, optimizer=None, seed: int = 0):
  """``(hlo text, {instruction name: median ms per step})`` of the jitted training step of
  ``task`` under ``policy`` (XLA:CPU only: other backends return an empty table).

  The step is compiled with per-instruction trace events and run ``repeats`` times under
  ``jax.profiler.trace``; an instruction's time is the median of its events (wall clock)
  times its events per step.
  """

  def compiled_step(options=None):
    return step.compile_train_step(task, policy, batch, optimizer, seed, options)

  if jax.devices()[0].platform != "cpu":
    return compiled_step()[0].as_text(), {}
  try:
    compiled, step_run = compiled_step(TRACE_OPTIONS)
  except Exception:  # an XLA without the option: no table (the replay then ignores relayouts)
    return compiled_step()[0].as_text(), {}
  hlo = compiled.as_text()
  names = {ins.name for ins in entry_instructions(hlo)}

  def run():
    jax.block_until_ready(step_run())

  run()
  durations = defaultdict(list)
  try:
    events = traced_events(run, repeats)
  except RuntimeError:  # another profiler session is running: no table
    return hlo, {}
  for event in events:
    if event["name"] in names:
      durations[event["name"]].append(event["dur"] / 1e3)
  return hlo, {n: float(np.median(d)) * len(d) / repeats for n, d in durations.items()}


NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
"""XLA:GPU compile option: no CUDA graphs, so that each kernel of a trace names the instruction
it runs (its ``hlo_op``) instead of the graph that launched it."""


def traced_step(task, policy, batch, repeats: int) -> tuple[str, dict[str, float], float]:
  """``(module text, {instruction: ms per step}, ms per step)`` of the jitted training step of
  ``task`` under ``policy``: on a GPU its kernels (compiled with ``NO_COMMAND_BUFFERS``, each
  kernel's time charged to its ``hlo_op``), elsewhere XLA:CPU's per-instruction events
  (``step_instruction_ms``); the last is their sum."""
  if jax.devices()[0].platform != "gpu":
    hlo, instruction_ms = step_instruction_ms(task, policy, batch, repeats)
    return hlo, instruction_ms, sum(instruction_ms.values())
  compiled, run = step.compile_train_step(task, policy, batch, compiler_options=NO_COMMAND_BUFFERS)
  jax.block_until_ready(run())  # warm-up
  events = traced_events(lambda: jax.block_until_ready(run()), repeats)
  named = [{**e, "name": e.get("args", {}).get("hlo_op", "")} for e in events]
  instruction_ms = {name: ms for name, (ms, _) in kernels_by(named, repeats).items()}
  return compiled.as_text(), instruction_ms, sum(instruction_ms.values())


RANDOM_KEY_MARKERS = ("threefry", "random_")  # jax.random's functions in a JAX name stack


def rounding_keys_for_backward(instructions: Sequence[Instruction]) -> set[str]:
  """Names of the forward instructions (JAX name stack outside ``transpose(``) that derive
  random keys (``RANDOM_KEY_MARKERS``) which only the gradient legs read, directly or through
  other such instructions: the keys of a quantized gradient leg's stochastic rounding, split
  under the op's forward (an int8 forward with bf16 gradient legs has none of them). Reads
  through ``bitcast`` / ``get-tuple-element`` / ``tuple`` count as their readers' reads; a value
  the module returns is read by the forward. Only key work is moved: by dataflow alone the
  whole forward chain of a model can look gradient-only, where XLA fuses the loss into a
  fusion named after its gradient."""
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
    if (
      leg_of(ins.op_name) == "fwd" and any(m in ins.op_name for m in RANDOM_KEY_MARKERS) and readers[ins.name]
    ):
      if all(read_by_backward(r) for r in readers[ins.name]):
        out.add(ins.name)
  return out


def per_op_ms(
  hlo: str, instruction_ms: dict[str, float], ops: Sequence[OpShape]
) -> dict[str, dict[str, float]]:
  """``{op name or "rest": {"fwd": ms, "bwd": ms}}``: each instruction's time charged to the op
  its JAX name stack names (``op_of``), to ``bwd`` under ``transpose(`` (a gradient leg) or
  where it derives keys only the gradient legs read (``rounding_keys_for_backward``), else to
  ``fwd``; an instruction of no op (activations, norms, the loss, the optimizer, and fusions
  XLA named after a neighbour) to ``rest``. Attribution follows XLA's fusion names, so work
  fused across an op boundary lands on one side of it."""
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


def op_leg_ms(task, policy, batch, ops: Sequence[OpShape], repeats: int) -> dict[str, dict[str, float]]:
  """``{op name: {"fwd": ms, "bwd": ms}}``: the ops' time inside the training step under
  ``policy`` (``traced_step``, charged by ``per_op_ms``; the rest left out); empty where
  another profiler session keeps the trace from running."""
  try:
    hlo, instruction_ms, _ = traced_step(task, policy, batch, repeats)
  except RuntimeError:
    return {}
  by_op = per_op_ms(hlo, instruction_ms, ops)
  return {op.name: by_op[op.name] for op in ops if op.name in by_op}


def with_policy_step_relayouts(
  task, batch, ops: Sequence[OpShape], op_ms: dict[str, dict], repeats: int = 10, seed: int = 0
) -> tuple[dict[str, dict], list[str]]:
  """``(op_ms, presets traced)``: ``op_ms`` (the profiler's per-op tables) with the relayout
  of every whole-policy entry that re-runs the activation's producer (``"refuses_producer"``,
  ``op_programs.producer_relayout_ms``) measured in that preset's uniform step, as the fp32
  relayouts are measured in the fp32 step, instead of its standalone estimate. The standalone
  producer cannot reproduce the step's: the CPU LM's mlp_out re-runs its GELU inside the
  transposing copy, 7.0 ms in the all-fp16 step against 0.9 ms estimated. fp32-like presets are
  the fp32 step's already. Nothing changes where the backend has no per-instruction trace
  (``step_instruction_ms``: XLA:CPU only)."""
  out, traced = dict(op_ms), []
  for name, policy in PRESETS.items():
    key = f"policy:{name}"
    refusing = [op for op in ops if op_ms.get(op.name, {}).get(key, {}).get("refuses_producer")]
    if policy.fwd in FP32_LIKE or not refusing:
      continue
    hlo, instruction_ms = step_instruction_ms(task, PrecisionPolicy.uniform(name), batch, repeats, seed=seed)
    if not instruction_ms:
      continue
    measured = relayout_ms(hlo, instruction_ms, ops)
    for op in refusing:  # new tables: entries of ops of one shape are shared objects
      out[op.name] = {**out[op.name], key: {**op_ms[op.name][key], "relayout_ms": measured.get(op.name, 0.0)}}
    traced.append(name)
  return out, traced


def traced_events(run, repeats: int) -> list[dict]:
  """The complete ("X") events of a ``jax.profiler`` trace of ``repeats`` calls of ``run``,
  each with ``process``: the name of the trace process it belongs to (e.g.
  ``/device:GPU:0 ...`` for GPU kernels, ``/host:CPU`` for XLA:CPU's per-instruction events)."""
  out = []
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      for _ in range(repeats):
        run()
    for path in glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True):
      with gzip.open(path) as f:
        events = json.load(f).get("traceEvents", [])
      process = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
      }
      out += [{**e, "process": process.get(e.get("pid"), "")} for e in events if e.get("ph") == "X"]
  return out


GEMM_KERNEL_MARKS = ("gemm", "nvjet", "cublas", "cutlass", "xmma", "matmul", "mosaic_gpu")
"""Substrings (lower case) of the names of GPU matrix-product kernels: cuBLAS / cuBLASLt
(``nvjet_sm90…``, ``sm80_xmma_gemm…``, ``cutlass…``), XLA's Triton GEMM fusions
(``gemm_fusion_dot…``) and our Mosaic GPU GEMM (``anonymous_mosaic_gpu_kernel``). Name-based,
so approximate: a kernel that does a product under another name counts as other work."""

COMM_KERNEL_MARKS = ("nccl",)
"""Substrings (lower case) of the names of GPU collective kernels (``ncclDevKernel_AllReduce…``)."""


@dataclasses.dataclass(frozen=True)
class KernelSummary:
  """GPU kernels per call of a program (means over the traced calls)."""

  ms: float  # kernel time
  kernels: float  # kernel launches
  gemm_ms: float  # of it, matrix products (``GEMM_KERNEL_MARKS``)
  gemm_kernels: float
  comm_ms: float  # of it, collectives (``COMM_KERNEL_MARKS``), which may overlap the rest
  top: tuple[tuple[str, float], ...]  # (kernel name, ms per call), the 20 largest


def kernels_by(
  events: list[dict], repeats: int, key=lambda name: name, device: str = "/device:GPU:0"
) -> dict[str, tuple[float, float]]:
  """``{key(kernel name): (ms, launches)}`` per call of the ``traced_events`` of ``repeats``
  calls, on the trace process ``device`` (the first GPU); empty where it has no kernel."""
  out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
  for e in events:
    if e["process"].startswith(device):
      entry = out[key(e["name"])]
      entry[0] += e["dur"] / 1e3 / repeats
      entry[1] += 1 / repeats
  return {k: (ms, n) for k, (ms, n) in out.items()}


def summarize_kernels(
  events: list[dict], repeats: int, device: str = "/device:GPU:0"
) -> KernelSummary | None:
  """The ``KernelSummary`` of ``traced_events`` of ``repeats`` calls, on the trace process
  ``device`` (the first GPU); None where it has no kernel (e.g. on a CPU)."""
  mine = [e for e in events if e["process"].startswith(device)]
  if not mine:
    return None
  per_name = {name: ms for name, (ms, _) in kernels_by(mine, repeats, device=device).items()}
  gemm = [e for e in mine if any(m in e["name"].lower() for m in GEMM_KERNEL_MARKS)]
  comm = [e for e in mine if any(m in e["name"].lower() for m in COMM_KERNEL_MARKS)]
  return KernelSummary(
    ms=sum(e["dur"] for e in mine) / 1e3 / repeats,
    kernels=len(mine) / repeats,
    gemm_ms=sum(e["dur"] for e in gemm) / 1e3 / repeats,
    gemm_kernels=len(gemm) / repeats,
    comm_ms=sum(e["dur"] for e in comm) / 1e3 / repeats,
    top=tuple(sorted(per_name.items(), key=lambda kv: -kv[1])[:20]),
  )


def gpu_kernels(run, repeats: int) -> KernelSummary | None:
  """The ``KernelSummary`` of ``repeats`` calls of ``run`` on the first GPU; None without one."""
  return summarize_kernels(traced_events(run, repeats), repeats)


def device_kernel_ms(run, repeats: int) -> float:
  """Mean ms per call of ``run`` of the kernels on the first GPU (``/device:GPU:0``), from a
  ``jax.profiler`` trace of ``repeats`` calls. ``RuntimeError`` where the trace has no GPU
  kernels (e.g. on a CPU): the device clock exists on GPUs only."""
  summary = gpu_kernels(run, repeats)
  if summary is None:
    raise RuntimeError(
      f"no GPU kernel in a trace of {jax.devices()[0].platform} programs: the device clock needs a GPU. "
      "Fix: time with clock='wall' (or 'cpu' on a CPU host)."
    )
  return summary.ms
