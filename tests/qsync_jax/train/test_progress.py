"""The trainer's live throughput: the rate over the last window of steps, pauses (checkpoints,
compilation) left out, tokens/s, TFLOP/s per device and MFU, in the progress line and in
``metrics.jsonl``. A fake clock that advances only while the task loads a batch (its "step time")
and while a checkpoint is written makes the expected rates exact."""

import io
import json

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.train import progress
from qsync_jax.train.progress import Throughput
from qsync_jax.train.task import Task
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import MLP, _mse

pytestmark = pytest.mark.standard_promotion  # optax's Adam


def test_throughput_counts_the_last_window_between_marks_and_nothing_in_a_pause():
  now = [0.0]
  t = Throughput(window_steps=4, clock=lambda: now[0])
  t.restart(0)
  t.batch_ready()
  for step in range(1, 5):  # 10 ms per step
    now[0] += 0.01
    t.mark(step)
  assert t.steps_per_s() == pytest.approx(100.0)
  t.stop()
  now[0] += 100.0  # a pause: not counted, nor a mark inside it
  t.mark(5)
  t.restart(5)
  now[0] += 50.0  # (restarted: the time until the next batch is ready does not count either)
  t.batch_ready()
  for step in range(6, 10):  # 20 ms per step: the window of 4 steps holds only these
    now[0] += 0.02
    t.mark(step)
  assert t.steps_per_s() == pytest.approx(50.0)
  t.mark(9)  # a step marked twice counts once
  assert t.steps_per_s() == pytest.approx(50.0)


def test_the_logged_rate_leaves_out_checkpoints_and_compilation(tmp_path, monkeypatch):
  now = [0.0]
  monkeypatch.setattr(progress, "_now", lambda: now[0])

  def batches(global_batch, seed):
    rng = np.random.default_rng(seed)
    loaded = 0
    while True:
      loaded += 1
      now[0] += 1.0 if loaded <= 11 else 2.0  # the step time: 1 s up to the 11th batch, then 2 s
      x = rng.normal(size=(global_batch, 6)).astype(np.float32)
      yield {"x": x, "y": x[:, :3] * 2}

  task = Task("tiny_tokens", MLP(16), lambda b: (b["x"],), _mse, batches, tokens_per_example=5)
  cluster = ClusterSpec((DeviceGroup("g", "cpu", 2, 16, 4),))
  log = io.StringIO()
  trainer = Trainer(
    task,
    cluster,
    Plan(),
    optax.adam(1e-2),
    out_dir=str(tmp_path / "run"),
    checkpoint_every=4,
    progress=log,
    devices=jax.devices()[:2],
  )

  def slow_save():  # a checkpoint that takes 1000 s: outside the rate (as is the first step)
    now[0] += 1000.0

  monkeypatch.setattr(trainer, "save", slow_save)
  trainer.run(40)
  trainer.close()
  records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 41))
  # Step k's completion is observed once batch k+1 is loaded (one step late): the first rate is
  # step 2's, from the end of the compiling first step; steps 2-10 saw batches of 1 s only, the
  # window of the last (20) steps at step 40 batches of 2 s only.
  assert records[0]["steps_per_s"] == 0.0 and "mfu" not in records[0]
  for r in records[1:10]:
    assert r["steps_per_s"] == pytest.approx(1.0), r
  assert records[-1]["steps_per_s"] == pytest.approx(0.5)
  for r in records[1:]:
    assert r["samples_per_s"] == pytest.approx(8 * r["steps_per_s"])
    assert r["tokens_per_s"] == pytest.approx(8 * 5 * r["steps_per_s"])
    assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.05)  # the table's cpu 16-bit peak
  flops = trainer._step_flops[id(trainer.program)]
  # The products of the two Dense layers at 4 examples a device: each forward, each kernel's
  # gradient, and the second layer's input gradient (the model's input takes none).
  assert flops == 2 * 4 * (2 * 6 * 16 + 3 * 16 * 3)
  assert records[-1]["tflops_per_device"] == pytest.approx(0.5 * flops / 1e12)
  lines = log.getvalue().splitlines()
  assert any(
    x.startswith("rates over the last 20 steps, pauses") and "MFU against the cpu" in x for x in lines
  )
  last = lines[-1]
  assert last.startswith("step 40/40  loss ") and "4.0 samples/s  20.0 tokens/s  0.50 steps/s" in last
  assert "TFLOP/s/device  MFU " in last and last.endswith("ETA 0s")
  rate = records[29]["steps_per_s"]  # the ETA: the steps left at the window's rate
  assert lines[-11].startswith("step 30/40") and lines[-11].endswith(f"ETA {10 / rate:.0f}s") and rate < 0.6
