"""Device catalog: datasheet figures per device type, and the roofline that costs a product on one.

Peaks are dense (TFLOP/s; TOP/s for int8), bandwidth GB/s, memory GB. A product costs
``max(compute, memory) + launch``: its flops at ``peak · derate · GEMM_EFFICIENCY`` (× ``CONV_EFFICIENCY``
for a convolution) times the share of SMs its output tiles keep busy (``parallel_fraction``); its
operands at the precision's width and its fp32 output at ``bandwidth · MEMORY_EFFICIENCY``. Costs
from it are labelled ``"modeled"``; ``docs/catalog.md`` gives each constant's source and the check.

  >>> spec = device_spec("T4")
  >>> spec.peak_tflops["fp16"], spec.sm_count, round(gemm_roofline_ms(spec, "fp16", 1024, 1024, 1024), 4)
  (65.0, 40, 0.0784)
"""

from __future__ import annotations

import dataclasses
import math

from qsync_jax.errors import ClusterSpecError
from qsync_jax.precision import DEVICE_PRECISIONS, QUANTIZED_PRECISIONS

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


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Datasheet figures of one device type (``name``: a key of ``DEVICE_PRECISIONS``): dense
  ``peak_tflops`` per supported precision, ``mem_bw_gbps``, ``memory_gb``, ``link_gbytes_s`` (its
  fastest link to peers, both directions as datasheets quote it), ``sm_count`` (cores for the
  CPU), ``derate`` (the share of its peaks it sustains: its clock under load) and ``launch_us``
  (the fixed cost of one kernel)."""

  name: str
  peak_tflops: dict[str, float]
  mem_bw_gbps: float
  memory_gb: float
  link_gbytes_s: float
  sm_count: int
  derate: float = 1.0
  launch_us: float = 5.0


def _spec(name, fp32, tf32, half, eight, bw, mem, link, sms, derate=1.0, launch_us=5.0):
  rates = {"fp32": fp32, "tf32": tf32, "fp16": half, "bf16": half, "int8": eight, "fp8": eight}
  peak = {p: float(rates[p]) for p in DEVICE_PRECISIONS[name]}  # the precisions the device runs
  return DeviceSpec(name, peak, float(bw), float(mem), float(link), sms, derate, launch_us)


# fmt: off
CATALOG: dict[str, DeviceSpec] = {s.name: s for s in (  # dense peaks: datasheets quote "with sparsity" at 2×
  #      name        fp32  tf32  16-bit 8-bit  GB/s  GB   link  SMs  (16-bit: fp16 and bf16; 8-bit: int8, fp8)
  # NVIDIA V100 datasheet, SXM2 32 GB: FP32 15.7, Tensor 125; 900 GB/s; NVLink 300; 80 SMs (whitepaper).
  _spec("V100",      15.7, 0,    125,   0,     900,  32,  300,  80),
  # NVIDIA T4 datasheet: FP32 8.1, FP16 65, INT8 130; 320 GB/s; 16 GB; PCIe3 32; 40 SMs. 70 W: throttles.
  _spec("T4",        8.1,  0,    65,    130,   320,  16,  32,   40, derate=0.75),
  # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125, INT8 250; 600 GB/s; 24 GB; PCIe4 64; 72 SMs.
  _spec("A10",       31.2, 62.5, 125,   250,   600,  24,  64,   72),
  # NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121, FP8/INT8 242.5; 300 GB/s; 24 GB; 58 SMs. 72 W.
  _spec("L4",        30.3, 60,   121,   242.5, 300,  24,  64,   58, derate=0.75),
  # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362, FP8/INT8 733; 864 GB/s; 48 GB; 142 SMs.
  _spec("L40S",      91.6, 183,  362,   733,   864,  48,  64,   142),
  # NVIDIA A100 datasheet, 80GB SXM: FP32 19.5, TF32 156, BF16/FP16 312, INT8 624; 2039 GB/s; 108 SMs.
  _spec("A100",      19.5, 156,  312,   624,   2039, 80,  600,  108),
  # NVIDIA H100 datasheet, SXM5: FP32 67, TF32 495, BF16/FP16 989, FP8/INT8 1979; 3.35 TB/s; 132 SMs.
  _spec("H100",      67,   495,  989,   1979,  3350, 80,  900,  132),
  # NVIDIA H100 datasheet, PCIe: FP32 51, TF32 378, BF16/FP16 756, FP8/INT8 1513; 2 TB/s; 114 SMs.
  _spec("H100-PCIe", 51,   378,  756,   1513,  2000, 80,  128,  114),
  # NVIDIA H200 datasheet, SXM: the H100 SXM's rates; 4.8 TB/s HBM3e; 141 GB; NVLink 900 GB/s; 132 SMs.
  _spec("H200",      67,   495,  989,   1979,  4800, 141, 900,  132),
  # A 2-core host CPU, order of magnitude only: int8/fp8 products are emulated by XLA.
  _spec("cpu",       0.1,  0.1,  0.05,  0.03,  20,   16,  2,    2, launch_us=20.0),
)}
# fmt: on


def device_spec(device_type: str) -> DeviceSpec:
  """The catalog entry of ``device_type``; unknown types raise ``ClusterSpecError``."""
  if device_type not in CATALOG:
    raise ClusterSpecError(
      f"device type {device_type!r} is not in the device catalog. Fix: use one of {sorted(CATALOG)}."
    )
  return CATALOG[device_type]


def memory_ms(spec: DeviceSpec, nbytes: float) -> float:
  """ms to stream ``nbytes`` through the device's memory (no launch)."""
  return 1e3 * nbytes / (spec.mem_bw_gbps * 1e9 * MEMORY_EFFICIENCY)


def parallel_fraction(spec: DeviceSpec, precision: str, m: int, k: int, n: int, batch: int = 1) -> float:
  """Share of the SMs a ``batch × (m×k)·(k×n)`` product keeps busy: its output tiles (``TILE``;
  where fewer than the SMs, split in up to ``k / SPLIT_K_DEPTH`` parts) run in waves of
  ``sm_count``, the last one partly idle."""
  rows, cols = TILE["8-bit" if precision in QUANTIZED_PRECISIONS else "other"]
  tiles = batch * math.ceil(m / rows) * math.ceil(n / cols)
  if tiles < spec.sm_count:
    tiles *= max(1, min(spec.sm_count // tiles, k // SPLIT_K_DEPTH))
  return tiles / (math.ceil(tiles / spec.sm_count) * spec.sm_count)


def gemm_roofline_ms(
  spec: DeviceSpec, precision: str, m: int, k: int, n: int, batch: int = 1, elems=None, conv: bool = False
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
