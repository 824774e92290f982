"""The trainer's TensorBoard events (written by default: train/, eval/ and replan/ tags, the learning
rate and MFU), periodic evaluation, and its default progress on stderr."""

import json
import struct
import sys

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.train.replan import Replanner
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import make_task

pytestmark = pytest.mark.standard_promotion  # optax's Adam


def _equal_speeds(program, state, host_batch, sizes, policies):
  """A fake measurement: every group 1 ms per example (the plan is kept, nothing recompiles)."""
  return {g: {b: float(b) for b in batches} for g, batches in sizes.items() if batches}


def _trainer(out_dir, **kwargs):
  cluster = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 4), DeviceGroup("g1", "cpu", 1, 16, 4)))
  return Trainer(
    make_task(),
    cluster,
    Plan(),
    optax.adam(1e-2),
    seed=3,
    out_dir=out_dir,
    devices=jax.devices()[:2],
    **kwargs,
  )


def _scalars(directory) -> dict[str, dict[int, float]]:
  """``{tag: {step: value}}`` of every events file in ``directory`` (TFRecord framing: length,
  its crc, an ``Event`` proto, its crc)."""
  from tensorboardX.proto import event_pb2

  out: dict[str, dict[int, float]] = {}
  for path in sorted(directory.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
      pos += 12 + length + 4
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def test_events_hold_the_metrics_of_metrics_jsonl(tmp_path):
  pytest.importorskip("tensorboardX")
  out = tmp_path / "run"
  replanner = Replanner(mode="once", warmup_steps=1, window=1, measure=_equal_speeds)
  trainer = _trainer(str(out), replan=replanner, progress=None)
  trainer.run(3)
  trainer.close()
  lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  logged = [r for r in lines if "replan" not in r]
  replans = [r for r in lines if "replan" in r]
  assert [r["step"] for r in logged] == [1, 2, 3] and len(replans) == 1
  scalars = _scalars(out / "tensorboard")
  # every number of every record, at its step, stored as float32
  for record in logged:
    for key in ("loss", "steps_per_s", "samples_per_s", "time_s"):
      assert scalars["train/" + key][record["step"]] == np.float32(record[key]), (key, record["step"])
  assert sorted(scalars["train/loss"]) == [1, 2, 3] and "train/step" not in scalars
  step, decision = replans[0]["step"], replans[0]["replan"]
  assert scalars["replan/replanned"] == {step: 0.0}
  assert scalars["replan/predicted_ms_old"][step] == np.float32(decision["predicted_ms_old"])
  assert scalars["replan/new/g0"][step] == decision["new"]["g0"]


def test_without_tensorboardx_training_writes_no_events(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
  out = tmp_path / "run"
  trainer = _trainer(str(out), progress=None)
  trainer.run(2)
  trainer.close()
  assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
  assert not (out / "tensorboard").exists()
  assert not trainer.tensorboard.enabled
  assert capsys.readouterr().err == ""  # progress=None: silent


def test_progress_goes_to_stderr_by_default_and_none_is_silent(tmp_path, capsys):
  trainer = _trainer(None)
  trainer.run(2)
  captured = capsys.readouterr()
  assert "step 1/2  loss" in captured.err and "step 2/2  loss" in captured.err and captured.out == ""
  trainer.progress = None  # as Trainer(progress=None)
  trainer.run(3)
  assert capsys.readouterr().err == ""


def _lr_task(eval_examples):
  """The tiny MLP, its metrics carrying a learning rate (as a scheduled optimizer's step does)."""
  from qsync_jax.train.task import Task
  from tests.qsync_jax.train.tiny import _mse

  task = make_task(eval_examples=eval_examples)

  def loss(out, batch):
    value, metrics = _mse(out, batch)
    return value, {**metrics, "lr": jax.numpy.float32(0.01)}

  return Task(task.name, task.model, task.inputs, loss, task.train_batches, task.eval_batches)


def test_events_by_default_have_train_eval_and_replan_tags_with_lr_and_mfu(tmp_path, capsys):
  out = tmp_path / "run"
  replanner = Replanner(mode="once", warmup_steps=1, window=1, measure=_equal_speeds)
  cluster = ClusterSpec((DeviceGroup("g0", "cpu", 1, 16, 4), DeviceGroup("g1", "cpu", 1, 16, 4)))
  trainer = Trainer(
    _lr_task(eval_examples=12),
    cluster,
    Plan(),
    optax.adam(1e-2),
    out_dir=str(out),
    devices=jax.devices()[:2],
    replan=replanner,
  )
  trainer.run(8, eval_every=4)
  assert trainer.evaluate_and_log() == trainer.last_eval[1]  # step 8 was evaluated: not again
  trainer.close()
  lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  evals = [(r["step"], r["eval"]) for r in lines if "eval" in r]
  assert [s for s, _ in evals] == [4, 8] and set(evals[0][1]) == {"loss", "mae", "lr"}
  assert "eval at step 4: loss " in capsys.readouterr().err
  scalars = _scalars(out / "tensorboard")
  assert sorted(scalars["train/loss"]) == list(range(1, 9)) and scalars["train/lr"][4] == np.float32(0.01)
  mfu = {r["step"]: r["mfu"] for r in lines if "mfu" in r}  # each step with a rate (not the first)
  assert len(mfu) >= 4 and scalars["train/mfu"] == {s: np.float32(v) for s, v in mfu.items()}
  assert set(scalars["train/tflops_per_device"]) == set(mfu)
  assert {s: v for s, v in scalars["eval/loss"].items()} == {s: np.float32(e["loss"]) for s, e in evals}
  assert list(scalars["replan/replanned"]) == [3]  # the decision after step 3
  assert not any(tag.startswith(("loss", "mfu", "replanned")) for tag in scalars)  # every tag has its kind


def test_eval_options_are_checked_before_any_work(tmp_path, capsys):
  from qsync_cli import main as cli

  no_eval = ["train", "--model", "tests.qsync_jax.train.tiny:make_task", "--out", str(tmp_path / "x")]
  no_eval += ["--steps", "2"]
  for bad, needle in ((["--eval-every", "-1"], "--eval-every -1 must be 0"), (["--eval"], "no held-out set")):
    assert cli.main([*no_eval, *bad]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err, err
  assert not (tmp_path / "x").exists()


def test_a_missing_tensorboardx_is_said_once(tmp_path, monkeypatch):
  import io

  monkeypatch.setitem(sys.modules, "tensorboardX", None)
  log = io.StringIO()
  trainer = _trainer(str(tmp_path / "run"), progress=log)
  trainer.run(3)
  trainer.close()
  said = [x for x in log.getvalue().splitlines() if x.startswith("TensorBoard:")]
  assert len(said) == 1 and "tensorboardX cannot be imported" in said[0] and "Fix: pip install" in said[0]
