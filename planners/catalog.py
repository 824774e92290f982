"""Device catalog: datasheet peaks per precision, memory bandwidth, memory and links.

Figures are the vendors' dense datasheet peaks (TFLOP/s, TOP/s for int8; GB/s; GB). They
feed the roofline model that costs devices not at hand (``planners.modeled``); every cost
derived from them is labelled ``"modeled"``.

A roofline time is ``max(flops / (peak · derate), bytes / (bandwidth · derate))``: the
``derate`` is the fraction of the datasheet peak a real kernel reaches (T4 and L4 throttle
near 70 W, so they get a lower one).

Examples:
  >>> spec = device_spec("T4")
  >>> spec.peak_tflops["fp16"], spec.memory_gb
  (65.0, 16.0)
  >>> round(gemm_roofline_ms(spec, "fp16", 1024, 1024, 1024), 4)
  0.0644
"""

from __future__ import annotations

import dataclasses

from qsync_jax.errors import ClusterSpecError
from qsync_jax.precision import DEVICE_PRECISIONS

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}
"""Bytes per stored element of an operand at each precision."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Datasheet figures of one device type.

  Attributes:
    name: device type (a key of ``qsync_jax.precision.DEVICE_PRECISIONS``).
    peak_tflops: dense peak per supported precision (TOP/s for int8).
    mem_bw_gbps: memory bandwidth, GB/s.
    memory_gb: device memory, GB.
    link_gbytes_s: bandwidth of its fastest link to peers (NVLink / PCIe), GB/s each way.
    derate: fraction of the peaks a real kernel reaches.
    launch_us: fixed cost of one kernel launch, µs.
  """

  name: str
  peak_tflops: dict[str, float]
  mem_bw_gbps: float
  memory_gb: float
  link_gbytes_s: float
  derate: float = 0.6
  launch_us: float = 5.0

  def peak(self, precision: str) -> float:
    """Peak rate (TFLOP/s) at ``precision``; unsupported precisions raise."""
    if precision not in self.peak_tflops:
      raise ClusterSpecError(
        f"device {self.name} has no {precision!r} rate (it runs {sorted(self.peak_tflops)}). "
        "Fix: plan only supported precisions for this device group."
      )
    return self.peak_tflops[precision]


def _spec(name, fp32, tf32, fp16, bf16, int8, fp8, bw, mem, link, derate=0.6, launch_us=5.0):
  rates = {"fp32": fp32, "tf32": tf32, "fp16": fp16, "bf16": bf16, "int8": int8, "fp8": fp8}
  peak = {p: float(r) for p, r in rates.items() if r is not None and p in DEVICE_PRECISIONS[name]}
  return DeviceSpec(name, peak, float(bw), float(mem), float(link), derate, launch_us)


# fmt: off
CATALOG: dict[str, DeviceSpec] = {s.name: s for s in (
  #      name         fp32  tf32  fp16  bf16  int8  fp8   BW GB/s  mem GB  link GB/s
  # V100 has no int8 tensor cores (DP4A only) and no bf16.
  _spec("V100",       15.7, None, 125,  None, None, None,  900,    32,     300),
  _spec("T4",         8.1,  None, 65,   None, 130,  None,  320,    16,     16, derate=0.45),
  _spec("A10",        31.2, 62.5, 125,  125,  250,  None,  600,    24,     32),
  _spec("L4",         30.3, 60,   121,  121,  242,  242,   300,    24,     32, derate=0.45),
  _spec("A100",       19.5, 156,  312,  312,  624,  None,  2039,   80,     600),
  _spec("H100",       67,   495,  989,  989,  1979, 1979,  3350,   80,     900),
  _spec("H100-PCIe",  51,   378,  756,  756,  1513, 1513,  2000,   80,     64),
  # H200: H100 SXM compute, HBM3e 4.8 TB/s, 141 GB.
  _spec("H200",       67,   495,  989,  989,  1979, 1979,  4800,   141,    900),
  # A 2-core host CPU, order of magnitude only: int8/fp8 products are emulated by XLA.
  _spec("cpu",        0.1,  0.1,  0.05, 0.05, 0.05, 0.02,  20,     16,     2, derate=0.5, launch_us=20.0),
)}
# fmt: on


def device_spec(device_type: str) -> DeviceSpec:
  """The catalog entry of ``device_type``; unknown types raise ``ClusterSpecError``."""
  if device_type not in CATALOG:
    raise ClusterSpecError(
      f"device type {device_type!r} is not in the device catalog. Fix: use one of {sorted(CATALOG)}."
    )
  return CATALOG[device_type]


def roofline_ms(spec: DeviceSpec, precision: str, flops: float, nbytes: float) -> float:
  """``max(compute, memory)`` time in ms of a kernel, plus one launch."""
  compute = flops / (spec.peak(precision) * 1e12 * spec.derate)
  memory = nbytes / (spec.mem_bw_gbps * 1e9 * spec.derate)
  return 1e3 * max(compute, memory) + spec.launch_us * 1e-3


def gemm_roofline_ms(spec: DeviceSpec, precision: str, m: int, k: int, n: int, batch: int = 1) -> float:
  """Roofline time of a ``batch × (m×k)·(k×n)`` product with operands stored at ``precision``."""
  flops = 2.0 * batch * m * k * n
  nbytes = batch * ((m * k + k * n) * BYTES[precision] + m * n * 4)
  return roofline_ms(spec, precision, flops, nbytes)


def allreduce_ms(nbytes: float, n_devices: int, link_gbps: float, latency_us: float = 10.0) -> float:
  """Ring all-reduce time in ms: ``2(n−1)/n · bytes / bandwidth + latency`` (0 for n ≤ 1).

  ``link_gbps`` is in Gbit/s, as ``qsync_jax.cluster.DeviceGroup.link_gbps`` (NICs are quoted so).
  """
  if n_devices <= 1:
    return 0.0
  return 1e3 * 2.0 * (n_devices - 1) / n_devices * nbytes / (link_gbps * 1e9 / 8) + latency_us * 1e-3
