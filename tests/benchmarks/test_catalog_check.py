"""``benchmarks/diagnosis/catalog_check.py``: which committed e2e rows it compares against."""

import json

import pytest

from benchmarks.diagnosis import catalog_check
from planners import catalog


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


def test_the_quantize_cells_are_the_latest_category_rows_of_each_8_bit_cell(tmp_path):
  def row(case, ms, date, device="NVIDIA H200", categories=True):
    out = {**_row(case, 20.0, device), "date": date}
    if categories:
      out["categories"] = {"quantize": {"ms": ms, "launches": 200}, "gemm": {"ms": 9.0, "launches": 50}}
    return out

  rows = [
    row("gpt/d2048/int8_dense_fused_attn", 5.2, "2026-11-29T07:09:00+00:00"),
    row("gpt/d2048/int8_dense_fused_attn", 5.5, "2026-11-29T07:11:00+00:00"),  # the latest: taken
    row("gpt/d2048/int8_dense_fused_attn", 9.9, "2026-11-29T08:00:00+00:00", categories=False),
    row("llama/d2048/fp8_dense_fused_attn", 4.2, "2026-11-29T07:20:00+00:00"),
    row("gpt/d2048/plain_cudnn_attn", 0.0, "2026-11-29T07:11:00+00:00"),  # not 8-bit
    row("gpt/d2048/int8_dense", 6.0, "2026-11-29T07:11:00+00:00"),  # unfused attention
    row("gpt/d2048/fp8_dense_fused_attn", 4.0, "2026-11-29T07:11:00+00:00", device="NVIDIA H100 80GB HBM3"),
  ]
  path = tmp_path / "e2e.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert catalog_check.measured_quantize_ms("H200", str(path)) == {
    ("gpt", 2048, "int8_dense_fused_attn"): 5.5,
    ("llama", 2048, "fp8_dense_fused_attn"): 4.2,
  }


@pytest.mark.standard_promotion  # the bf16 e2e models mix dtypes as Flax does by default
def test_the_catalogs_quantize_efficiency_is_derived_from_the_committed_h200_steps():
  # the share is the one at which the catalog's own passes take the measured time: costed at it,
  # every cell's modeled quantize time is the measured one
  shares = catalog_check.quantize_shares("H200")
  measured = catalog_check.measured_quantize_ms("H200")
  assert set(shares) == set(measured) and len(shares) >= 8
  (model, width, policy), share = next(iter(shares.items()))
  bytes_ms, launch_ms = catalog_check.modeled_quantize_ms("H200", model, width)
  at_share = bytes_ms * catalog.QUANTIZE_EFFICIENCY / share + launch_ms
  assert at_share == pytest.approx(measured[model, width, policy], rel=1e-9)
  derived = catalog_check.derived_quantize_efficiency(shares)
  assert catalog.QUANTIZE_EFFICIENCY == derived, (
    f"planners/catalog.py's QUANTIZE_EFFICIENCY {catalog.QUANTIZE_EFFICIENCY} is not the median share of "
    f"the committed H200 steps ({derived}). Fix: set it from "
    "`python -m benchmarks.diagnosis.catalog_check --quantize-efficiency --device H200` and update docs/catalog.md."
  )
