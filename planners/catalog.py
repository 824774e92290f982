"""The roofline that costs a product on a device type from its datasheet figures (the device
table, ``qsync_jax.devices.DEVICES``). A product costs ``max(compute, memory) + launch``:
compute is its time ``t`` at ``peak · derate`` times the share of SMs its output tiles keep busy
(``parallel_fraction``), over ``gemm_efficiency(t)`` (× ``CONV_EFFICIENCY`` for a convolution);
memory its operands at the precision's width and its fp32 output at ``bandwidth ·
MEMORY_EFFICIENCY``. Quantization kernels stream their bytes at ``bandwidth ·
QUANTIZE_EFFICIENCY`` (``quantize_ms``). Costs from it are labelled ``"modeled"``;
``docs/catalog.md`` gives each constant's source (the fitted ones: 1 × H100 measurements, carried
to other devices by their datasheet figures, where they are estimates) and the check.

  >>> from qsync_jax.devices import device
  >>> spec = device("T4")
  >>> spec.peak_tflops["fp16"], spec.sm_count, round(gemm_roofline_ms(spec, "fp16", 1024, 1024, 1024), 4)
  (65.0, 40, 0.0807)
"""

from __future__ import annotations

import math

from qsync_jax.devices import DeviceType
from qsync_jax.precision import QUANTIZED_PRECISIONS

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}  # per stored element
# gemm_efficiency(t) = GEMM_EFFICIENCY_MAX · t / (t + GEMM_HALF_US): least-squares fit to the H100
# in-step dense / dense_general op times (benchmarks/results/roofline/h100_device_clock.json, fp32
# and bf16; docs/catalog.md).
GEMM_EFFICIENCY_MAX = 0.82
GEMM_HALF_US = 7.0
# A convolution's rate relative to a GEMM of its m, k, n (cuDNN implicit GEMM; fit to ResNet-50's
# H100 in-step convolution times, same file).
CONV_EFFICIENCY = 0.61
# Share of the datasheet bandwidth a streaming kernel sustains (STREAM-like copies on HBM / GDDR6).
MEMORY_EFFICIENCY = 0.9
# Share of the datasheet bandwidth the quantize kernels sustain over the bytes each of their passes
# reads and writes: the median over the 8-bit steps measured by kernel category on an H200 (int8 and
# fp8 GPT d 768-4096, Llama d 2048) of the share at which this model's quantize passes take the
# measured quantize kernel time (benchmarks.diagnosis.catalog_check --quantize-efficiency;
# docs/catalog.md).
QUANTIZE_EFFICIENCY = 0.56
# Output tile (rows, columns) one SM computes: the usual CUTLASS / cuBLAS tensor-core tiles.
TILE = {"8-bit": (128, 256), "other": (128, 128)}
# Fewer output tiles than SMs: the contraction is split over idle SMs (split-K), each split this deep.
SPLIT_K_DEPTH = 256


def memory_ms(spec: DeviceType, nbytes: float) -> float:
  """ms to stream ``nbytes`` through the device's memory (no launch)."""
  return 1e3 * nbytes / (spec.mem_bw_gbps * 1e9 * MEMORY_EFFICIENCY)


def quantize_ms(spec: DeviceType, nbytes: float) -> float:
  """ms of quantization kernels that read and write ``nbytes`` in all (no launch)."""
  return 1e3 * nbytes / (spec.mem_bw_gbps * 1e9 * QUANTIZE_EFFICIENCY)


def gemm_efficiency(t_us: float) -> float:
  """Share of the peak of the SMs it keeps busy that a library GEMM sustains, for a product
  that takes ``t_us`` µs there at that peak: ``GEMM_EFFICIENCY_MAX · t / (t + GEMM_HALF_US)``
  (a product of a few µs pays its fixed prologue, pipeline fill and tail on top of its flops)."""
  return GEMM_EFFICIENCY_MAX * t_us / (t_us + GEMM_HALF_US)


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
  flops = 2.0 * batch * m * k * n
  busy_peak = (
    spec.peak_tflops[precision] * 1e12 * spec.derate * parallel_fraction(spec, precision, m, k, n, batch)
  )
  t_us = 1e6 * flops / busy_peak
  compute = 1e-3 * t_us / (gemm_efficiency(t_us) * (CONV_EFFICIENCY if conv else 1.0))
  return max(compute, memory_ms(spec, (lhs + rhs) * BYTES[precision] + out * 4)) + spec.launch_us * 1e-3
