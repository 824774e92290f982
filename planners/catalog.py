"""The roofline that costs a product on a device type from its datasheet figures (the device
table, ``qsync_jax.devices.DEVICES``). A product costs
``max(compute, memory) + launch``: its flops at ``peak · derate · GEMM_EFFICIENCY`` (× ``CONV_EFFICIENCY``
for a convolution) times the share of SMs its output tiles keep busy (``parallel_fraction``); its
operands at the precision's width and its fp32 output at ``bandwidth · MEMORY_EFFICIENCY``. Costs
from it are labelled ``"modeled"``; ``docs/catalog.md`` gives each constant's source and the check.

  >>> from qsync_jax.devices import device
  >>> spec = device("T4")
  >>> spec.peak_tflops["fp16"], spec.sm_count, round(gemm_roofline_ms(spec, "fp16", 1024, 1024, 1024), 4)
  (65.0, 40, 0.0784)
"""

from __future__ import annotations

import math

from qsync_jax.devices import DeviceType
from qsync_jax.precision import QUANTIZED_PRECISIONS

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}  # per stored element
# Share of the dense peak a library GEMM sustains on a large product, tensor cores or not (cuBLAS, H100).
GEMM_EFFICIENCY = 0.75
# A convolution's rate relative to a GEMM of its m, k, n (cuDNN implicit GEMM; ResNet-50's H100 step).
CONV_EFFICIENCY = 0.5
# Share of the datasheet bandwidth a streaming kernel sustains (STREAM-like copies on HBM / GDDR6).
MEMORY_EFFICIENCY = 0.9
# Output tile (rows, columns) one SM computes: the usual CUTLASS / cuBLAS tensor-core tiles.
TILE = {"8-bit": (128, 256), "other": (128, 128)}
# Fewer output tiles than SMs: the contraction is split over idle SMs (split-K), each split this deep.
SPLIT_K_DEPTH = 256


def memory_ms(spec: DeviceType, nbytes: float) -> float:
  """ms to stream ``nbytes`` through the device's memory (no launch)."""
  return 1e3 * nbytes / (spec.mem_bw_gbps * 1e9 * MEMORY_EFFICIENCY)


def parallel_fraction(spec: DeviceType, precision: str, m: int, k: int, n: int, batch: int = 1) -> float:
  """Share of the SMs a ``batch × (m×k)·(k×n)`` product keeps busy: its output tiles (``TILE``;
  where fewer than the SMs, split in up to ``k / SPLIT_K_DEPTH`` parts) run in waves of
  ``sm_count``, the last one partly idle."""
  rows, cols = TILE["8-bit" if precision in QUANTIZED_PRECISIONS else "other"]
  tiles = batch * math.ceil(m / rows) * math.ceil(n / cols)
  if tiles < spec.sm_count:
    tiles *= max(1, min(spec.sm_count // tiles, k // SPLIT_K_DEPTH))
  return tiles / (math.ceil(tiles / spec.sm_count) * spec.sm_count)


def gemm_roofline_ms(
  spec: DeviceType, precision: str, m: int, k: int, n: int, batch: int = 1, elems=None, conv: bool = False
) -> float:
  """Roofline time of a ``batch × (m×k)·(k×n)`` product at ``precision`` (module docstring) that
  moves ``elems = (lhs, rhs, out)`` elements (default the product's own); ``conv``: a convolution."""
  lhs, rhs, out = elems or (batch * m * k, batch * k * n, batch * m * n)
  rate = (
    spec.peak_tflops[precision] * 1e12 * spec.derate * GEMM_EFFICIENCY * (CONV_EFFICIENCY if conv else 1.0)
  )
  compute = 2e3 * batch * m * k * n / (rate * parallel_fraction(spec, precision, m, k, n, batch))
  return max(compute, memory_ms(spec, (lhs + rhs) * BYTES[precision] + out * 4)) + spec.launch_us * 1e-3


def allreduce_ms(nbytes: float, n_devices: int, link_gbps: float, latency_us: float = 10.0) -> float:
  """Ring all-reduce time in ms: ``2(n−1)/n · bytes / bandwidth + latency`` (0 for n ≤ 1).

  ``link_gbps`` is in Gbit/s, as ``qsync_jax.cluster.DeviceGroup.link_gbps`` (NICs are quoted so).
  """
  if n_devices <= 1:
    return 0.0
  return 1e3 * 2.0 * (n_devices - 1) / n_devices * nbytes / (link_gbps * 1e9 / 8) + latency_us * 1e-3
