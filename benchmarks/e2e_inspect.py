"""What a compiled step of ``benchmarks.e2e`` holds (equations, GEMMs, Pallas kernels, custom
calls, peak memory) and what kind each GPU kernel of its trace is."""

from __future__ import annotations

import collections
import re

import jax

from qsync_jax import hlo as hlo_text


def jaxpr_stats(jaxpr) -> dict:
  """Equations, dot_generals (and those on 8-bit operands) and Pallas kernels (and their
  distinct shapes) of a jaxpr, nested jaxprs included."""
  counts = collections.Counter()
  kernels = set()

  def walk(j):
    for eqn in j.eqns:
      counts["eqns"] += 1
      name = eqn.primitive.name
      if name == "dot_general":
        counts["dot_generals"] += 1
        counts["dot_generals_8bit"] += any(v.aval.dtype.itemsize == 1 for v in eqn.invars)
      if name == "pallas_call":
        counts["pallas_calls"] += 1
        shapes = tuple((str(v.aval.dtype), tuple(v.aval.shape)) for v in eqn.invars)
        kernels.add((str(eqn.params.get("name_and_src_info", eqn.params.get("name", ""))), shapes))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(getattr(jaxpr, "jaxpr", jaxpr))
  return {**counts, "distinct_pallas_kernels": len(kernels)}


def custom_call_stats(lowered_text: str, compiled_text: str) -> dict:
  """Custom calls (our Pallas kernels among them) by target: in the lowered StableHLO module,
  how many distinct kernels (bodies and launch parameters) among them, and in XLA's compiled
  module (fewer there: XLA merged identical calls on the same operands, e.g. the same
  activation quantized for the query, key and value projections)."""
  calls, bodies = collections.Counter(), collections.defaultdict(set)
  for line in lowered_text.splitlines():
    if "stablehlo.custom_call @" not in line:
      continue
    target = line.split("stablehlo.custom_call @", 1)[1].split("(", 1)[0]
    calls[target] += 1
    bodies[target].add(hash(re.sub(r"%[\w#:]+", "", line.split("=", 1)[-1])))
  compiled = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', compiled_text))
  return {
    "custom_calls": dict(calls),
    "distinct_custom_call_bodies": {k: len(v) for k, v in bodies.items()},
    "compiled_custom_calls": dict(compiled),
  }


def device_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


KERNEL_KINDS = (
  ("our_gemm", ("mosaic", "scaled_matmul")),
  ("our_quantize", ("quantize",)),
  ("float_gemm", ("nvjet", "gemm", "cublas", "cutlass", "xmma", "matmul", "dot")),
  ("attention", ("flash", "fmha", "cudnn")),
  ("reduce", ("reduce",)),
  ("transpose_copy", ("transpose", "copy")),
  ("convert", ("convert",)),
)
"""Kernel name marks per kind, first match wins; any other kernel is ``other_fusion``."""


def kernel_kind(name: str) -> str:
  lower = name.lower()
  return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)), "other_fusion")


def instruction_stacks(hlo: str) -> dict[str, str]:
  """``{instruction name: JAX name stack}`` of every instruction of a compiled module, in any
  computation (fusions sit inside command-buffer computations on a GPU, not only in ENTRY),
  keyed as XLA:GPU names their kernels (``.`` written ``_``)."""
  comps, _ = hlo_text.parse(hlo)
  return {ins.name.replace(".", "_"): ins.op_name for body in comps.values() for ins in body if ins.op_name}
