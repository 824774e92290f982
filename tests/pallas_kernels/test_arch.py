"""Kernels chosen by architecture: every 8-bit GEMM and quantize pass picks the path
``pallas_kernels.arch.KERNELS`` documents for sm70 … sm90 (a GPU's compute capability mocked on
this CPU), a kernel that does not compile falls back with one warning, and the device table's
precisions are exactly what the kernels allow."""

import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import _platform, arch
from pallas_kernels.gemm import api as gemm_api
from pallas_kernels.quantize import api as quantize_api
from pallas_kernels.quantize.reference import quantize_reference
from qsync_jax.devices import DEVICES
from tests.tolerances import TIGHT, rel_err

DIMS = (((1,), (0,)), ((), ()))

# arch -> (int8 GEMM at K 512, int8 GEMM at K 128, fp8 GEMM at K 512, quantize): the documented paths
EXPECTED = {
  "sm70": ("reference", "reference", "reference", "reference"),
  "sm75": ("xla", "xla", "reference", "reference"),
  "sm80": ("xla", "pallas", "reference", "pallas"),
  "sm86": ("xla", "pallas", "reference", "pallas"),
  "sm89": ("xla", "pallas", "xla", "pallas"),
  "sm90": ("mosaic", "pallas", "mosaic", "pallas"),
}


@pytest.fixture
def gpu_of(monkeypatch):
  """``gpu_of("sm75")``: the kernel APIs see a GPU of that architecture, on which every
  untested kernel compiles; no earlier probe is remembered."""
  monkeypatch.setattr(_platform, "_COMPILES", {})

  def use(name, compiles=True):
    for module in (gemm_api, quantize_api):
      monkeypatch.setattr(module, "on_gpu", lambda: True)
      monkeypatch.setattr(module, "gpu_arch", lambda: name)
    monkeypatch.setattr(gemm_api, "_probe", lambda impl, kind: None if compiles else _fail())
    monkeypatch.setattr(quantize_api, "_probe", lambda: None if compiles else _fail())

  return use


def _fail():
  raise RuntimeError("PTX .target sm_80 is not supported by this compiler\nmore lines")


def _chosen(kind, k):
  lhs = jnp.zeros((64, k), jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
  return gemm_api._auto(kind, lhs, DIMS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_architecture_picks_its_documented_paths(gpu_of, name):
  gpu_of(name)
  quantize = "pallas" if quantize_api.kernels_run_here() else "reference"
  assert (_chosen("int8", 512), _chosen("int8", 128), _chosen("fp8", 512), quantize) == EXPECTED[name]


def test_architectures_outside_the_table_take_their_nearest_entry():
  assert arch.arch_kernels("sm100") == arch.KERNELS["sm90"]
  assert arch.arch_kernels("sm60") == arch.KERNELS["sm70"]


@pytest.mark.parametrize("name", [n for n, d in DEVICES.items() if d.arch])
def test_the_device_tables_8bit_precisions_are_the_kernels(name):
  device = DEVICES[name]
  assert tuple(p for p in device.precisions if p in ("int8", "fp8")) == arch.eight_bit_kinds(device.arch)


def test_no_device_plans_fp8_or_int8_without_a_kernel():
  assert "int8" not in DEVICES["V100"].precisions and "fp8" not in DEVICES["T4"].precisions
  assert "fp8" not in DEVICES["A100"].precisions and "fp8" not in DEVICES["A10"].precisions
  assert {"int8", "fp8"} <= set(DEVICES["L4"].precisions) and {"int8", "fp8"} <= set(DEVICES["H100"].precisions)


def test_a_kernel_that_does_not_compile_falls_back_with_one_warning(gpu_of):
  gpu_of("sm80", compiles=False)
  with pytest.warns(RuntimeWarning, match=r"pallas int8 GEMM does not compile on this GPU \(sm80\): PTX .*sm_80") as w:
    assert _chosen("int8", 128) == "xla"
  assert len(w) == 1 and "more lines" not in str(w[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # asked once: no second warning
    assert _chosen("int8", 128) == "xla"
  with pytest.warns(RuntimeWarning, match=r"pallas quantize does not compile"):
    assert not quantize_api.kernels_run_here()


def test_a_tested_kernel_is_not_probed(gpu_of, monkeypatch):
  gpu_of("sm90", compiles=False)  # a probe would fail: none runs for the tested kernels
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _chosen("int8", 512) == "mosaic" and quantize_api.kernels_run_here()


@pytest.mark.parametrize("name, fmt", [("sm75", "int8"), ("sm80", "int8"), ("sm89", "e4m3")])
def test_the_chosen_paths_compute_the_reference(gpu_of, name, fmt):
  """A Dense product's 8-bit GEMM on the T4, A100 and L4 paths (XLA's dot) and, on sm75, the
  quantize path (the jnp reference) against the reference, here on the CPU. (The Pallas
  quantize of sm80/sm89 is ``test_quantize``'s, in interpret mode.)"""
  gpu_of(name)
  impl = "reference" if quantize_api.kernels_run_here() else "auto"
  x = jax.random.normal(jax.random.key(1), (64, 512), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (512, 96), jnp.float32)
  xq, xs = quantize_api.quantize(x, fmt, (1,), impl=impl)
  wq, ws = quantize_api.quantize(w, fmt, (0,), impl=impl)
  ref_x, ref_xs = quantize_reference(x, fmt, (1,))
  assert jnp.array_equal(xq, ref_x) and jnp.array_equal(xs, ref_xs)
  out = gemm_api.scaled_dot_general(xq, wq, xs, ws, DIMS)
  ref = gemm_api.scaled_dot_general(xq, wq, xs, ws, DIMS, impl="reference")
  assert rel_err(out, ref) < TIGHT["fp32"]
