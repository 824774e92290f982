"""Block sizes of the scaled GEMM kernel, with a heuristic default."""

from __future__ import annotations

import dataclasses

from pallas_kernels._platform import largest_pow2_divisor


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tile of one Pallas program and Triton's schedule.

  Attributes:
    block_m, block_n: output tile (powers of two dividing M and N).
    block_k: contraction step of the in-kernel loop (a power of two dividing K).
    group_m: output-tile rows walked together (grouped order, for L2 reuse).
    num_warps, num_stages: Triton warps per program and software-pipelining depth.
  """

  block_m: int = 128
  block_n: int = 256
  block_k: int = 128
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3


def default_config(m: int, n: int, k: int, itemsize: int = 1) -> GemmConfig:
  """Largest tiles up to 128×256×(128 bytes of K) that divide the problem.

  Hopper 8-bit tiles: 128×256 outputs with 8 warps and a 128-deep K step, 3 stages (48 KB
  of shared memory each). In the sweep of ``benchmarks/kernels.py --sweep`` (int8,
  16384×8192×8192, H200) it ran at 1058 TOP/s, within noise of the best (256×128×128 and
  128×256×128 with 4 stages, 1073); 128×128 tiles ran 900-940, 64-deep K steps 876,
  256×256×64 (register spills) 214. See ``docs/kernels.md``.
  """
  bm = largest_pow2_divisor(m, 128)
  bn = largest_pow2_divisor(n, 256)
  bk = largest_pow2_divisor(k, 128 // itemsize)
  warps = 8 if bm * bn >= 128 * 128 else 4
  return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=warps, num_stages=3)
