"""``qsync train --sync NAME`` picks a gradient-hook strategy; a step-builder one is refused clearly."""

import json

from qsync_jax import cli


def test_train_with_global_qsgd(tmp_path):
  out = tmp_path / "run"
  argv = ["train", "--model", "tests.trainer.tiny:make_task", "--steps", "2", "--out", str(out)]
  assert cli.main([*argv, "--sync", "global_qsgd"]) == 0
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert lines and all(line["loss"] == line["loss"] for line in lines)  # finite (NaN != NaN)


def test_step_builder_strategy_is_refused(tmp_path, capsys):
  argv = ["train", "--model", "tests.trainer.tiny:make_task", "--steps", "1", "--out", str(tmp_path / "r")]
  assert cli.main([*argv, "--sync", "selsync"]) == 2
  err = capsys.readouterr().err
  assert "selsync" in err and "global_qsgd" in err and "make_selsync_step" in err
