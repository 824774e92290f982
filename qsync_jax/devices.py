"""The device table: one entry per device type — which ``device_kind`` strings name it, its CUDA
architecture, which precisions it runs, and its datasheet figures.

A type runs its tensor cores' 16- and 32-bit formats (from its datasheet) and the 8-bit formats
that have an implemented kernel on its architecture (``pallas_kernels.arch.KERNELS``): the
planner never plans a precision without one.

Every part of qsync-jax that needs a fact about a device type reads it here: the cluster spec
(known types), precision policies (what a group may run), the trainer (which GPU is which
type), the profiler (the local device's type) and the planner's catalog (the roofline's peaks).

A GPU is matched by its exact ``device_kind`` (``jax.Device.device_kind``), never by a
substring, so an "NVIDIA L40" is not taken for an L4 nor a 40 GB A100 for the 80 GB one:

  >>> device_type_of_kind("NVIDIA H100 80GB HBM3"), device_type_of_kind("Tesla T4")
  ('H100', 'T4')
  >>> DEVICES["T4"].peak_tflops["int8"], DEVICES["T4"].sm_count
  (130.0, 40)

Peaks are dense (datasheets quote the 16- and 8-bit rates "with sparsity" at twice these),
TFLOP/s (TOP/s for int8); bandwidth GB/s; memory GB; ``link_gbytes_s`` the fastest link to
peers, both directions as datasheets quote it.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.arch import eight_bit_kinds
from qsync_jax.errors import ClusterSpecError, UnsupportedPrecisionError
from qsync_jax.precision import LEGS, PRECISIONS, OpPolicy


@dataclasses.dataclass(frozen=True)
class DeviceType:
  """One device type. ``kinds``: the exact ``device_kind`` strings of its GPUs; ``arch``: its CUDA
  architecture (None for the CPU); ``precisions``: what it runs (its tensor cores' dense 16- and
  32-bit formats and the 8-bit formats its architecture has a kernel for; the CPU runs every
  precision through the jnp references); ``peak_tflops`` per precision it runs; ``sm_count`` (cores for the CPU);
  ``derate``: the share of its peaks it sustains (its clock under load); ``launch_us``: the
  fixed cost of one kernel; ``checked``: the precisions at which the catalog's modeled step
  times were compared with measured ones on this type (``docs/catalog.md``) — at the others its
  figures are datasheet estimates."""

  name: str
  kinds: tuple[str, ...]
  arch: str | None
  precisions: tuple[str, ...]
  peak_tflops: dict[str, float]
  mem_bw_gbps: float
  memory_gb: float
  link_gbytes_s: float
  sm_count: int
  derate: float = 1.0
  launch_us: float = 5.0
  checked: tuple[str, ...] = ()


_AMPERE = ("fp32", "tf32", "bf16", "fp16")  # float formats of Ampere and newer tensor cores


def _device(
  name,
  kinds,
  arch,
  floats,
  fp32,
  tf32,
  half,
  eight,
  bw,
  mem,
  link,
  sms,
  derate=1.0,
  launch_us=5.0,
  checked=(),
):
  runs = set(floats) | set(eight_bit_kinds(arch) if arch else ("int8", "fp8"))
  precisions = tuple(p for p in PRECISIONS if p in runs)
  rates = {"fp32": fp32, "tf32": tf32, "fp16": half, "bf16": half, "int8": eight, "fp8": eight}
  peak = {p: float(rates[p]) for p in precisions}
  figures = (float(bw), float(mem), float(link), sms, derate, launch_us, tuple(checked))
  return DeviceType(name, kinds, arch, precisions, peak, *figures)


# fmt: off
DEVICES: dict[str, DeviceType] = {d.name: d for d in (
  #        name         device_kind strings          arch    float formats     fp32  tf32  16-bit 8-bit  GB/s  GB   link SMs
  # NVIDIA V100 datasheet, SXM2: FP32 15.7, Tensor 125; 900 GB/s; NVLink 300; 80 SMs (Volta whitepaper).
  _device("V100",      ("Tesla V100-SXM2-32GB", "Tesla V100-SXM2-16GB"), "sm70", ("fp32", "fp16"),
                                                                                           15.7, 0,    125,   0,     900,  32,  300, 80),
  # NVIDIA T4 datasheet: FP32 8.1, FP16 65, INT8 130; 320 GB/s; 16 GB; PCIe3 32; 40 SMs. 70 W: throttles.
  _device("T4",        ("Tesla T4",),              "sm75", ("fp32", "fp16"), 8.1,  0,    65,    130,   320,  16,  32,  40, derate=0.75),
  # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125, INT8 250; 600 GB/s; 24 GB; PCIe4 64; 72 SMs.
  _device("A10",       ("NVIDIA A10",),            "sm86", _AMPERE,          31.2, 62.5, 125,   250,   600,  24,  64,  72),
  # NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121, FP8/INT8 242.5; 300 GB/s; 24 GB; 58 SMs. 72 W.
  _device("L4",        ("NVIDIA L4",),             "sm89", _AMPERE,          30.3, 60,   121,   242.5, 300,  24,  64,  58, derate=0.75),
  # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362, FP8/INT8 733; 864 GB/s; 48 GB; 142 SMs.
  _device("L40S",      ("NVIDIA L40S",),           "sm89", _AMPERE,          91.6, 183,  362,   733,   864,  48,  64,  142),
  # NVIDIA A100 datasheet, 80GB SXM: FP32 19.5, TF32 156, BF16/FP16 312, INT8 624; 2039 GB/s; 108 SMs.
  _device("A100",      ("NVIDIA A100-SXM4-80GB",), "sm80", _AMPERE,          19.5, 156,  312,   624,   2039, 80,  600, 108),
  # NVIDIA A100 datasheet, 40GB SXM: the 80GB rates; 1555 GB/s; 40 GB; NVLink 600; 108 SMs.
  _device("A100-40GB", ("NVIDIA A100-SXM4-40GB",), "sm80", _AMPERE,          19.5, 156,  312,   624,   1555, 40,  600, 108),
  # NVIDIA A100 datasheet, 40GB PCIe: the SXM rates; 1555 GB/s; 40 GB; PCIe4 64; 108 SMs.
  _device("A100-PCIe", ("NVIDIA A100-PCIE-40GB",), "sm80", _AMPERE,          19.5, 156,  312,   624,   1555, 40,  64,  108),
  # NVIDIA H100 datasheet, SXM5: FP32 67, TF32 495, BF16/FP16 989, FP8/INT8 1979; 3.35 TB/s; 132 SMs.
  _device("H100",      ("NVIDIA H100 80GB HBM3",), "sm90", _AMPERE,          67,   495,  989,   1979,  3350, 80,  900, 132, checked=("fp32", "bf16")),
  # NVIDIA H100 datasheet, PCIe: FP32 51, TF32 378, BF16/FP16 756, FP8/INT8 1513; 2 TB/s; 114 SMs.
  _device("H100-PCIe", ("NVIDIA H100 PCIe",),      "sm90", _AMPERE,          51,   378,  756,   1513,  2000, 80,  128, 114),
  # NVIDIA H200 datasheet, SXM: the H100 SXM's rates; 4.8 TB/s HBM3e; 141 GB; NVLink 900 GB/s; 132 SMs.
  _device("H200",      ("NVIDIA H200",),           "sm90", _AMPERE,          67,   495,  989,   1979,  4800, 141, 900, 132),
  # A 2-core host CPU, order of magnitude only: int8/fp8 products are emulated by XLA.
  _device("cpu",       (),                         None,   PRECISIONS,       0.1,  0.1,  0.05,  0.03,  20,   16,  2,   2, launch_us=20.0),
)}
# fmt: on

DEVICE_PRECISIONS: dict[str, tuple[str, ...]] = {name: d.precisions for name, d in DEVICES.items()}
"""Which precisions each device type can run (``DEVICES[name].precisions``)."""


def device(device_type: str) -> DeviceType:
  """The table's entry for ``device_type``; an unknown type raises ``ClusterSpecError``."""
  if device_type not in DEVICES:
    raise ClusterSpecError(f"device type {device_type!r} is unknown. Fix: use one of {sorted(DEVICES)}.")
  return DEVICES[device_type]


