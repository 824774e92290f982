"""``benchmarks/models.py``'s offline replay: measured steps read back from a run's rows."""

import json
import os
import sys

import pytest

# appended, not prepended: the benchmark scripts must not shadow any module the other tests import
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import models  # noqa: E402


def test_steps_from_reads_the_uniform_steps_of_one_run_and_model(tmp_path):
  path = tmp_path / "models.jsonl"
  rows = [
    {
      "run": "r1",
      "case": "lm_base/bf16",
      "metric": "step_ms_median",
      "value": 5.2,
      "iqr_ms": 0.04,
      "device": "H100",
    },
    {"run": "r1", "case": "lm_base/fp32", "metric": "step_ms_median", "value": 21.8, "device": "H100"},
    {
      "run": "r1",
      "case": "lm_base/qsync",
      "metric": "step_ms_median",
      "value": 6.5,
      "device": "H100",
    },  # not uniform
    {"run": "r1", "case": "lm_base/bf16", "metric": "predicted_step_ms", "value": 7.0, "device": "H100"},
    {"run": "r1", "case": "resnet18_224/bf16", "metric": "step_ms_median", "value": 7.0, "device": "H100"},
    {"run": "r0", "case": "lm_base/int8", "metric": "step_ms_median", "value": 9.9, "device": "H200"},
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  found, device = models.steps_from(str(path), "r1", "lm_base")
  assert device == "H100"
  assert set(found) == {"bf16", "fp32"}
  assert found["bf16"][:2] == (5.2, 0.04) and found["bf16"][2] is None  # no XLA peak in step rows
  with pytest.raises(SystemExit, match="Fix: pass a run tag"):
    models.steps_from(str(path), "r2", "lm_base")
