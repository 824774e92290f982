"""The trainer's TensorBoard events (optional tensorboardX) and its default progress on stderr."""

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
from tests.trainer.tiny import make_task

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
      assert scalars[key][record["step"]] == np.float32(record[key]), (key, record["step"])
  assert sorted(scalars["loss"]) == [1, 2, 3] and "step" not in scalars
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
