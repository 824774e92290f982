"""The hybrid study's measured Ω tables (``benchmarks.diagnosis.hybrid_omega``) and ``benchmarks.hybrid``
planning with them: each payload charged its measured accuracy cost, the synthetic draw only without a table."""

import contextlib
import io
import json

import pytest

from benchmarks import hybrid
from benchmarks.diagnosis import hybrid_omega
from planners.indicator import load

PLANNED = ["--tiny", "--pools", "A100+T4", "--topologies", "25G"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  """bert_s128's tiny table, its payloads measured on 4 batches at 4 devices alone (the A100+T4 pool's
  training group alone; the pool's whole 8 has no figure)."""
  out = tmp_path_factory.mktemp("omega")
  argv = ["--tiny", "--models", "bert_s128", "--devices", "4", "--batches", "4", "--out-dir", str(out)]
  assert hybrid_omega.main(argv) == 0
  return out, load(hybrid.omega_path("bert_s128", True, str(out)))


@pytest.fixture(scope="module")
def planned(measured, tmp_path_factory):
  """``(rows, printout)`` of ``benchmarks.hybrid`` on A100+T4 at 25 Gbit/s: bert_s128 with its
  table, bert_s512 without."""
  out, _ = measured
  results = tmp_path_factory.mktemp("rows") / "hybrid.jsonl"
  argv = [*PLANNED, "--models", "bert_s128,bert_s512", "--omega-dir", str(out), "--results", str(results)]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert hybrid.main(argv) == 0
  return [json.loads(line) for line in results.read_text().splitlines()], printed.getvalue()


def test_the_pools_device_counts_are_every_subset_of_their_groups():
  assert hybrid_omega.pool_device_counts() == [1, 2, 4, 6, 7, 8]
  assert hybrid_omega.pool_device_counts({"p": (("A100", 1), ("T4", 7))}) == [1, 7, 8]


def test_the_budget_and_the_batches_are_checked_before_any_model_runs(tmp_path, capsys):
  with pytest.raises(SystemExit, match="--batches 4: the payload at 8 devices needs as many batches"):
    hybrid_omega.main(["--tiny", "--batches", "4", "--out-dir", str(tmp_path)])
  assert (
    hybrid_omega.main(
      ["--tiny", "--models", "bert_s128,gpt_350m", "--budget-s", "1", "--out-dir", str(tmp_path)]
    )
    == 0
  )
  assert "bert_s128: skipped (expected 30 s after 0 s: over --budget-s 1)" in capsys.readouterr().out
  assert not list(tmp_path.iterdir())


def test_the_table_is_an_indicator_table_with_its_payloads_and_how_it_was_measured(measured):
  _, table = measured
  meta = table["metadata"]
  assert (meta["model"], meta["tiny"], meta["batch"], meta["batches"], meta["seed"]) == (
    "bert_s128",
    True,
    2,
    4,
    0,
  )
  assert (
    meta["device"] == "cpu"
    and meta["train_steps"] == 0
    and set(meta["seconds"]) == {"variables", "omega", "payload"}
  )
  assert table["payload"]["devices"] == [4] and table["payload"]["batches"] == 4
  omega = {s: table["payload"]["syncs"][s]["4"]["omega"] for s in ("bf16", "fp16", "global_qsgd")}
  assert 0 < omega["fp16"] < omega["bf16"] < omega["global_qsgd"]  # 11, 8 and ~5 significant bits
  assert max(row["int8"] for row in table["omega"].values()) > 0


def test_hybrid_charges_each_payload_its_measured_cost_at_the_devices_that_run(measured, planned):
  _, table = measured
  rows, printed = planned
  figure = {s: f["4"]["omega"] for s, f in table["payload"]["syncs"].items()}  # fp16: the baselines
  cands = [r for r in rows if r["metric"] == "modeled_samples_per_s" and "sync" in r and "fits" in r]
  mine = [r for r in cands if "/bert_s128/" in r["case"]]
  assert mine and {r["omega"] for r in mine} == {"measured cpu"}
  charged = 0
  for r in mine:
    devices = 4 * sum(b > 0 for b in r["batch_per_device"])
    if r["sync"] == "fp32":
      assert r["payload_accuracy_cost"] == 0.0
    elif devices == 4:  # measured: charged on top of the ops' cost
      assert r["payload_accuracy_cost"] == figure[r["sync"]] and r["accuracy_cost"] >= figure[r["sync"]]
      charged += 1
    else:  # 8 devices: not measured, nothing charged
      assert r["payload_accuracy_cost"] is None
  assert charged >= 2  # the training group alone at bf16 and at Global-QSGD
  synthetic = [r for r in cands if "/bert_s512/" in r["case"]]
  assert {r["omega"] for r in synthetic} == {"synthetic"}
  assert all(r["payload_accuracy_cost"] is None for r in synthetic if r["sync"] != "fp32")
  assert "bert_s128: Ω measured cpu (gradient indicator on 4 batches of 2" in printed
  assert "bert_s512: Ω synthetic (a seeded draw: no measured table at" in printed


def test_a_table_of_another_model_is_refused_with_the_fix(measured, tmp_path):
  out, table = measured
  table["omega"].pop(table["ops"][0])
  (tmp_path / "omega_bert_s128.tiny.json").write_text(json.dumps(table))
  with pytest.raises(SystemExit, match="no Ω for op.*Fix: measure it again"):
    hybrid.sensitivities("bert_s128", table["ops"], True, str(tmp_path))
  indicator, label = hybrid.sensitivities("bert_s128", table["ops"], True, str(out))
  assert label == "measured cpu" and indicator["payload"] == table["payload"]
  assert (
    hybrid.sensitivities("bert_s128", table["ops"], False, str(out))[1] == "synthetic"
  )  # no real-size table


def test_payloads_are_measured_whole_pools_first_and_saved_after_each_count(measured):
  """``payload_order`` takes whole pools' counts first, then one group's, then the rest; ``measure``
  saves the table once Ω is in and after every count, and a count's figures do not depend on the
  counts measured before it (the fixture measured 4 alone, on the same batches and seed)."""
  assert hybrid_omega.payload_order([1, 2, 4, 6, 7, 8]) == [8, 1, 2, 4, 7, 6]
  assert hybrid_omega.payload_order([6, 2]) == [2, 6]
  saved = []
  table = hybrid_omega.measure(
    "bert_s128",
    True,
    4,
    0,
    0,
    [4, 2],
    say=lambda msg: None,
    save=lambda t: saved.append(json.loads(json.dumps(t))),
  )
  assert [(t.get("payload") or {}).get("devices") for t in saved] == [None, [2], [2, 4]]
  assert saved[-1]["payload"] == table["payload"] and "payload" in saved[-1]["metadata"]["seconds"]
  _, alone = measured
  assert table["payload"]["syncs"]["bf16"]["4"] == alone["payload"]["syncs"]["bf16"]["4"]
  assert all(table["omega"][op] == row for op, row in alone["omega"].items())  # the same Ω, op by op
