"""A program's GPU kernels summarized from a profiler trace: time, launches, and the part in
matrix products and in collectives (``KernelSummary``, ``gpu_kernels``). Used by
``benchmarks.diagnosis.step_kernels`` (a step's and the profiler's programs' kernels) and
``benchmarks.multigpu`` (each scaling step's kernels on the first GPU)."""

from __future__ import annotations

import dataclasses

from planners.profiler import timing

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


def summarize_kernels(
  events: list[dict], repeats: int, device: str = "/device:GPU:0"
) -> KernelSummary | None:
  """The ``KernelSummary`` of ``planners.profiler.timing.profiler_events`` of ``repeats`` calls, on the trace
  process ``device`` (the first GPU); None where it has no kernel (e.g. on a CPU)."""
  mine = [e for e in events if e["process"].startswith(device)]
  if not mine:
    return None
  per_name = {name: ms for name, (ms, _) in timing.kernels_by(mine, repeats, device=device).items()}
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
  return summarize_kernels(timing.profiler_events(run, repeats), repeats)
