"""``benchmarks.diagnosis.memory_8bit_gpu``: the memory model's 8-bit step against the compiled peak,
run on the CPU at a model's CPU size (on a GPU it compiles the real-size steps for the device)."""

import json

import pytest

from benchmarks.diagnosis import memory_8bit_gpu


def test_an_8bit_steps_row_holds_its_compiled_peak_and_the_fitted_models_figure(tmp_path, capsys):
  results = tmp_path / "memory_8bit.jsonl"
  argv = ["--tiny", "--models", "gpt_350m", "--presets", "int8", "--results", str(results)]
  assert memory_8bit_gpu.main(argv) == 0
  (row,) = [json.loads(line) for line in results.read_text().splitlines()]
  assert (row["case"], row["metric"], row["device_type"]) == (
    "gpt_350m.tiny/int8",
    "compiled_peak_bytes",
    "cpu",
  )
  assert row["value"] > 0 and row["modeled_bytes"] == row["baseline"]
  # the model is fitted to the fp32 and bf16 peaks, so the int8 step's figure is its own prediction,
  # not a copy of either: within the 10 % the CPU memory tests hold the model to
  assert row["modeled_bytes"] not in (row["fp32_peak_bytes"], row["bf16_peak_bytes"])
  assert row["modeled_bytes"] == pytest.approx(row["value"], rel=0.10)
  assert "gpt_350m.tiny/int8" in capsys.readouterr().out
