"""Bad input to ``qsync train`` and the ``Trainer``: a named error before any work, nothing left
behind; Ctrl-C stops with one line and a resumable run."""

import json
import os
import signal
import time

import jax
import numpy as np
import optax
import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import BatchError, OutputPathError, PlanError
from qsync_jax.plan import Plan
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train import procs
from tests.qsync_jax.train.tiny import make_task

MODEL = ["--model", "tests.qsync_jax.train.tiny:make_task"]
CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1)))
RENAMED = {
  "policies": {
    "t": {"rules": [{"path": "Dense_0", "policy": "int8_fwd"}, {"path": "old_name", "policy": "int8_fwd"}]}
  }
}


@pytest.fixture
def cluster8(tmp_path):
  path = tmp_path / "c8.json"
  CLUSTER.save(str(path))
  return str(path)


def _train(capsys, *args):
  code = cli.main(["train", "--steps", "2", *args])
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return code, err


def test_unusable_out_is_refused_before_the_task_loads(tmp_path, capsys, cluster8):
  a_file = tmp_path / "f"
  a_file.write_text("")
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  # no_such_pkg: the task would fail to load, so an output error proves the check came first
  for out, needle in [
    (a_file, "is a file, not a run directory"),
    (other, "not empty and holds no run to resume"),
    (a_file / "run", "is a file"),
    ("/sys/qsync_run", "not writable"),
  ]:
    code, err = _train(capsys, "--model", "no_such_pkg.mod:make", "--cluster", cluster8, "--out", str(out))
    assert code == 2 and needle in err and "Fix:" in err, err
  assert (other / "notes.txt").read_text() == "mine" and os.listdir(other) == ["notes.txt"]


def test_resume_without_a_checkpoint(tmp_path, capsys, cluster8):
  code, err = _train(capsys, *MODEL, "--cluster", cluster8, "--out", str(tmp_path / "run"), "--resume")
  assert code == 2 and "holds no checkpoint to resume from" in err
  assert not (tmp_path / "run").exists()
  with pytest.raises(OutputPathError, match="holds no checkpoint"):
    Trainer(make_task(), CLUSTER, out_dir=str(tmp_path / "run"), resume=True)


def test_plan_for_renamed_modules(tmp_path, capsys, cluster8):
  plan = tmp_path / "plan.json"
  plan.write_text(json.dumps(RENAMED))
  code, err = _train(capsys, *MODEL, "--cluster", cluster8, "--plan", str(plan), "--out", str(tmp_path / "r"))
  assert code == 2 and "group 't': rule path(s) ['old_name'] match none" in err and "Fix: plan again" in err
  assert not (tmp_path / "r").exists()
  with pytest.raises(PlanError, match="old_name"):
    Trainer(make_task(), CLUSTER, Plan.from_json(RENAMED))


def test_memory_is_checked_against_the_cluster_spec(tmp_path, capsys):
  small = ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 1e-6, 1)))
  small.save(str(tmp_path / "c.json"))
  code, err = _train(capsys, *MODEL, "--cluster", str(tmp_path / "c.json"), "--out", str(tmp_path / "r"))
  assert code == 2 and "group 't' (T4, 1 per device) needs at least 0.01 GB" in err
  assert "set memory_gb ≥ 0.01 in a --cluster spec" in err and not (tmp_path / "r").exists()


def test_batches_that_do_not_fit_the_devices(tmp_path, capsys, cluster8):
  out = tmp_path / "r"
  code, err = _train(capsys, *MODEL, "--set", "fixed_batch=10", "--cluster", cluster8, "--out", str(out))
  assert code == 2 and "gave a batch of 10 examples but the cluster's global batch is 12" in err
  assert not out.exists()  # no empty run directory left behind
  with pytest.raises(BatchError, match="batch of 10 examples"):
    Trainer(make_task(fixed_batch=10), CLUSTER, out_dir=str(out))
  assert not out.exists()


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_the_run_resumes(tmp_path):
  CLUSTER.save(str(tmp_path / "c.json"))
  out = tmp_path / "run"
  args = [
    *MODEL,
    "--cluster",
    str(tmp_path / "c.json"),
    "--steps",
    "40",
    "--out",
    str(out),
    "--local-devices",
    "8",
  ]
  proc = procs.train(args, str(tmp_path / "log.txt"), QSYNC_TEST_BATCH_DELAY_S="0.2")
  try:
    deadline = time.monotonic() + 120
    while "step 3/40" not in (tmp_path / "log.txt").read_text():
      assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()
      time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  log = (tmp_path / "log.txt").read_text()
  assert proc.returncode == 130 and "Traceback" not in log and "ERROR" not in log
  last = log.strip().splitlines()[-1]
  assert last.startswith("qsync train: interrupted at step ") and last.endswith(
    "Resume with the same command and --resume."
  )
  step = int(last.split("interrupted at step ")[1].split(";")[0])
  assert (out / "checkpoints" / str(step)).is_dir()
  proc = procs.train([*args, "--resume"], str(tmp_path / "log2.txt"))
  assert proc.wait(timeout=180) == 0, (tmp_path / "log2.txt").read_text()
  steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(1, 41))


