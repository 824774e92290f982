"""``qsync train --sync NAME [--sync-option KEY=VALUE ...]`` runs every kind of strategy."""

import json

import pytest

from qsync_cli import main as cli

ARGV = ["train", "--model", "tests.qsync_jax.train.tiny:make_task", "--steps", "3"]


def test_train_with_global_qsgd(tmp_path):
  out = tmp_path / "run"
  argv = ["train", "--model", "tests.qsync_jax.train.tiny:make_task", "--steps", "2", "--out", str(out)]
  assert cli.main([*argv, "--sync", "global_qsgd"]) == 0
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert lines and all(line["loss"] == line["loss"] for line in lines)  # finite (NaN != NaN)


@pytest.mark.parametrize(
  "name, options",
  [("selsync", ["warmup=1", "delta=0.3"]), ("qsdp", ["bucket_size=32", "grad_payload=int16"])],
)
def test_train_with_step_builder_strategy(tmp_path, capsys, name, options):
  out = tmp_path / "run"
  flags = [flag for option in options for flag in ("--sync-option", option)]
  assert cli.main([*ARGV, "--out", str(out), "--sync", name, *flags]) == 0
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [line["step"] for line in lines] == [1, 2, 3]
  assert all(0 < line["loss"] < float("inf") for line in lines)
  if name == "selsync":  # warm-up of 1 step: step 1 synchronized everyone
    assert lines[0]["synced"] == 1.0 and lines[0]["flags"] == 8.0
  assert "steps/s" in capsys.readouterr().err
  assert (out / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize(
  "extra, needle",
  [
    (["--sync", "selsync", "--sync-option", "bucket_size=64"], "has no option 'bucket_size'"),
    (["--sync", "selsync", "--sync-option", "delta"], "is not KEY=VALUE"),
    (["--sync-option", "delta=0.1"], "needs a --sync strategy"),
    (["--sync", "nope"], "--sync 'nope' is not a sync strategy. Fix: use one of"),
  ],
)
def test_bad_sync_arguments_are_refused(tmp_path, capsys, extra, needle):
  assert cli.main([*ARGV, "--out", str(tmp_path / "r"), *extra]) == 2
  err = capsys.readouterr().err
  assert needle in err
