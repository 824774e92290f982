"""``qsync indicator`` round trip on a tiny task: writes a valid table the allocator reads."""

from __future__ import annotations

import json

from planners.allocator import omega_table
from planners.indicator import FORMAT, load
from qsync_jax.cli import main


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