def device_type_of_kind(device_kind: str) -> str:
  """The device type whose ``kinds`` hold ``device_kind`` exactly; else ``ClusterSpecError``
  naming the known kinds."""
  for d in DEVICES.values():
    if device_kind in d.kinds:
      return d.name
  known = sorted(k for d in DEVICES.values() for k in d.kinds)
  raise ClusterSpecError(
    f"GPU {device_kind!r} has no entry in the device table (qsync_jax.devices.DEVICES; it knows {known}). "
    "Fix: run its group with --simulate-device-types (it then stands in for its group's device_type), "
    "or add an entry with its datasheet figures."
  )


def device_type_of(device) -> str:
  """The device type of a ``jax.Device``: ``"cpu"`` for a CPU device, else by its ``device_kind``
  (``device_type_of_kind``)."""
  return "cpu" if device.platform == "cpu" else device_type_of_kind(device.device_kind)


def supported_precisions(device_type: str) -> tuple[str, ...]:
  """Precisions ``device_type`` supports; raises with the known types if it is unknown."""
  if device_type not in DEVICES:
    raise UnsupportedPrecisionError(
      f"device type {device_type!r} is unknown. Fix: use one of {sorted(DEVICES)}."
    )
  return DEVICES[device_type].precisions


SIXTEEN_BIT_ORDER = ("bf16", "fp16", "fp32")
"""The default training precision of a device type: the first of these it runs (bf16 mixed
precision on Ampere and newer and on the CPU; fp16 mixed precision, with dynamic loss scaling,
on a V100 or a T4, whose tensor cores have no bf16; else fp32)."""


def training_precision(device_types) -> str:
  """The preset a group of each of ``device_types`` trains at by default: the first of
  ``SIXTEEN_BIT_ORDER`` that every one of them runs.

  >>> training_precision(["A100"]), training_precision(["A100", "T4"]), training_precision(["cpu"])
  ('bf16', 'fp16', 'bf16')
  """
  return next(p for p in SIXTEEN_BIT_ORDER if all(p in supported_precisions(t) for t in device_types))


def check_op_policy_on_device(op_policy: OpPolicy, device_type: str, context: str) -> None:
  """Raises ``UnsupportedPrecisionError`` if a leg of ``op_policy`` is unsupported."""
  supported = supported_precisions(device_type)
  for leg in LEGS:
    precision = getattr(op_policy, leg)
    if precision not in supported:
      raise UnsupportedPrecisionError(
        f"{context}: {leg}={precision!r} is not supported on {device_type} "
        f"(it supports {list(supported)}). Fix: choose one of those for {leg}, "
        "or plan this op for another device group."
      )
