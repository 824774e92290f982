"""``benchmarks/diagnosis/kernel_categories.py``'s bookkeeping (the traces themselves need a GPU)."""

import json

import pytest

from benchmarks.diagnosis import kernel_categories as kc


@pytest.mark.parametrize(
  "name, want",
  [
    ("anonymous_mosaic_gpu_kernel", "int8_gemm"),
    ("quantize_rows_int8__4", "quantize_kernel"),
    ("nvjet_sm90_hss_192x96_64x5_1x2_h_bz_NTT", "float_gemm"),
    ("gemm_fusion_dot_79", "float_gemm"),
    ("input_add_convert_multiply_reduce_fusion_2", "reduce_fusion"),
    ("loop_add_fusion_7", "elementwise"),
  ],
)
def test_kernels_fall_in_the_first_matching_category(name, want):
  assert kc.category(name) == want


def test_rows_put_each_step_category_against_the_programs_sum(tmp_path, capsys):
  results = {
    "int8": {
      "step": {"int8_gemm": (1.4, 76.0), "elementwise": (2.7, 555.0)},
      "programs": {"int8_gemm": (1.3, 78.0)},
    }
  }
  rows = kc.rows("lm", results, "H100")
  step = {r["case"]: r for r in rows if r["metric"] == "step_kernel_ms"}
  assert step["lm/int8/int8_gemm"]["baseline"] == 1.3 and step["lm/int8/int8_gemm"]["kernels"] == 76.0
  assert step["lm/int8/elementwise"]["baseline"] is None  # no such kernels in the programs
  kc.print_table(results)
  assert "step - programs 2.800 ms" in capsys.readouterr().out
  out = tmp_path / "k.json"
  assert (
    kc.main(
      ["--model", "mlp", "--policies", "bf16", "--results", str(tmp_path / "r.jsonl"), "--json", str(out)]
    )
    == 0
  )
  assert json.loads(out.read_text()) == {"bf16": {"step": {}, "programs": {}}}  # no GPU kernels on a CPU
