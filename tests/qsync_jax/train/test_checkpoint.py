"""Checkpoints: resume after a kill is bit-identical; bad checkpoints raise and touch nothing; the
progress lines of a run, and a resume that logs no step twice."""

import gc
import hashlib
import io
import json
import os
import signal
import time

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import CheckpointError
from qsync_jax.plan import Plan
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train import procs
from tests.qsync_jax.train.tiny import make_task

CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 6, 40, 3), DeviceGroup("t", "T4", 2, 16, 1)))
PLAN = Plan.from_json({"policies": {"t": "int8"}})  # stochastic rounding: the RNG state must resume too


def _tree_digest(directory):
  digest = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(directory)):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      digest.update(path.encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical(tmp_path):
  out = tmp_path / "run"
  CLUSTER.save(str(tmp_path / "cluster.json"))
  PLAN.save(str(tmp_path / "plan.json"))
  args = ["--model", "tests.qsync_jax.train.tiny:make_task", "--cluster", str(tmp_path / "cluster.json")]
  args += ["--plan", str(tmp_path / "plan.json"), "--steps", "12", "--out", str(out), "--seed", "5"]
  args += ["--optimizer", "adam", "--lr", "0.01", "--checkpoint-every", "2", "--local-devices", "8"]
  proc = procs.train(args, str(tmp_path / "log.txt"), QSYNC_TEST_BATCH_DELAY_S="0.3")
  try:
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "4").exists():
      assert proc.poll() is None, (tmp_path / "log.txt").read_text()
      assert time.monotonic() < deadline, "no checkpoint 4 within 120 s"
      time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
  log = (tmp_path / "log.txt").read_text()
  assert "steps/s" in log and "ETA" in log
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert lines[0]["step"] == 1 and "loss" in lines[0] and "steps_per_s" in lines[0]

  task = make_task()
  resumed = Trainer(task, CLUSTER, PLAN, optax.adam(0.01), seed=5, out_dir=str(out), resume=True)
  assert 4 <= resumed.step < 12 and resumed.data_position == resumed.step
  resumed.run(12)
  straight = Trainer(task, CLUSTER, PLAN, optax.adam(0.01), seed=5)
  straight.run(12)
  for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ckpt") / "run")
  trainer = Trainer(make_task(), CLUSTER, PLAN, optax.sgd(0.1), seed=1, out_dir=out)
  trainer.run(2)
  trainer.close()
  return out


@pytest.mark.parametrize(
  "task_kwargs, plan, needle",
  [
    ({"hidden": 8}, PLAN, "different model"),
    ({}, Plan.from_json({"policies": {"t": "int8_fwd"}}), "different plan"),
  ],
)
def test_checkpoint_of_other_model_or_plan_is_refused(saved_run, task_kwargs, plan, needle):
  before = _tree_digest(saved_run)
  with pytest.raises(CheckpointError, match=needle) as e:
    Trainer(make_task(**task_kwargs), CLUSTER, plan, optax.sgd(0.1), seed=1, out_dir=saved_run, resume=True)
  assert "Fix:" in str(e.value)
  assert _tree_digest(saved_run) == before


# A failed read leaves tensorstore futures whose callbacks hit orbax's already-closed asyncio
# loop; Python reports that as an unraisable exception (not ours, and harmless).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("target", ["arrays", "meta"])
def test_corrupted_checkpoint_is_refused_and_nothing_changes(saved_run, tmp_path, target):
  import shutil

  out = str(tmp_path / "run")
  shutil.copytree(saved_run, out)
  trainer = Trainer(make_task(), CLUSTER, PLAN, optax.sgd(0.1), seed=1, out_dir=out, resume=True)
  state = trainer.state  # restored from the intact checkpoint, which is corrupted next
  step_dir = os.path.join(out, "checkpoints", "2", "state" if target == "arrays" else "meta")
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if "commit_success" not in f]
  if target == "arrays":  # every OCDBT data file (the array bytes), not orbax's JSON notes
    files = [f for f in files if os.sep + "d" + os.sep in f]
  rng = np.random.default_rng(101)
  for victim in files:
    data = bytearray(open(victim, "rb").read())
    for i in rng.integers(len(data) // 4, len(data), size=8):
      data[i] ^= 0xFF
    open(victim, "wb").write(bytes(data))
  before = _tree_digest(out)
  with pytest.raises(CheckpointError, match="corrupted.*Fix:") as e:
    trainer.resume()
  message = str(e.value)  # one line of ours: none of orbax's, tensorstore's or pybind11's text
  assert "\n" not in message and not any(w in message for w in ("pybind11", "tensorstore", "Traceback"))
  assert trainer.state is state and trainer.data_position == 2
  assert _tree_digest(out) == before
  trainer.close()
  gc.collect()  # let the stray callbacks fire inside this test


def test_checkpoint_of_other_cluster_layout_is_refused_but_link_speed_may_change(saved_run):
  faster_links = ClusterSpec(tuple(g.replace(link_gbps=400.0, memory_gb=80.0) for g in CLUSTER.groups))
  trainer = Trainer(make_task(), faster_links, PLAN, optax.sgd(0.1), seed=1, out_dir=saved_run, resume=True)
  assert trainer.step == 2
  other = CLUSTER.with_batch_per_device({"t": 2}).with_batch_per_device({"a": 2})
  with pytest.raises(CheckpointError, match="different cluster"):
    Trainer(make_task(), other, PLAN, optax.sgd(0.1), seed=1, out_dir=saved_run, resume=True)


def test_log_lines_and_no_repeated_metrics_after_a_resume(tmp_path, capsys):
  cluster = ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1)))
  out = str(tmp_path / "run")
  log = io.StringIO()
  first = Trainer(
    make_task(), cluster, optimizer=optax.sgd(0.1), out_dir=out, checkpoint_every=2, progress=log
  )
  first.run(4)
  first.close()
  lines = log.getvalue().splitlines()
  assert lines[0].startswith("compiling the step (8 devices, global batch 12)")
  assert lines[1].startswith("compiled and ran the first step in ")
  assert "step 4/4  loss" in lines[-1] and "samples/s" in lines[-1] and "ETA 0s" in lines[-1]
  # A killed run logged steps 5 and 6 past its last checkpoint (4), the last line cut short.
  with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + json.dumps({"step": 6, "loss": 1.0}) + '\n{"st')
  resumed = Trainer(make_task(), cluster, optimizer=optax.sgd(0.1), out_dir=out, resume=True)
  resumed.run(6)
  resumed.close()
  steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))]
  assert steps == [1, 2, 3, 4, 5, 6]
  record = json.loads(open(os.path.join(out, "metrics.jsonl")).readlines()[-1])
  assert record["samples_per_s"] == pytest.approx(12 * record["steps_per_s"])
