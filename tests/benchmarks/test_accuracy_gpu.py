"""The GPU accuracy testbed's three modes at a tiny size on CPU devices: rows and plans."""

import json
import math

import pytest

import benchmarks.accuracy_gpu as testbed
from benchmarks.common import zoo
from planners.indicator.api import FORMAT
from tests.planners.fakes import fake_indicator

pytestmark = pytest.mark.standard_promotion  # optax's AdamW, as users run it


@pytest.fixture
def tiny(monkeypatch):
  for key, value in dict(width=16, heads=2, depth=1, seq=16, max_bytes=100_000).items():
    monkeypatch.setitem(zoo.GPT_25M, key, value)
  monkeypatch.setattr(testbed, "EVAL_BATCHES", 1)


def _op_names(task):
  import jax

  from qsync_jax import quantize
  from qsync_jax.policy import PrecisionPolicy

  batch = next(task.train_batches(2, 0))
  variables = task.model.init(jax.random.key(0), *task.inputs(batch))
  return list(quantize(task.model, PrecisionPolicy.uniform("fp32")).ops(variables, *task.inputs(batch)))


def _rows(path):
  return [json.loads(line) for line in open(path)]


def test_sweep_plan_and_compare_write_their_rows_and_plans(tiny, tmp_path):
  jsonl, plans = str(tmp_path / "rows.jsonl"), str(tmp_path / "plans")
  common = ["--steps", "2", "--warmup", "1", "--seeds", "0", "--batch", "8", "--jsonl", jsonl, "--out", ""]
  assert testbed.main(["sweep", "--policies", "fp32", "int8", *common]) == 0
  sweep = _rows(jsonl)
  assert [r["case"] for r in sweep] == ["sweep/fp32", "sweep/int8"]
  assert all(math.isfinite(r["value"]) and r["metric"] == "held-out loss" for r in sweep)

  names = _op_names(zoo.task(testbed.MODEL))
  indicator = tmp_path / "omega.json"
  omega = fake_indicator(names, [1.0 + i for i in range(len(names))])
  indicator.write_text(json.dumps({"format": FORMAT, **omega}))
  assert testbed.main(["plan", "--indicator", str(indicator), "--plans", plans, *common]) == 0
  saved = {p.name for p in (tmp_path / "plans").iterdir()}
  assert {"indicator.json", "dynamic_batching.json", "uniform_low_precision.json", "joint.json"} <= saved
  low = json.load(open(tmp_path / "plans" / "uniform_low_precision.json"))
  legs = {(r["policy"]["fwd"], r["policy"]["dlhs"]) for r in low["policies"]["inference"]["rules"]}
  assert ("int8", "int8") in legs  # the int8 level runs int8 on every leg (--int8-op int8)

  configs = ["--configs", "dynamic batching", "uniform low precision"]
  assert testbed.main(["compare", "--plans", plans, *configs, *common]) == 0
  compared = [r for r in _rows(jsonl) if r["case"].startswith("compare/")]
  assert [r["case"] for r in compared] == ["compare/dynamic batching", "compare/uniform low precision"]
  assert compared[1]["batch_per_device"] == low["batch_per_device"]
  assert all(math.isfinite(r["value"]) for r in compared)


def test_report_pairs_by_seed_and_leaves_out_superseded_rows(tmp_path):
  setup = "make_train_step, lr 0.001, warmup 100, batch 64, 1000 steps"

  def row(case, seed, value, **extra):
    return {"case": case, "seed": seed, "value": value, "eval_accuracy": 0.5, "setup": setup, **extra}

  rows = [
    row("sweep/fp32", 0, 1.00),
    row("sweep/fp32", 1, 1.10),
    row("sweep/fp8", 0, 1.03),
    row("sweep/fp8", 1, 1.11),
    row("sweep/fp8", 0, float("nan"), superseded="a defect's run"),  # last: would win if kept
  ]
  jsonl, doc = tmp_path / "rows.jsonl", tmp_path / "results.md"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert testbed.main(["report", "--jsonl", str(jsonl), "--doc", str(doc)]) == 0
  (fp8,) = [line for line in doc.read_text().splitlines() if line.startswith("| fp8 |")]
  # seeds 0 and 1 only, paired: (0.03 + 0.01) / 2 = +0.0200, s.e. 0.01; the NaN row is not shown
  assert "| 0,1 |" in fp8 and "nan" not in fp8 and "+0.0200 ± 0.0100 (2 seeds)" in fp8
