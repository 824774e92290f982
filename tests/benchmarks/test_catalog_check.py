"""``benchmarks/diagnosis/catalog_check.py``: which committed e2e rows it compares against."""

import json

import pytest

from benchmarks.diagnosis import catalog_check


def _row(case, value, device="NVIDIA H100 80GB HBM3", metric="step_ms"):
  return {"case": case, "metric": metric, "value": value, "device": device}


def test_measured_steps_are_the_medians_of_the_devices_rows_of_the_compared_policies(tmp_path):
  rows = [
    _row("gpt/d768/plain", 12.0),
    _row("gpt/d768/plain", 14.0),
    _row("gpt/d768/plain", 13.5),
    _row("gpt/d768/int8_dense", 15.0),
    _row("gpt/d768/fp8_dense", 9.0),  # another policy
    _row("gpt/d768/plain", 1.0, device="NVIDIA H200"),  # another device
    _row("gpt/d768/plain", 2.0, metric="compile_s"),  # another metric
    _row("gpt/d768/plain_cudnn_attn", 3.0),  # fused attention, without its int8 cell here
  ]
  path = tmp_path / "e2e.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  measured = catalog_check.measured_steps("H100", str(path))
  assert measured == {(768, "plain"): 13.5, (768, "int8_dense"): 15.0, (768, "plain_cudnn_attn"): 3.0}
  assert catalog_check.measured_steps("H200", str(path)) == {(768, "plain"): 1.0}
  # a pair needs both policies measured: the fused one is not compared until its int8 cell is
  assert catalog_check.measured_pairs(measured) == {
    (768, "unfused"): {"plain": "plain", "int8_dense": "int8_dense"}
  }
  measured[1024, "bf16_fused_attn"] = 9.0
  measured[1024, "int8_dense_fused_attn"] = 11.0
  assert catalog_check.measured_pairs(measured)[1024, "fused"] == {
    "plain": "bf16_fused_attn",
    "int8_dense": "int8_dense_fused_attn",
  }


def test_a_device_without_measured_rows_is_refused_with_the_fix():
  with pytest.raises(
    SystemExit, match=r"--device T4: .* has no pair of cells .*Fix: run `python -m benchmarks.e2e`"
  ):
    catalog_check.main(["--device", "T4"])
