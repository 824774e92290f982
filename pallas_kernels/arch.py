"""Which implementation of each 8-bit kernel runs on which GPU architecture.

One table, ``KERNELS``, keyed by CUDA architecture (``"sm90"`` for compute capability 9.0). It
follows what the toolchains compile:

* Pallas' Triton lowering needs compute capability 8.0 or newer (Triton supports Ampere and up;
  JAX refuses sm75, jax issue #26799), so a V100 or T4 runs no Pallas kernel: its quantize
  passes are the jnp reference (which XLA fuses) and its GEMMs XLA's.
* Pallas' Mosaic GPU lowering (TMA + wgmma) exists on Hopper only (sm90).
* XLA's int8 × int8 → int32 dot runs through cuBLAS from sm75 (Turing's int8 tensor cores);
  XLA's fp8 dot through cuBLASLt from sm89 (Ada, Hopper), whose FP8 custom calls "require Ada,
  Hopper, or later"; e4m3 needs sm89 in Triton too. A V100 (sm70) has no 8-bit tensor cores.

``quantize`` names the implementation of every quantize pass of the 8-bit products: per row or
column (``quantize``), the output gradient's row and column copies (``quantize_pair``) and an
operand written in both GEMM layouts in one pass (``quantize_both``, the forward's operands when
the gradient leg reads them at the same format). ``"pallas"`` runs the Pallas-Triton kernels of
all three (``benchmarks.diagnosis.cross_compile`` compiles each for every architecture here:
int8 from sm80, e4m3 from sm89); ``"reference"`` the jnp reference, with XLA's transposes.

A ``gemm`` entry lists, per operand kind, the implementations in the order they are tried:
``"pallas"`` (the Triton-backend kernel) only for contractions of at most ``SHORT_K`` (where its
fused epilogue beats a separate accumulator pass), then the first of the others. ``tested``
names the implementations the ``gpu``-marked tests run on that architecture; the others are
compiled once, on a tiny case, before first use (``gemm.api``), and skipped with a warning
where they do not compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

SHORT_K = 256


@dataclasses.dataclass(frozen=True)
class ArchKernels:
  """The 8-bit kernels of one architecture: ``gemm`` (operand kind ``"int8"`` / ``"fp8"`` →
  implementations in the order tried), ``quantize`` (``"pallas"`` or ``"reference"``, for
  ``quantize``, ``quantize_pair`` and ``quantize_both`` alike) and ``tested`` (implementations the
  ``gpu`` tests run there)."""

  gemm: Mapping[str, tuple[str, ...]]
  quantize: str
  tested: frozenset[str] = frozenset()


# fmt: off
KERNELS: dict[str, ArchKernels] = {
  # V100: no 8-bit tensor cores; no Pallas (Triton needs sm80).
  "sm70": ArchKernels(gemm={}, quantize="reference"),
  # T4: cuBLAS int8 through XLA; no Pallas, no fp8.
  "sm75": ArchKernels(gemm={"int8": ("xla",)}, quantize="reference"),
  # A100, A10: int8 through Triton (short contractions) or XLA; the Triton quantize kernels
  # (both-layout writes included); no fp8.
  "sm80": ArchKernels(gemm={"int8": ("pallas", "xla")}, quantize="pallas"),
  "sm86": ArchKernels(gemm={"int8": ("pallas", "xla")}, quantize="pallas"),
  # L4, L40S: as Ampere for int8; fp8 through cuBLASLt (XLA), its operands by the Triton
  # quantize kernels (e4m3 needs sm89).
  "sm89": ArchKernels(gemm={"int8": ("pallas", "xla"), "fp8": ("xla",)}, quantize="pallas"),
  # H100, H200: the Mosaic GPU kernel (wgmma), Triton for short contractions, XLA off the tile grid.
  "sm90": ArchKernels(
    gemm={"int8": ("pallas", "mosaic", "xla"), "fp8": ("pallas", "mosaic", "xla")},
    quantize="pallas",
    tested=frozenset({"pallas", "mosaic", "xla", "reference"}),
  ),
}
# fmt: on


def arch_kernels(arch: str) -> ArchKernels:
  """The table's entry for ``arch``; a newer architecture than the table knows takes the newest
  entry (its kernels compile there too, or fall back), an older one nothing 8-bit."""
  if arch in KERNELS:
    return KERNELS[arch]
  known = sorted(KERNELS, key=_number)
  return KERNELS[known[-1]] if _number(arch) > _number(known[-1]) else KERNELS[known[0]]


def _number(arch: str) -> int:
  return int(arch.removeprefix("sm"))


def eight_bit_kinds(arch: str) -> tuple[str, ...]:
  """The 8-bit operand kinds (``"int8"``, ``"fp8"``) with a GEMM on ``arch``."""
  return tuple(k for k in ("int8", "fp8") if arch_kernels(arch).gemm.get(k))


def gemm_impls(arch: str, kind: str, k: int) -> tuple[str, ...]:
  """The implementations to try, in order, for a ``kind`` GEMM contracting ``k`` on ``arch``:
  the table's list, without ``"pallas"`` when ``k > SHORT_K``; then ``"reference"``."""
  impls = arch_kernels(arch).gemm.get(kind, ())
  return tuple(i for i in impls if i != "pallas" or k <= SHORT_K) + ("reference",)
