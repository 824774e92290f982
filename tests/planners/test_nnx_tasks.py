"""``qsync indicator`` and ``qsync profile`` on a task whose model is a flax.nnx module (with
dropout and BatchNorm): every op is found under its nnx path, scored and timed."""

from __future__ import annotations

import json

import pytest

from qsync_cli.main import main

NNX_OPS = ["hidden:dense", "out:dense"]


def test_indicator_scores_the_ops_of_an_nnx_task(tmp_path):
  out = tmp_path / "omega.json"
  argv = ["indicator", "--model", "tests.qsync_jax.train.tiny:make_nnx_task", "--out", str(out)]
  argv += [
    "--batches",
    "2",
    "--payload-devices",
  ]  # the payloads' measurement: tests/qsync_cli/test_indicator.py
  assert main([*argv, "--batch-size", "8", "--precisions", "int8", "fp16"]) == 0
  table = json.loads(out.read_text())
  assert table["ops"] == NNX_OPS
  assert all(row["int8"] > row["fp16"] > row["fp32"] == 0.0 for row in table["omega"].values())


@pytest.mark.slow
def test_profile_times_the_ops_of_an_nnx_task(tmp_path):
  out = tmp_path / "profile.json"
  argv = ["profile", "--model", "tests.qsync_jax.train.tiny:make_nnx_task", "--out", str(out), "--batch", "8"]
  assert main([*argv, "--precisions", "fp32,int8", "--repeats", "2"]) == 0
  profile = json.loads(out.read_text())
  assert [op["name"] for op in profile["ops"]] == NNX_OPS
  assert all(ms > 0 for op in NNX_OPS for ms in profile["op_ms"][op]["fwd"].values())
