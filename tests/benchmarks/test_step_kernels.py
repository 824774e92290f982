"""``benchmarks/diagnosis/step_kernels.py`` end to end on the CPU, with the GPU trace faked (the CPU
has none)."""

import json

import pytest

from benchmarks.common.kernel_summary import KernelSummary
from benchmarks.diagnosis import step_kernels

FAKE = KernelSummary(
  ms=2.0,
  kernels=10.0,
  gemm_ms=1.5,
  gemm_kernels=4.0,
  comm_ms=0.0,
  top=(("nvjet_sm90_x", 1.5), ("loop_add", 0.5)),
)


@pytest.mark.standard_promotion  # optax's Adam in the timed step
def test_rows_of_the_steps_and_the_standalone_programs(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(step_kernels, "gpu_kernels", lambda run, repeats: (run(), FAKE)[1])
  results = tmp_path / "rows.jsonl"
  argv = ["--models", "mlp", "--policies", "fp32", "bf16", "--repeats", "2", "--ops", "1"]
  assert step_kernels.main([*argv, "--results", str(results), "--top-dir", str(tmp_path / "top")]) == 0
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  steps = {(r["case"], r["metric"]): r for r in rows if r["case"].count("/") == 1}
  assert steps[("mlp/bf16", "gap_ms")]["value"] == pytest.approx(
    steps[("mlp/bf16", "wall_ms")]["value"] - 2.0
  )
  assert steps[("mlp/bf16", "other_kernel_ms")]["value"] == pytest.approx(0.5)
  assert steps[("mlp/bf16", "kernel_ms")]["ratio"] == pytest.approx(1.0)  # against fp32's, faked alike
  programs = [r for r in rows if r["metric"] == "program_gemm_kernel_ms"]
  assert {r["case"] for r in programs} == {
    f"mlp/Dense_0:dense/{p}/{g}" for p in ("fp32", "bf16") for g in ("fwd", "fwd+bwd")
  }
  assert programs[0]["ratio"] == pytest.approx(0.75) and programs[0]["top"][0][0] == "nvjet_sm90_x"
  assert json.load(open(tmp_path / "top" / "mlp_bf16.json"))["top"][0] == ["nvjet_sm90_x", 1.5]
  assert "nvjet_sm90_x" in capsys.readouterr().out
