"""``benchmarks/models.py``'s offline replay: measured steps read back from a run's rows."""

import json

import models
import pytest

from tests.benchmarks import result, write_rows


def test_steps_from_reads_the_uniform_steps_of_one_run_and_model(tmp_path):
  step = "step_ms_median"
  path = write_rows(
    tmp_path / "models.jsonl",
    [
      result("r1", "lm_base/bf16", step, 5.2, "H100", iqr_ms=0.04),
      result("r1", "lm_base/fp32", step, 21.8, "H100"),
      result("r1", "lm_base/qsync", step, 6.5, "H100"),  # not a uniform policy
      result("r1", "lm_base/bf16", "predicted_step_ms", 7.0, "H100"),
      result("r1", "resnet18_224/bf16", step, 7.0, "H100"),
      result("r0", "lm_base/int8", step, 9.9, "H200"),
    ],
  )
  found, device = models.steps_from(path, "r1", "lm_base")
  assert device == "H100"
  assert set(found) == {"bf16", "fp32"}
  assert found["bf16"][:2] == (5.2, 0.04) and found["bf16"][2] is None  # no XLA peak in step rows
  with pytest.raises(SystemExit, match="Fix: pass a run tag"):
    models.steps_from(path, "r2", "lm_base")


@pytest.mark.standard_promotion  # optax's Adam in the profiled fp32 step
def test_models_refits_and_predicts_every_plan_from_both_profiles(tmp_path):
  """One CPU run of the GPU benchmark's path on the small mlp: steps of the uniform and mixed
  plans, a profile saved (its checkpoint gone), its precast variant, both refitted to the run's
  fp32 step, and one prediction row per plan and profile."""
  results, profiles = tmp_path / "models.jsonl", tmp_path / "profiles"
  argv = ["--models", "mlp", "--profile-dir", str(profiles), "--results", str(results), "--repeats", "3"]
  assert models.main([*argv, "--profile-repeats", "2", "--precast", "--refit", "--mixed", "--no-plan"]) == 0
  assert sorted(p.name for p in profiles.iterdir()) == ["mlp.json", "mlp.precast.json"]
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  steps = {r["case"].partition("/")[2]: r["value"] for r in rows if r["metric"] == "step_ms_median"}
  assert set(steps) == set(models.UNIFORM) | set(models.MIXED)
  predicted = {
    (r["case"].partition("/")[2], r["operands"]): r["value"]
    for r in rows
    if r["metric"] == "predicted_step_ms"
  }
  assert set(predicted) == {(name, v) for name in steps for v in ("fp32", "precast")}
  for operands in ("fp32", "precast"):  # fp32 is the fit: refitted to this run's own fp32 step
    assert predicted[("fp32", operands)] == pytest.approx(steps["fp32"], rel=1e-6)
  assert predicted[("int8", "fp32")] == predicted[("int8", "precast")]  # all-int8 is not precast
  summary = [r for r in rows if r["metric"] == "abs_rel_error"]
  assert [r["operands"] for r in summary] == ["fp32", "precast"]
