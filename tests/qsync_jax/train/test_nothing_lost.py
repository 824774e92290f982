"""Nothing lost, nothing silently wrong: one run per output directory, a checkpoint write that
fails (ENOSPC from a patched writer) keeps the state and retries, SIGHUP checkpoints like SIGTERM, a
non-finite loss stops the run without a non-finite checkpoint, and bad run settings are refused
with a fix that names the right cause."""

import errno
import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import CheckpointError, NonFiniteLossError, OutputPathError, QsyncError
from qsync_jax.train.distributed import Watchdog
from qsync_jax.train.outputs import LOCK_NAME, lock_run_dir
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.test_tensorboard import _scalars
from tests.qsync_jax.train.tiny import make_task

pytestmark = pytest.mark.standard_promotion  # optax's Adam

MODEL = ["--model", "tests.qsync_jax.train.tiny:make_task"]
ONE_GROUP = ClusterSpec((DeviceGroup("g", "cpu", 2, 16, 4),))


def _trainer(out_dir, optimizer=None, **kwargs):
  return Trainer(
    make_task(),
    ONE_GROUP,
    None,
    optimizer or optax.sgd(0.05),
    out_dir=out_dir,
    devices=jax.devices()[:2],
    **kwargs,
  )


def test_a_second_run_into_the_same_out_is_refused_naming_the_holder(tmp_path, capsys):
  out = tmp_path / "run"
  out.mkdir()
  holder = subprocess.Popen(  # another run's process: it holds the lock as lock_run_dir does
    [
      sys.executable,
      "-c",
      "import fcntl, os, socket, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
      "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f'{os.getpid()} {socket.gethostname()}'.encode()); "
      "print('held', flush=True); sys.stdin.read()",
      str(out / LOCK_NAME),
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    for extra in ([], ["--resume"]):
      assert cli.main(["train", *MODEL, "--steps", "2", "--out", str(out), *extra]) == 2
      err = capsys.readouterr().err
      assert f"is in use by another training run (process {holder.pid} on " in err and "Fix: wait" in err, err
    with pytest.raises(OutputPathError, match=f"process {holder.pid}"):
      _trainer(str(out))
  finally:
    holder.stdin.close()
    holder.wait(timeout=30)
  # the holder ended without removing its lock file: the next run takes it over, with a note
  log = io.StringIO()
  trainer = _trainer(str(out), progress=log)
  assert f"took over the lock left by process {holder.pid} on " in log.getvalue()
  assert (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
  again = lock_run_dir("--out", str(out))  # this process may hold it again (the CLI, then its Trainer)
  again.release()
  assert (out / LOCK_NAME).exists()
  trainer.close()
  assert not (out / LOCK_NAME).exists()  # released with the run


def test_a_checkpoint_that_cannot_be_written_keeps_the_state_and_tries_again(tmp_path, monkeypatch):
  failing = {4}
  save = ocp.CheckpointManager.save

  def full_disk(self, step, *args, **kwargs):
    if step in failing:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
  log = io.StringIO()
  trainer = _trainer(str(tmp_path / "run"), checkpoint_every=2, progress=log)
  trainer.run(6)  # the save at 4 fails; 6 is written: nothing lost, no error
  said = [x for x in log.getvalue().splitlines() if x.startswith("checkpoint:")]
  assert said == [
    "checkpoint: step 4 could not be written (No space left on device); training goes on with the state in "
    "memory, trying again at step 6; last checkpoint written: step 2"
  ]
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "6"]
  failing.update({8})
  with pytest.raises(
    CheckpointError,
    match=r"at step 8, could not be written .*No space left on device\. "
    r"The last checkpoint written is step 6; .*Fix: free space",
  ):
    trainer.run(8)
  assert trainer.step == 8  # the state is kept: once the disk has room, it is saved
  failing.clear()
  trainer.save()
  assert trainer.checkpoints.latest_step() == 8
  trainer.close()


def test_a_non_finite_loss_stops_the_run_without_a_non_finite_checkpoint(tmp_path):
  trainer = _trainer(str(tmp_path / "nan"), optax.sgd(float("nan")))  # --lr nan: NaN parameters after step 1
  with pytest.raises(
    NonFiniteLossError, match=r"diverged at step 2: the loss is nan\. .*no checkpoint was written"
  ):
    trainer.run(6)
  assert trainer.step == 3 and trainer.checkpoints.latest_step() is None  # stopped one step later
  trainer.close()
  every = _trainer(str(tmp_path / "every"), optax.sgd(float("nan")), checkpoint_every=1)
  with pytest.raises(NonFiniteLossError, match=r"diverged at step 1: the parameters .* not finite"):
    every.run(6)
  assert every.checkpoints.latest_step() is None
  every.close()


def test_bad_run_settings_are_refused_with_the_fix_for_their_cause(tmp_path, capsys):
  trainer = _trainer(None)
  with pytest.raises(QsyncError, match=r"run\(steps=-3\).*Fix: pass an int of at least 0"):
    trainer.run(-3)
  with pytest.raises(QsyncError, match=r"checkpoint_every=-1 must be 0 .*Fix"):
    _trainer(None, checkpoint_every=-1)
  for flag, value, needle in (
    ("--checkpoint-every", "-1", "--checkpoint-every -1 must be 0"),
    ("--step-timeout", "-1", "--step-timeout -1 must be a number of seconds"),
  ):
    assert cli.main(["train", *MODEL, "--steps", "2", "--out", str(tmp_path / "x"), flag, value]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err and "peer" not in err, err
  alone = Watchdog(1.0).message(5.0)  # a one-process run's watchdog: no peer to blame
  assert (
    "one-process run: the step hangs" in alone
    and "peer" not in alone
    and "Fix: raise --step-timeout" in alone
  )
  (tmp_path / "old" / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(
    OutputPathError, match=r"already holds checkpoints\. Fix: pass resume=True .*Trainer\.resume\(\)"
  ) as e:
    _trainer(str(tmp_path / "old"))
  assert "--resume" not in str(e.value)
  with pytest.raises(OutputPathError, match=r"resume=True: .* holds no checkpoint.*Fix: pass resume=False"):
    _trainer(str(tmp_path / "new"), resume=True)


def test_sighup_checkpoints_and_the_resume_refuses_fewer_steps_and_reports_a_new_lr(tmp_path, capsys):
  out = tmp_path / "run"
  common = ["train", *MODEL, "--batch-per-device", "1", "--out", str(out)]
  assert cli.main([*common, "--set", "hangup_at=3", "--steps", "8", "--lr", "0.001"]) == 129
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith("qsync train: hung up (SIGHUP): interrupted at step 3; checkpoint 3 is in "), last
  assert (out / "checkpoints" / "3").is_dir() and not (out / LOCK_NAME).exists()
  assert cli.main([*common, "--resume", "--steps", "2"]) == 2
  err = capsys.readouterr().err
  assert "--steps 2 is below step 3, where --resume continues" in err and "Fix: pass --steps 3 or more" in err
  # (the resumed run also evaluates periodically: --eval-every, and --eval at the end)
  resumed = [*common, "--resume", "--steps", "6", "--lr", "0.002", "--set", "eval_examples=12"]
  assert cli.main([*resumed, "--eval-every", "2", "--eval"]) == 0
  captured = capsys.readouterr()
  said = (
    "resuming with other optimizer settings than checkpoint 3: --lr 0.001 -> 0.002; they apply from step 4"
  )
  assert said in captured.err
  lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  assert {"step": 3, "resumed_with": {"lr": {"checkpoint": 0.001, "now": 0.002}}} in lines
  assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert np.isfinite([r["loss"] for r in lines if "loss" in r]).all()
  evals = [r for r in lines if "eval" in r]
  assert [r["step"] for r in evals] == [4, 6]  # --eval at step 6 reuses that step's evaluation
  assert json.loads(captured.out.strip().splitlines()[-1])["eval"] == evals[-1]["eval"]
  assert sorted(_scalars(out / "tensorboard")["eval/loss"]) == [4, 6]
