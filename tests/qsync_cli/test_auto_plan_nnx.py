"""``qsync train --plan auto`` on a flax.nnx model: every op is found in the traced step and timed;
on a CPU the command says its timings tell nothing about a GPU."""

import json

import pytest

from planners.profiler import timing
from qsync_cli import main as cli


@pytest.mark.standard_promotion  # optax's update promotes bf16 with float32
def test_auto_plan_times_every_op_of_an_nnx_model_and_says_cpu_timings_are_not_a_gpus(
  tmp_path, capsys, monkeypatch
):
  monkeypatch.setattr(timing, "default_step_repeats", lambda clock: 2)  # which step wins is not tested
  out = tmp_path / "run"
  argv = ["train", "--model", "tests.qsync_jax.train.tiny:make_nnx_task", "--out", str(out), "--steps", "1"]
  assert cli.main([*argv, "--plan", "auto"]) == 0
  err = capsys.readouterr().err
  assert "measuring on this CPU" in err and "nothing about a GPU" in err
  payoffs = json.loads((out / "auto_policy.json").read_text())["payoffs"]
  assert [p["op"] for p in payoffs] == ["hidden:dense", "out:dense"]
  assert all(p["base_ms"] > 0 and all(ms > 0 for ms in p["preset_ms"].values()) for p in payoffs)
