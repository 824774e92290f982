"""The device table: ``device_kind`` strings of real GPUs map to their type, exactly, or to a
named error; every type has the facts the rest of the code reads."""

import types

import pytest

from qsync_jax.devices import (
  DEVICE_PRECISIONS,
  DEVICES,
  device,
  device_type_of,
  device_type_of_kind,
  supported_precisions,
)
from qsync_jax.errors import ClusterSpecError, UnsupportedPrecisionError
from qsync_jax.precision import PRECISIONS

# (device_kind as jax reports it, type) — strings from nvidia-smi / jax.Device.device_kind.
KINDS = [
  ("NVIDIA H100 80GB HBM3", "H100"),
  ("NVIDIA H100 PCIe", "H100-PCIe"),
  ("NVIDIA H200", "H200"),
  ("Tesla T4", "T4"),
  ("NVIDIA L4", "L4"),
  ("NVIDIA L40S", "L40S"),
  ("NVIDIA A100-SXM4-80GB", "A100"),
  ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
  ("NVIDIA A100-PCIE-40GB", "A100-PCIe"),
  ("NVIDIA A10", "A10"),
  ("Tesla V100-SXM2-32GB", "V100"),
  ("Tesla V100-SXM2-16GB", "V100"),
]
# Kinds with no entry: each must be a named error, never a near match (an L40 is not an L4,
# an A10G not an A10, an H100 NVL not an H100 SXM).
UNKNOWN = ["NVIDIA L40", "NVIDIA A10G", "NVIDIA H100 NVL", "Tesla V100-PCIE-16GB", "NVIDIA A100 80GB PCIe", "AMD"]


@pytest.mark.parametrize("kind, expected", KINDS)
def test_real_device_kinds_map_to_their_type(kind, expected):
  assert device_type_of_kind(kind) == expected
  assert device_type_of(types.SimpleNamespace(platform="gpu", device_kind=kind)) == expected


@pytest.mark.parametrize("kind", UNKNOWN)
def test_unknown_kinds_are_a_named_error(kind):
  with pytest.raises(ClusterSpecError, match=rf"GPU '{kind}' has no entry.*Fix: .*--simulate-device-types"):
    device_type_of_kind(kind)


def test_a_cpu_device_is_the_cpu_type():
  assert device_type_of(types.SimpleNamespace(platform="cpu", device_kind="cpu")) == "cpu"


def test_each_kind_names_one_type():
  kinds = [k for d in DEVICES.values() for k in d.kinds]
  assert len(kinds) == len(set(kinds))


def test_every_type_has_its_facts():
  for name, d in DEVICES.items():
    assert d.name == name and set(d.precisions) <= set(PRECISIONS) and "fp32" in d.precisions
    assert set(d.peak_tflops) == set(d.precisions) and all(r > 0 for r in d.peak_tflops.values()), name
    assert d.mem_bw_gbps > 0 and d.memory_gb > 0 and d.sm_count > 0 and d.link_gbytes_s > 0
    assert DEVICE_PRECISIONS[name] == d.precisions == supported_precisions(name)


def test_unknown_types_are_named_errors():
  with pytest.raises(ClusterSpecError, match=r"device type 'B200' is unknown.*Fix: use one of"):
    device("B200")
  with pytest.raises(UnsupportedPrecisionError, match=r"device type 'B200' is unknown"):
    supported_precisions("B200")
