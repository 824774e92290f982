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


def test_wide_trains_each_distinct_policy_once_over_paired_seeds_and_prints_its_table(
  tmp_path, monkeypatch, capsys
):
  """The wide testbed's path at its CPU size, with a stand-in search (the real one is
  tests/planners/test_payoff.py's): auto keeps mlp_in at int8, which is also the fastest candidate,
  so that set is trained once for the auto and auto_speed rows (two compiles in all)."""
  from benchmarks import accuracy_wide
  from planners.allocator.frontier import Choice
  from planners.allocator.payoff import AutoPolicy, OpPayoff, policy_of, traced_ops
  from planners.profiler import timing

  task = accuracy_wide.task_of("gpt", tiny=True)
  ops = traced_ops(task, timing.device_batch(task, 4, 0), 0)
  dense = {op.name: "int8" for op in ops if op.kind in accuracy_wide.DENSE_KINDS}
  calls = []

  def fake_auto_policy(task, batch, cache_dir=None, progress=None, **options):
    calls.append(cache_dir)
    chosen = {"block0/mlp_in:dense": "int8"}
    omega = {op: {"bf16": 0.0, "int8": 1.0, "fp8": 4.0} for op in dense}
    return AutoPolicy(
      policy_of(ops, "bf16", chosen), chosen, "bf16", "cpu", batch,
      (OpPayoff("block0/mlp_in:dense", 2.0, {"int8": 1.0}),),
      {"base": {}, "frontier": chosen, "paying_int8": dense}, {"base": 2.0, "frontier": 1.2, "paying_int8": 1.5},
      {}, "frontier", "wall", budget=0.2, omega=omega, frontier=Choice(chosen, 1.0, 1.4, 7.0, 1.0, 2.0, {}),
      candidate_omega={"base": 0.0, "frontier": 1.0, "paying_int8": 7.0}, speed_winner="frontier",
      search_s=3.0, loaded=len(calls) > 1,
    )  # fmt: skip

  monkeypatch.setattr(accuracy_wide, "auto_policy", fake_auto_policy)
  jsonl = str(tmp_path / "rows.jsonl")
  common = ["--tiny", "--models", "gpt", "--steps", "2", "--warmup", "1", "--seeds", "0", "1", "--batch", "4"]
  sizes = [
    "--eval-windows",
    "8",
    "--eval-batch",
    "4",
    "--log-every",
    "1",
    "--jsonl",
    jsonl,
    "--out",
    str(tmp_path),
  ]
  policies = ["--wide-policies", "bf16", "auto", "auto_speed"]
  assert testbed.main(["wide", *common, *sizes, *policies]) == 0
  assert calls[0] == calls[1] and calls[0] is not None  # searched, then loaded from the same cache
  rows = _rows(jsonl)
  assert rows == _rows(tmp_path / "accuracy_gpu.jsonl")  # and under --out
  search = rows[0]
  assert search["case"] == "wide/gpt/search" and search["loaded"] and search["winner"] == "frontier"
  held = {(r["case"], r["seed"]): r for r in rows if r["metric"] == "held-out loss"}
  assert set(held) == {(f"wide/gpt/{p}", s) for p in ("bf16", "auto", "auto_speed") for s in (0, 1)}
  assert all(math.isfinite(r["value"]) and r["steps_run"] == 2 for r in held.values())
  # the fastest candidate is auto's own set: trained once (as auto), the same numbers
  for s in (0, 1):
    assert (
      held[("wide/gpt/auto_speed", s)]["same_as"] == "auto" and held[("wide/gpt/auto", s)]["same_as"] is None
    )
    assert held[("wide/gpt/auto_speed", s)]["value"] == held[("wide/gpt/auto", s)]["value"]
    assert held[("wide/gpt/auto", s)]["value"] != held[("wide/gpt/bf16", s)]["value"]  # mlp_in ran int8
  auto = held[("wide/gpt/auto", 0)]
  assert auto["eight_bit"] == {"block0/mlp_in:dense": "int8"} and auto["omega"] == 1.0
  assert auto["omega_fraction"] == 1.0 / 7.0 and auto["dense_ops"] == len(dense)
  steps = {r["case"] for r in rows if r["metric"] == "step_ms"}
  assert steps == {f"wide/gpt/{p}" for p in ("bf16", "auto", "auto_speed")}
  out = capsys.readouterr().out
  assert "| policy | 8-bit Dense ops | Ω / speed-only Ω |" in out
  assert f"| auto | 1 of {len(dense)} | 0.14 |" in out and "search 3.0 s" in out and "auto − bf16: " in out
  # report: the wide rows get their own section of the doc, the same table
  doc = tmp_path / "results.md"
  assert testbed.main(["report", "--jsonl", jsonl, "--doc", str(doc)]) == 0
  text = doc.read_text()
  assert "<!-- accuracy.py gpt-wide: begin -->" in text and "GPU testbed where auto keeps 8-bit" in text
  assert f"| auto | 1 of {len(dense)} | 0.14 |" in text and "### GPU testbed: a 25 M-parameter GPT" in text
  # another run adds a policy's seeds: the recorded auto set is kept and not searched again; int8_dense's Ω
  # comes from the search row's table; bf16 and auto are timed again in this run, not trained
  more = ["--skip-done", "--wide-policies", "auto", "int8_dense", "--seeds", "1"]
  assert testbed.main(["wide", *common, *sizes, *more]) == 0
  assert len(calls) == 2  # no search
  added = _rows(jsonl)[len(rows) :]
  assert [(r["case"], r["seed"]) for r in added if r["metric"] == "held-out loss"] == [
    ("wide/gpt/int8_dense", 1)
  ]
  int8 = next(r for r in added if r["case"] == "wide/gpt/int8_dense")
  assert int8["omega"] == len(dense) and int8["omega_fraction"] == len(dense) / 7.0
  steps = [r for r in added if r["metric"] == "step_ms"]
  assert {r["case"] for r in steps} == {f"wide/gpt/{p}" for p in ("bf16", "auto", "int8_dense")}
  assert len({r["run"] for r in steps}) == 1 and steps[0]["run"] != rows[-1]["run"]
  out = capsys.readouterr().out  # the table of every row of the file: both runs
  assert f"| int8_dense | {len(dense)} of {len(dense)} |" in out and "| auto_speed | 1 of" in out
  # the search alone: its row, nothing trained
  assert testbed.main(["wide", *common, *sizes, "--search-only"]) == 0
  assert len(calls) == 4 and [r["case"] for r in _rows(jsonl)[len(rows) + len(added) :]] == [
    "wide/gpt/search"
  ]
