"""``benchmarks/diagnosis/step_drift.py``: several executables of the same steps, timed round by round."""

import json
import types

import numpy as np
import pytest

from benchmarks.diagnosis import step_drift


def test_each_preset_is_compiled_as_often_as_asked_and_the_others_once():
  got = step_drift.executables(["bf16"], 3, ["fp32", "bf16", "int8"])
  assert list(got) == ["bf16#1", "bf16#2", "bf16#3", "fp32#1", "int8#1"]
  assert {p.default.fwd for p in got.values()} == {"bf16", "fp32", "int8"}


@pytest.mark.standard_promotion  # optax's Adam in the timed step
def test_the_script_times_every_executable_against_the_first_copy_of_its_preset(tmp_path, capsys):
  results = tmp_path / "drift.jsonl"
  argv = ["--presets", "bf16", "--compiles", "2", "--others", "fp32", "--rounds", "2", "--repeats", "2"]
  assert step_drift.main([*argv, "--results", str(results), "--run", "t"]) == 0
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  assert [r["case"] for r in rows] == ["mlp/bf16#1", "mlp/bf16#2", "mlp/fp32#1"]
  by = {r["case"]: r for r in rows}
  for r in rows:
    assert len(r["rounds"]) == 2 and r["value"] == pytest.approx(float(np.median(r["rounds"])))
    assert r["metric"] == "step_ms_cpu_clock" and r["run"] == "t"
  assert by["mlp/bf16#1"]["ratio"] == 1.0 and by["mlp/fp32#1"]["ratio"] == 1.0
  assert by["mlp/bf16#2"]["baseline"] == by["mlp/bf16#1"]["value"]
  out = capsys.readouterr().out
  assert "bf16#2" in out and "# round 2/2" in out
  with pytest.raises(SystemExit, match="at least 1"):
    step_drift.main(["--compiles", "0", "--no-save"])


def test_a_round_line_carries_the_gpu_state_where_nvidia_smi_answers(monkeypatch, capsys):
  def no_smi(*args, **kwargs):
    raise OSError("nvidia-smi: not found")

  monkeypatch.setattr(step_drift.subprocess, "run", no_smi)
  assert step_drift.gpu_state() == ""
  step_drift.progress("round 1/2, cpu: bf16#1 1.50")
  monkeypatch.setattr(
    step_drift.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="1980 MHz, 400.1 W, 45\n")
  )
  step_drift.progress("round 2/2, pipelined: bf16#1 1.50")
  step_drift.progress("compiled bf16#1")  # not a round: no query
  assert capsys.readouterr().out.splitlines() == [
    "# round 1/2, cpu: bf16#1 1.50",
    "# round 2/2, pipelined: bf16#1 1.50 | GPU 1980 MHz, 400.1 W, 45",
    "# compiled bf16#1",
  ]


@pytest.mark.standard_promotion  # optax's Adam in the timed step
def test_a_late_copy_runs_the_second_half_of_the_rounds_against_the_first_copy_in_them(tmp_path, capsys):
  results = tmp_path / "drift.jsonl"
  argv = ["--presets", "bf16", "--compiles", "1", "--others", "--rounds", "3", "--repeats", "2", "--late"]
  assert step_drift.main([*argv, "--results", str(results)]) == 0
  by = {r["case"]: r for r in map(json.loads, results.read_text().splitlines())}
  assert list(by) == ["mlp/bf16#1", "mlp/bf16#late"]
  first, late = by["mlp/bf16#1"], by["mlp/bf16#late"]
  assert len(first["rounds"]) == 3 and len(late["rounds"]) == 2  # compiled after round 1 of 3
  assert late["baseline"] == pytest.approx(float(np.median(first["rounds"][1:])))
  out = capsys.readouterr().out
  assert "# compiled bf16#late" in out and "# round 1/3" in out and "# round 3/3" in out
  assert out.index("# round 1/3") < out.index("# compiled bf16#late") < out.index("# round 2/3")
  with pytest.raises(SystemExit, match="2 with --late"):
    step_drift.main(["--rounds", "1", "--late", "--no-save"])
