"""``benchmarks/models.py``'s offline replay: measured steps read back from a run's rows."""

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
