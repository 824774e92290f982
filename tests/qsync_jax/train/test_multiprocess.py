"""The trainer as 2 processes × 2 CPU devices (jax.distributed, gloo): equal to one process;
a dead peer ends the survivor with a clear error in bounded time."""

import json
import signal
import time

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train import procs
from tests.qsync_jax.train.tiny import make_task

CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 2, 40, 4), DeviceGroup("t", "T4", 2, 16, 2)))
PLAN = Plan.from_json({"policies": {"t": "int8_fwd"}})


def _launch(tmp_path, steps, *extra, **env):
  CLUSTER.save(str(tmp_path / "cluster.json"))
  PLAN.save(str(tmp_path / "plan.json"))
  port = procs.free_port()
  common = ["--model", "tests.qsync_jax.train.tiny:make_task", "--cluster", str(tmp_path / "cluster.json")]
  common += ["--plan", str(tmp_path / "plan.json"), "--steps", str(steps), "--out", str(tmp_path / "run")]
  common += ["--optimizer", "adam", "--lr", "0.01", "--seed", "3", "--coordinator", f"localhost:{port}"]
  common += ["--num-processes", "2", "--local-devices", "2", "--step-timeout", "30"]
  common += ["--heartbeat-timeout", "10", *extra]
  return [
    procs.train([*common, "--process-id", str(i)], str(tmp_path / f"log{i}.txt"), **env) for i in range(2)
  ]


def _finish(processes, timeout):
  deadline = time.monotonic() + timeout
  try:
    for p in processes:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
        p.wait()


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
  processes = _launch(tmp_path, steps=3)
  _finish(processes, timeout=240)
  logs = [(tmp_path / f"log{i}.txt").read_text() for i in range(2)]
  assert [p.returncode for p in processes] == [0, 0], logs
  # The checkpoint both processes wrote, read back here on 4 local devices.
  task = make_task()
  devices = jax.devices()[:4]
  restored = Trainer(
    task, CLUSTER, PLAN, optax.adam(0.01), seed=3, devices=devices, out_dir=str(tmp_path / "run"), resume=True
  )
  assert restored.step == 3
  single = Trainer(task, CLUSTER, PLAN, optax.adam(0.01), seed=3, devices=devices)
  single.run(3)
  # fp32 tolerance: gloo sums across processes in another order than one process's all-reduce.
  for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(single.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_every_process_takes_the_same_replan_decision(tmp_path):
  """``--replan auto``: each process measures its own groups, all gather the measurements and
  decide alike (the split must be the same everywhere, or the step would not run); and the
  processes, which time their own steps, agree on when to measure (step 23 ends the first timed
  window of 20 steps after 3 untimed ones: the decision; step 45 the window that measures the new
  split: collectives every process must join, or the job would hang)."""
  processes = _launch(tmp_path, 45, "--replan", "auto")
  _finish(processes, timeout=240)
  logs = [(tmp_path / f"log{i}.txt").read_text() for i in range(2)]
  assert [p.returncode for p in processes] == [0, 0], logs
  decisions = [line for line in logs[0].splitlines() if line.startswith("replan: step 23: measured")]
  assert len(decisions) == 1, logs[0][-2000:]
  assert "split 4/2 -> " in decisions[0]
  replans = [
    json.loads(x)["replan"]
    for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    if '"replan"' in x
  ]
  assert replans[0]["step"] == 23 and set(replans[0]["ms_per_example"]) == {"a", "t"}
  assert "step 45/45" in logs[0]


@pytest.mark.slow
def test_dead_peer_stops_the_other_process_with_a_clear_error(tmp_path):
  processes = _launch(tmp_path, steps=200, QSYNC_TEST_BATCH_DELAY_S="0.2")
  try:
    deadline = time.monotonic() + 180
    while "step 2/" not in (tmp_path / "log0.txt").read_text():
      assert all(p.poll() is None for p in processes), (tmp_path / "log0.txt").read_text()
      assert time.monotonic() < deadline, "training did not start within 180 s"
      time.sleep(0.2)
    processes[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    processes[0].wait(timeout=90)  # heartbeat timeout 10 s, step watchdog 30 s: well within 90 s
    waited = time.monotonic() - killed
  finally:
    _finish(processes, timeout=1)
  log = (tmp_path / "log0.txt").read_text()
  assert processes[0].returncode != 0
  assert "step 200/200" not in log and waited < 90
  assert "another task died" in log or "peer process has probably died" in log, log[-2000:]


def test_watchdog_ends_a_hung_process():
  """A peer that hangs instead of dying: the watchdog ends the process with a clear line."""
  import subprocess
  import sys

  code = (
    "import time\n"
    "from qsync_jax.train.distributed import Watchdog\n"
    "w = Watchdog(1.0).start()\n"
    "w.beat()\n"
    "time.sleep(30)\n"
  )
  t0 = time.monotonic()
  done = subprocess.run(
    [sys.executable, "-c", code], env=procs.env(), capture_output=True, text=True, timeout=60
  )
  assert done.returncode == 3 and time.monotonic() - t0 < 25
  assert "made no progress" in done.stderr and "--resume" in done.stderr
