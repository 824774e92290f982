"""``qsync indicator`` round trip on a tiny task: writes a valid table the allocator reads."""

from __future__ import annotations

import json

import pytest

from planners.allocator.greedy import omega_table
from planners.indicator import FORMAT, load
from qsync_cli.main import main


def test_cli_round_trip_writes_valid_json(tmp_path, capsys):
  out = tmp_path / "omega.json"
  argv = ["indicator", "--model", "tests.planners.tiny:mlp", "--out", str(out), "--batches", "2"]
  assert main([*argv, "--batch-size", "4", "--method", "gvar", "--precisions", "int8", "fp16"]) == 0
  table = json.loads(out.read_text())
  assert table["format"] == FORMAT and table["method"] == "gvar"
  assert table["ops"] == ["Dense_0:dense", "Dense_1:dense", "Dense_2:dense"]
  assert table["precisions"] == ["fp32", "int8", "fp16"]
  assert all(row["int8"] > row["fp16"] > row["fp32"] == 0.0 for row in table["omega"].values())
  assert load(out) == table and set(omega_table(table)) == set(table["ops"])
  assert "Dense_1:dense" in capsys.readouterr().out
  assert "payload" not in table  # the payload's Ω is on the gradient method's scale alone


def test_the_gradient_method_measures_the_payloads_at_the_devices_asked(tmp_path, capsys):
  out = tmp_path / "omega.json"
  argv = ["indicator", "--model", "tests.planners.tiny:mlp", "--out", str(out), "--batches", "2"]
  argv += ["--batch-size", "4", "--precisions", "int8"]
  assert main([*argv, "--payload-devices", "3"]) == 2  # more devices than batches: refused first
  err = capsys.readouterr().err
  assert "--payload-devices 3" in err and "Fix: pass --batches 3 or more" in err and not out.exists()
  assert main([*argv, "--payload-devices", "2"]) == 0
  payload = load(out)["payload"]  # checked when loaded (planners.indicator.payload_cost.check_payload)
  assert payload["devices"] == [2] and payload["batches"] == 2 and payload["lr"] == 1e-3
  by_sync = {s: payload["syncs"][s]["2"] for s in ("bf16", "fp16", "global_qsgd")}
  assert 0 < by_sync["fp16"]["omega"] < by_sync["bf16"]["omega"] < by_sync["global_qsgd"]["omega"]
  assert 0 < by_sync["fp16"]["error2"] < by_sync["bf16"]["error2"] < by_sync["global_qsgd"]["error2"]
  printed = capsys.readouterr().out
  assert "measuring the gradient syncs' payloads at 2 devices" in printed
  assert "payload accuracy cost against fp32 at n devices: Ω (one adam update at lr 0.001)" in printed
  assert any(line.startswith("  global_qsgd  2: Ω ") for line in printed.splitlines())
  table = json.loads(out.read_text())
  table["payload"]["syncs"]["bf16"]["2"]["omega"] = float("nan")
  out.write_text(json.dumps(table))
  with pytest.raises(Exception, match="its payload section is not one `qsync indicator` writes"):
    load(out)


def test_cli_errors_name_the_fix(tmp_path, capsys):
  out = str(tmp_path / "o.json")
  assert main(["indicator", "--model", "tests.planners.tiny:nope", "--out", out]) == 2
  assert "Fix" in capsys.readouterr().err
  assert main(["indicator", "--model", "tests.planners.tiny:mlp", "--out", out, "--batches", "0"]) == 2
  assert "--batches" in capsys.readouterr().err
  (tmp_path / "bad.json").write_text("{}")
  try:
    load(tmp_path / "bad.json")
  except Exception as e:  # noqa: BLE001 - the type is checked below
    assert type(e).__name__ == "QsyncError" and "qsync indicator" in str(e)
  else:
    raise AssertionError("a table without 'format' must be rejected")


@pytest.mark.standard_promotion  # the Trainer's optimizer (optax's AdamW), as users run it
def test_the_indicator_scores_the_trainers_parameters():
  """``--train-steps 0``: the parameters ``qsync train --seed S`` starts from (any device count);
  ``--train-steps N``: those after N fp32 steps of the library's Trainer (BatchNorm stats too)."""
  import jax
  import numpy as np

  from planners.indicator import initial_variables
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.train.trainer import Trainer
  from tests.qsync_jax.train.tiny import make_task

  task = make_task(batchnorm=True)
  fresh = initial_variables(task, seed=3, train_steps=0, batch_size=16)
  eight_devices = Trainer(task, ClusterSpec.uniform("cpu", 8, 2), seed=3)
  jax.tree.map(np.testing.assert_array_equal, fresh["params"], eight_devices.params)

  trained = initial_variables(task, seed=3, train_steps=30, batch_size=16)
  batch = next(task.train_batches(64, 3))  # the stream the pre-training draws from

  def loss(variables):
    return float(task.loss(task.model.apply(variables, *task.inputs(batch), **task.eval_kwargs), batch)[0])

  assert loss(trained) < 0.9 * loss(fresh)  # seeded: 7.55 -> 6.39 on jax 0.10 (CPU)
  mean = trained["batch_stats"]["BatchNorm_0"]["mean"]
  assert not np.allclose(mean, fresh["batch_stats"]["BatchNorm_0"]["mean"])


def test_a_table_with_nan_or_inf_is_refused_when_loaded(tmp_path):
  from planners.indicator import make_table, save
  from qsync_jax.errors import QsyncError

  ops = ["Dense_0:dense", "Dense_1:dense"]
  for values, needle in [
    ({op: {"int8": float("nan")} for op in ops}, "Dense_0:dense[int8]=nan, Dense_1:dense[int8]=nan"),
    ({"Dense_0:dense": {"int8": 1.0}, "Dense_1:dense": {"int8": float("inf")}}, "Dense_1:dense[int8]=inf"),
  ]:
    path = tmp_path / "omega.json"
    save(make_table("gradient", values, ops, ("int8",), "mlp", 2), path)
    with pytest.raises(QsyncError, match="not finite numbers") as e:
      load(path)
    message = str(e.value)
    assert str(path) in message and needle in message and "Fix: run `qsync indicator`" in message
  save(make_table("gradient", {op: {"int8": 1.0} for op in ops}, ops, ("int8",), "mlp", 2), path)
  assert load(path)["omega"]["Dense_1:dense"]["int8"] == 1.0


def test_a_grouped_convolution_prints_no_8bit_entry(tmp_path, capsys):
  """A grouped convolution runs no 8-bit leg: its row has no int8 Ω, and the printed table shows
  "-" there (it crashed with KeyError: 'int8')."""
  out = tmp_path / "omega.json"
  argv = ["indicator", "--model", "tests.planners.test_grouped_conv:TASK", "--out", str(out)]
  argv += ["--payload-devices"]  # none: what is printed of the Ω table is under test
  assert main([*argv, "--batches", "2", "--batch-size", "4", "--precisions", "int8", "fp16"]) == 0
  table = load(out)
  assert "payload" not in table
  assert set(table["omega"]["grouped:conv"]) == {"fp32", "fp16"} and "int8" in table["omega"]["Conv_0:conv"]
  printed = capsys.readouterr().out
  (row,) = [line.split() for line in printed.splitlines() if line.startswith("grouped:conv")]
  assert row[0] == "grouped:conv" and row[1] == "0" and row[2] == "-" and float(row[3]) > 0
  # and the table says why
  assert "- no 8-bit score for 1 op(s) (grouped:conv): each is a grouped (depthwise) convolution" in printed
  assert '"where_supported": true' in printed
  assert f"wrote {out} (3 ops)" in printed
