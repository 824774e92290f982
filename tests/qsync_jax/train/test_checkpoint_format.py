"""Checkpoint layout: the model's own pytree, restorable by a plain orbax call without qsync on
other devices; export; old-format checkpoints refused; no orbax ERROR lines on success."""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

from qsync_cli.main import main as cli_main
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import CheckpointError
from qsync_jax.plan import Plan
from qsync_jax.train.export import export_params
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train import procs
from tests.qsync_jax.train.tiny import make_task

CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 6, 40, 3), DeviceGroup("t", "T4", 2, 16, 1)))
PLAN = Plan.from_json({"policies": {"t": "int8"}})


def _digests(tree) -> dict[str, str]:
  return {
    jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 2-step run on 8 devices (two groups), checkpointed; its trainer (closed) and directory."""
  out = str(tmp_path_factory.mktemp("fmt") / "run")
  trainer = Trainer(make_task(), CLUSTER, PLAN, optax.adam(0.01), seed=1, out_dir=out)
  trainer.run(2)
  trainer.close()
  return trainer, out


# What a user without qsync runs: orbax alone, in a fresh process with one CPU device.
PLAIN_RESTORE = """
import hashlib, json, sys
import jax, numpy as np, orbax.checkpoint as ocp

directory = sys.argv[1]
params = ocp.StandardCheckpointer().restore(directory + "/2/params")
manager = ocp.CheckpointManager(
  directory,
  item_handlers={"params": ocp.StandardCheckpointHandler(), "state": ocp.StandardCheckpointHandler(),
                 "meta": ocp.JsonCheckpointHandler()},
)
ckpt = manager.restore(manager.latest_step())
digest = lambda t: {jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()
                    for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
print(json.dumps({
  "params": digest(params),
  "state_params": digest(ckpt["state"]["params"]),
  "mu": digest(ckpt["state"]["opt_state"]["0"]["mu"]),
  "meta": {k: ckpt["meta"][k] for k in ("plan", "plan_fingerprint", "cluster", "step")},
  "devices": jax.device_count(),
  "qsync_loaded": any(m.startswith("qsync_jax") for m in sys.modules),
}))
"""


def test_plain_orbax_restore_in_a_fresh_process_without_qsync(run, tmp_path):
  trainer, out = run
  env = procs.env()
  env.pop("PYTHONPATH")
  result = subprocess.run(
    [sys.executable, "-c", PLAIN_RESTORE, os.path.join(out, "checkpoints")],
    cwd=str(tmp_path),
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  got = json.loads(result.stdout.splitlines()[-1])
  assert got["devices"] == 1 and not got["qsync_loaded"]  # saved on 8 devices, read on 1
  want = _digests(trainer.params)
  assert got["params"] == want and got["state_params"] == want
  assert set(want) == {
    "['Dense_0']['bias']",
    "['Dense_0']['kernel']",
    "['Dense_1']['bias']",
    "['Dense_1']['kernel']",
  }
  assert got["mu"] == _digests(trainer.state.opt_state[0].mu)
  assert got["meta"]["plan"] == PLAN.to_json() and got["meta"]["step"] == 2
  assert got["meta"]["plan_fingerprint"] == PLAN.fingerprint()
  assert got["meta"]["cluster"] == [["a", 6, 3], ["t", 2, 1]]
  assert "ERROR" not in result.stderr and "WARNING" not in result.stderr, result.stderr


def test_export_msgpack_and_orbax_directory(run, tmp_path):
  trainer, out = run
  umask = os.umask(0o022)
  try:
    summary = export_params(out, str(tmp_path / "params.msgpack"))
  finally:
    os.umask(umask)
  assert summary["step"] == 2 and summary["format"] == "msgpack" and summary["arrays"] == 4
  assert os.stat(tmp_path / "params.msgpack").st_mode & 0o777 == 0o644  # as open(path, "w") under umask 022
  restored = serialization.msgpack_restore((tmp_path / "params.msgpack").read_bytes())
  assert _digests(restored) == _digests(trainer.params)
  x = np.ones((2, 6), np.float32)  # the exported params drive the plain linen model
  np.testing.assert_array_equal(
    trainer.task.model.apply({"params": restored}, x), trainer.task.model.apply({"params": trainer.params}, x)
  )
  assert cli_main(["export", "--run", out, "--step", "2", "--out", str(tmp_path / "params_dir")]) == 0
  assert _digests(ocp.StandardCheckpointer().restore(str(tmp_path / "params_dir"))) == _digests(
    trainer.params
  )


def test_export_of_a_step_not_saved_names_the_steps_there_are(run, tmp_path, capsys):
  _, out = run
  assert cli_main(["export", "--run", out, "--step", "99", "--out", str(tmp_path / "p.msgpack")]) == 2
  err = capsys.readouterr().err
  assert "there is no checkpoint of step 99 in" in err and "its checkpoints are of steps [2]" in err, err
  assert "Fix: pass one of those steps, or none for the latest (2)" in err and "corrupted" not in err
  assert not (tmp_path / "p.msgpack").exists()


def test_export_refuses_unusable_outputs_and_overwrites_nothing(run, tmp_path, capsys):
  _, out = run
  existing = tmp_path / "old.msgpack"
  existing.write_bytes(b"keep me")
  full_dir = tmp_path / "full"
  full_dir.mkdir()
  (full_dir / "x").write_text("keep me")
  cases = [
    (str(existing), "already exists \\(a file\\)"),
    (str(full_dir), "already exists \\(a non-empty directory\\)"),
    (str(tmp_path / "missing" / "p.msgpack"), "does not exist"),
  ]
  for target, needle in cases:
    assert cli_main(["export", "--run", out, "--out", target]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Fix:" in err
    assert __import__("re").search(needle, err), err
  assert existing.read_bytes() == b"keep me" and (full_dir / "x").read_text() == "keep me"
  assert cli_main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "p.msgpack")]) == 2
  assert "has no checkpoints/ directory" in capsys.readouterr().err


def test_export_onto_a_full_disk_is_one_named_error_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
  import errno

  from qsync_jax import jsonio

  _, out = run

  def full_disk(src, dst):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(jsonio.os, "replace", full_disk)
  target = tmp_path / "p.msgpack"
  assert cli_main(["export", "--run", out, "--out", str(target)]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "No space left on device" in err and "Fix:" in err
  assert list(tmp_path.iterdir()) == []  # no partial file, no temporary file


def test_old_format_checkpoint_is_refused_with_the_fix(tmp_path, capsys):
  out = tmp_path / "run"
  manager = ocp.CheckpointManager(str(out / "checkpoints"))
  leaves = {f"{i:04d}": np.zeros(3, np.float32) for i in range(3)}  # format 1: numbered leaves
  manager.save(
    2,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave({"format": 1, "step": 2})
    ),
  )
  manager.wait_until_finished()
  manager.close()
  with pytest.raises(CheckpointError, match=r"format 1.*numbered leaves.*Fix: start a new run"):
    Trainer(make_task(), CLUSTER, PLAN, optax.adam(0.01), seed=1, out_dir=str(out), resume=True)
  assert cli_main(["export", "--run", str(out), "--out", str(tmp_path / "p.msgpack")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "format 1" in err and "Traceback" not in err
  assert not (tmp_path / "p.msgpack").exists()


@pytest.mark.slow
def test_successful_train_and_resume_print_no_error_lines(tmp_path):
  out = str(tmp_path / "run")
  args = ["--model", "tests.qsync_jax.train.tiny:make_task", "--out", out, "--local-devices", "2"]
  args += ["--checkpoint-every", "1", "--seed", "2"]
  first = subprocess.run(
    [sys.executable, "-m", "qsync_cli", "train", *args, "--steps", "3"],
    cwd=procs.ROOT,
    env=procs.env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert first.returncode == 0, first.stderr
  assert "step 3/3" in first.stderr
  # What a killed run can leave: orbax's own step metadata (times; qsync does not use it) cut short.
  for step in ("2", "3"):
    open(os.path.join(out, "checkpoints", step, "_CHECKPOINT_METADATA"), "w").close()
  second = subprocess.run(
    [sys.executable, "-m", "qsync_cli", "train", *args, "--steps", "5", "--resume"],
    cwd=procs.ROOT,
    env=procs.env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert second.returncode == 0, second.stderr
  assert "resumed" in second.stderr and "step 5/5" in second.stderr
  for result in (first, second):
    assert not [line for line in result.stderr.splitlines() if "ERROR" in line], result.stderr
