"""``qsync train`` refuses before any expensive work: a batch the devices cannot hold is refused by
the memory check from shapes alone (no batch of its size is drawn), and a ``--resume`` whose
checkpoint has another seed is refused before the training state is built."""

import dataclasses

import pytest

from qsync_cli import main as cli
from qsync_jax.train.train_step import TrainStep
from tests.qsync_jax.train.tiny import make_task

SIZES: list[int] = []


def recording_task():
  """``tiny.make_task`` whose ``train_batches`` records the batch sizes asked of it."""
  task = make_task()

  def batches(n, seed):
    SIZES.append(n)
    return task.train_batches(n, seed)

  return dataclasses.replace(task, train_batches=batches)


def test_an_enormous_batch_is_refused_by_the_memory_check_without_drawing_it(tmp_path, capsys):
  SIZES.clear()
  argv = ["train", "--model", "tests.qsync_cli.test_train_startup_checks:recording_task", "--steps", "1"]
  code = cli.main([*argv, "--batch-per-device", str(10**9), "--out", str(tmp_path / "r")])
  err = capsys.readouterr().err
  assert (
    code == 2
    and "needs at least" in err
    and "Fix: lower the largest per-device batch (--batch-per-device" in err
  )
  assert SIZES and max(SIZES) < 10**9  # only a small sample batch was drawn
  assert not (tmp_path / "r").exists()


@pytest.mark.standard_promotion  # optax's update
def test_a_resume_with_another_seed_is_refused_before_the_state_is_built(tmp_path, capsys, monkeypatch):
  out = str(tmp_path / "r")
  argv = ["train", "--model", "tests.qsync_jax.train.tiny:make_task", "--out", out, "--checkpoint-every", "1"]
  assert cli.main([*argv, "--steps", "1"]) == 0
  capsys.readouterr()

  def no_init(*args, **kwargs):
    raise AssertionError("the training state was built before the checkpoint's seed was checked")

  monkeypatch.setattr(TrainStep, "init", no_init)
  assert cli.main([*argv, "--steps", "2", "--resume", "--seed", "1"]) == 2
  err = capsys.readouterr().err
  assert "written by a different seed: it has 0, this run 1" in err and "Fix: resume with the --seed" in err
