"""Block sizes of the scaled GEMM kernels (Triton and Mosaic GPU backends), with heuristic defaults."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

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
  of shared memory each); ``benchmarks/kernels.py --sweep`` times the alternatives
  (``docs/kernels.md``).
  """
  bm = largest_pow2_divisor(m, 128)
  bn = largest_pow2_divisor(n, 256)
  bk = largest_pow2_divisor(k, 128 // itemsize)
  warps = 8 if bm * bn >= 128 * 128 else 4
  return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=warps, num_stages=3)


@dataclasses.dataclass(frozen=True)
class HopperConfig:
  """Tiles of the Mosaic GPU kernel.

  Attributes:
    tile_m, tile_n: one compute warpgroup's output tile; the CTA's is ``tile_m × 2·tile_n``
      (the two compute warpgroups side by side along N).
    tile_k: contraction step (128 int8 = one 128-byte swizzle row).
    max_concurrent_steps: shared-memory buffers of the TMA pipeline.
    epi_tile_m, epi_tile_n: the output block stored per epilogue TMA copy.
    grid_tile_width: output-tile rows (or columns) walked together by the planar snake.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 128
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  grid_tile_width: int = 8


SMEM_BYTES = 232448  # shared memory a Hopper CTA may use (227 KB)


def default_hopper_config(m: int, n: int, out_dtype) -> HopperConfig:
  """128×128 tiles per warpgroup (a 128×256 CTA tile) where N allows, else 128×64; as many
  pipeline buffers (at most 6) as fit beside the epilogue's in 227 KB of shared memory: 4 with
  a bf16 output and 128-wide tiles."""
  del m  # M only needs to be a multiple of tile_m (128)
  base = HopperConfig()
  tile_n = base.tile_n if n % (2 * base.tile_n) == 0 else base.tile_n // 2
  stage = (base.tile_m + 2 * tile_n) * base.tile_k
  epilogue = 2 * 2 * base.epi_tile_m * base.epi_tile_n * jnp.dtype(out_dtype).itemsize
  steps = min(6, (SMEM_BYTES - epilogue - 1024) // stage)
  return dataclasses.replace(base, tile_n=tile_n, max_concurrent_steps=steps)
