"""``benchmarks/diagnosis/cross_compile.py``'s bookkeeping (the compiles themselves need XLA's GPU
compiler, which the CPU jaxlib lacks)."""

import pytest

from benchmarks.diagnosis import cross_compile as cc

# A compiled module's text as XLA:GPU prints it: fp8 operands widened to f16 for cuBLAS, and a
# consumer of the GEMM whose line names it (not a GEMM itself)
WIDENED = """
  %a.1 = f8e4m3fn[256,512]{1,0} parameter(0)
  %wrapped_convert = f16[256,512]{1,0} fusion(%a.1), kind=kLoop, calls=%wrapped_convert_computation
  %wrapped_convert.1 = f16[256,512]{1,0} fusion(%b.1), kind=kLoop, calls=%wrapped_convert_computation.1
  %custom-call.1 = (f32[256,256]{1,0}, s8[4194304]{0}) custom-call(%wrapped_convert, %wrapped_convert.1), custom_call_target="__cublas$lt$matmul", backend_config={}
  ROOT %multiply_fusion = bf16[256,256]{1,0} fusion(%get-tuple-element, %c), kind=kLoop, calls=%fused_gemm_fusion_user
"""
TRITON_GEMM = """
  %a.1 = s8[256,512]{1,0} parameter(0)
  %b.1 = s8[256,512]{1,0} parameter(1)
  %gemm_fusion_dot.1 = s32[256,256]{1,0} fusion(%a.1, %b.1), kind=kCustom, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %convert_fusion = bf16[256,256]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_convert
"""


def _case(name):
  return next(c for c in cc.CASES if c.name == name)


@pytest.mark.parametrize(
  "arch, name, want",
  [
    ("sm75", "int8xint8 GEMM K=512, xla", True),
    ("sm75", "int8xint8 GEMM K=256, pallas", False),
    ("sm75", "quantize int8 per row, reference", True),
    ("sm75", "quantize int8 per row, pallas", False),
    ("sm80", "int8xint8 GEMM K=256, pallas", True),
    ("sm80", "quantize e5m2 per row, pallas", False),  # no fp8 kind on sm80
    ("sm89", "e4m3xe4m3 GEMM K=256, pallas", False),  # fp8 through XLA only on sm89
    ("sm89", "e4m3xe4m3 GEMM K=512, xla", True),
    ("sm90", "e4m3xe4m3 GEMM K=512, mosaic", True),
    ("sm75", "quantize_both int8 per row (both GEMM layouts), pallas", False),  # jnp reference there
    ("sm80", "quantize_both int8 per col (both GEMM layouts), pallas", True),
    ("sm86", "quantize_both e4m3 per row (both GEMM layouts), pallas", False),  # e4m3 needs sm89
    ("sm89", "quantize_both e4m3 per col (both GEMM layouts), pallas", True),
  ],
)
def test_in_table_follows_the_architecture_table(arch, name, want):
  assert cc.in_table(arch, _case(name)) is want


def test_every_case_has_a_distinct_name():
  assert len({c.name for c in cc.CASES}) == len(cc.CASES)


def test_target_config_describes_the_architectures_gpu():
  text = cc.target_config("sm89")
  for line in (
    "cuda_compute_capability { major: 8 minor: 9 }",
    "core_count: 58",
    "shared_memory_per_block_optin: 101376",
    'device_description_str: "NVIDIA L4"',
  ):
    assert line in text
  with pytest.raises(ValueError, match="sm70"):
    cc.target_config("sm70")


def test_gemm_operands_are_what_the_compiled_gemm_reads():
  assert cc.gemm_operands(WIDENED) == ["f16", "f16"]
  assert cc.gemm_operands(TRITON_GEMM) == ["s8", "s8"]
  assert cc.program_kernels(WIDENED) == ["__cublas$lt$matmul"]
  assert cc.program_kernels(TRITON_GEMM) == ["__triton_nested_gemm_fusion"]


def test_first_error_takes_the_compilers_message_not_the_driver_noise():
  stderr = (
    "E1128 cuda_platform.cc:57] failed call to cuInit: INTERNAL: CUDA error\n"
    "loc(hopper.py:101:9): error: 'nvvm.wgmma.fence.aligned' op is not supported on sm_80\n"
    "INTERNAL: Pass pipeline failed"
  )
  assert cc.first_error(stderr) == "error: 'nvvm.wgmma.fence.aligned' op is not supported on sm_80"
  assert cc.first_error("") == "no output"


def test_rows_carry_the_arch_paths_fields():
  results = {
    "int8xint8 GEMM K=512, xla": {
      "ok": True,
      "kernels": ["__cublas$lt$matmul"],
      "gemm_operands": ["s8", "s8"],
    }
  }
  [row] = cc.rows("sm75", results, "0.10.2")
  assert row["arch"] == "sm75" and row["impl"] == "xla" and row["ok"] and row["in_table"]
  assert row["ratio_vs_bf16"] is None and row["compiled_for"].startswith("sm75 (XLA:GPU device-less compile")
  assert row["gemm_operands"] == ["s8", "s8"] and row["benchmark"] == "arch_paths"
