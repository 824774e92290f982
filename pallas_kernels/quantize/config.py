"""Block sizes of the quantize kernels, with a heuristic default."""

from __future__ import annotations

import dataclasses

from pallas_kernels._platform import largest_pow2_divisor


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
  """Tile of one Pallas program.

  Attributes:
    block_rows: rows per program (a power of two).
    block_cols: columns per load (a power of two that divides the column count); the
      row kernel loops over the columns in chunks of this size, twice (absmax, then round).
    num_warps: Triton warps per program.
  """

  block_rows: int
  block_cols: int
  num_warps: int = 4


def default_config(rows: int, cols: int, mode: str) -> QuantizeConfig:
  """A tile that divides ``rows x cols``: ``mode`` is 'rows' (fused absmax) or 'tiled'."""
  if mode == "rows":
    bc = largest_pow2_divisor(cols, 1024)
    br = largest_pow2_divisor(rows, max(1, 4096 // bc))
    return QuantizeConfig(block_rows=br, block_cols=bc, num_warps=4 if br * bc <= 2048 else 8)
  bc = largest_pow2_divisor(cols, 64)
  br = largest_pow2_divisor(rows, 64)
  return QuantizeConfig(block_rows=br, block_cols=bc, num_warps=4)
