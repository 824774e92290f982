"""``qsync plan --sync auto`` prints each gradient payload's step (modeled) beside its accuracy cost
(measured by ``qsync indicator``, or said to be not measured) and writes both into the plan."""

import json

from qsync_cli.main import main
from qsync_jax.plan import Plan
from tests.planners.fakes import fake_indicator, fake_profile


def _plan(tmp_path, capsys, payload):
  """Plans 4 A100s on a 10 Gbit/s link (Global-QSGD the fastest payload, bf16 and fp16 within
  --slack 0.2 of it, fp32 not) with an indicator holding ``payload``; (printed lines, plan)."""
  profile = fake_profile([(1.0, 1.0, 1.0)] * 2, device_type="A100", rhs_elems=250_000, model="mlp")
  profile.save(str(tmp_path / "a100.json"))
  group = {"name": "train", "device_type": "A100", "count": 4, "memory_gb": 40, "batch_per_device": 8}
  (tmp_path / "cluster.json").write_text(json.dumps({"groups": [{**group, "link_gbps": 10}]}))
  indicator = fake_indicator(profile.op_names, [1.0, 1.0])
  if payload is not None:
    indicator["payload"] = payload
  (tmp_path / "omega.json").write_text(json.dumps(indicator))
  files = ["--cluster", str(tmp_path / "cluster.json"), "--indicator", str(tmp_path / "omega.json")]
  out = str(tmp_path / "plan.json")
  argv = ["plan", "--model", "tests.planners.tiny:mlp", *files, "--profile", str(tmp_path / "a100.json")]
  assert main([*argv, "--sync", "auto", "--slack", "0.2", "--out", out]) == 0
  return capsys.readouterr().out.splitlines(), Plan.load(out)


def test_plan_prints_and_writes_each_payloads_measured_accuracy_cost(tmp_path, capsys):
  omega = {"bf16": 2e-9, "fp16": 3e-11, "global_qsgd": 4e-8}
  payload = {
    "syncs": {s: {"4": {"error2": 1.0, "omega": w}} for s, w in omega.items()},
    "devices": [2, 4],
    "batches": 4,
    "optimizer": "adam",
    "lr": 1e-3,
  }
  lines, plan = _plan(tmp_path, capsys, payload)
  assert plan.sync == "fp16"  # within the slack, the least measured payload cost
  chosen = next(x for x in lines if x.startswith("chosen: "))
  assert "accuracy cost 3e-11 (3e-11 of it its fp16 payload's, measured)" in chosen
  at = lines.index(next(x for x in lines if x.startswith("gradient payloads (")))
  assert (
    "step modeled; accuracy cost measured by `qsync indicator` on its 4 batches at 2, 4 devices" in lines[at]
  )
  rows = {x.split()[0]: x for x in lines[at + 1 : at + 5]}
  assert set(rows) == {"fp32", "bf16", "fp16", "global_qsgd"}
  assert rows["fp32"].endswith("accuracy cost 0 (the reference)") and "on 4 devices" in rows["fp32"]
  assert rows["bf16"].endswith("accuracy cost 2e-09") and rows["global_qsgd"].endswith("accuracy cost 4e-08")
  predictions = plan.predictions
  assert predictions["payload_accuracy_cost"] == 3e-11 and predictions["accuracy_cost"] == 3e-11
  assert predictions["payloads"]["global_qsgd"]["accuracy_cost"] == 4e-08
  assert predictions["payloads"]["fp32"]["accuracy_cost"] == 0.0
  assert predictions["payload_accuracy"].startswith("measured by `qsync indicator`")
  costs = {(a["sync"], a["payload_accuracy_cost"]) for a in predictions["alternatives"]}
  assert {("fp32", 0.0), ("bf16", 2e-9), ("global_qsgd", 4e-8)} <= costs


def test_plan_says_a_payloads_accuracy_cost_is_not_measured_instead_of_a_figure(tmp_path, capsys):
  lines, plan = _plan(tmp_path, capsys, None)
  assert plan.sync == "bf16"  # nothing measured: the widest payload within the slack
  assert "(its bf16 payload's not measured)" in next(x for x in lines if x.startswith("chosen: "))
  header = next(x for x in lines if x.startswith("gradient payloads ("))
  assert "accuracy cost not measured: the indicator holds no payload measurement" in header
  rows = [x for x in lines if x.startswith("  bf16 ") or x.startswith("  global_qsgd ")]
  assert len(rows) == 2 and all(x.endswith("accuracy cost not measured") for x in rows)
  assert plan.predictions["payload_accuracy_cost"] is None
  assert plan.predictions["payloads"]["bf16"]["accuracy_cost"] is None
  assert plan.predictions["payload_accuracy"].startswith("not measured")