def _wait_for(proc, log_path, needle, timeout_s=120):
  deadline = time.monotonic() + timeout_s
  while needle not in log_path.read_text():
    assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
    time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_the_resumed_run_is_bit_identical(tmp_path):
  """SIGTERM (what Slurm, Kubernetes and preemptible VMs send) after the first step: the run stops
  between two steps, checkpoints, says so in one line and exits 143; ``--resume`` then ends where
  an uninterrupted run ends, bit for bit (int8 with stochastic rounding: the RNG resumes too)."""
  CLUSTER.save(str(tmp_path / "c.json"))
  (tmp_path / "plan.json").write_text(json.dumps({"policies": {"t": "int8"}}))
  common = [*MODEL, "--cluster", str(tmp_path / "c.json"), "--plan", str(tmp_path / "plan.json")]
  common += ["--steps", "12", "--seed", "5", "--lr", "0.01", "--local-devices", "8"]
  stopped, straight = tmp_path / "stopped", tmp_path / "straight"
  log = tmp_path / "log.txt"
  proc = procs.train([*common, "--out", str(stopped)], str(log), QSYNC_TEST_BATCH_DELAY_S="0.3")
  other = procs.train([*common, "--out", str(straight)], str(tmp_path / "straight.txt"))
  try:
    _wait_for(proc, log, "compiled and ran the first step")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert other.wait(timeout=300) == 0, (tmp_path / "straight.txt").read_text()
  finally:
    for p in (proc, other):
      if p.poll() is None:
        p.kill()
  text = log.read_text()
  assert proc.returncode == 143 and "Traceback" not in text and "ERROR" not in text, text
  last = text.strip().splitlines()[-1]
  assert last.startswith("qsync train: terminated (SIGTERM): interrupted at step "), text
  assert last.endswith("Resume with the same command and --resume."), text
  step = int(last.split("interrupted at step ")[1].split(";")[0])
  assert 1 <= step < 12 and (stopped / "checkpoints" / str(step)).is_dir()

  resumed = procs.train([*common, "--out", str(stopped), "--resume"], str(tmp_path / "log2.txt"))
  assert resumed.wait(timeout=300) == 0, (tmp_path / "log2.txt").read_text()
  logged = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged if "loss" in r] == list(range(1, 13))
  expected = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
  assert [r["loss"] for r in logged if "loss" in r] == [r["loss"] for r in expected if "loss" in r]
  states = []
  for out in (stopped, straight):
    trainer = Trainer(
      make_task(),
      CLUSTER,
      Plan.from_json({"policies": {"t": "int8"}}),
      optax.adam(0.01),
      seed=5,
      out_dir=str(out),
      resume=True,
    )
    assert trainer.step == 12
    states.append(trainer.state)
    trainer.close()
  for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sigterm_stops_a_jax_distributed_run(tmp_path):
  """``jax.distributed`` puts its own SIGTERM handler (which only records the signal) in place of
  Python's; ``qsync train --coordinator`` takes it back, so SIGTERM stops that run too."""
  out = tmp_path / "run"
  args = [*MODEL, "--steps", "40", "--out", str(out), "--batch-per-device", "2"]
  args += ["--coordinator", f"localhost:{procs.free_port()}", "--num-processes", "1", "--process-id", "0"]
  log = tmp_path / "log.txt"
  proc = procs.train([*args, "--local-devices", "2"], str(log), QSYNC_TEST_BATCH_DELAY_S="0.3")
  try:
    _wait_for(proc, log, "compiled and ran the first step")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  text = log.read_text()
  assert proc.returncode == 143 and "Traceback" not in text, text
  last = text.strip().splitlines()[-1]
  assert last.startswith("qsync train: terminated (SIGTERM): interrupted at step "), text
  step = int(last.split("interrupted at step ")[1].split(";")[0])
  assert step < 40 and (out / "checkpoints" / str(step)).is_dir()
