"""``qsync train`` rejects bad input with one clear line and exit status 2 (before any step)."""

import json

import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup


@pytest.fixture
def cluster8(tmp_path):
  path = tmp_path / "c8.json"
  ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1))).save(str(path))
  return str(path)


def _train(tmp_path, *extra):
  return cli.main(["train", "--steps", "2", "--out", str(tmp_path / "run"), *extra])


@pytest.mark.parametrize(
  "args, needle",
  [
    (["--model", "no_such_task"], "unknown task"),
    (["--model", "tests.qsync_jax.train.tiny:nope"], "has no attribute 'nope'"),
    (["--model", "no_such_pkg.mod:make"], "no module named 'no_such_pkg' on the Python path"),
    (["--model", "tests.qsync_jax.train.tiny:make_task", "--set", "hidden"], "is not KEY=VALUE"),
  ],
)
def test_bad_model_argument(tmp_path, capsys, cluster8, args, needle):
  assert _train(tmp_path, *args, "--cluster", cluster8) == 2
  err = capsys.readouterr().err
  # The error is the last line; before it only the line saying which model is loading.
  *before, last = err.splitlines()
  assert last.startswith("qsync train: error:") and needle in last and "Fix" in last
  assert all(line.startswith("loading --model") for line in before), err


def test_cluster_with_other_device_count(tmp_path, capsys):
  path = tmp_path / "c4.json"
  ClusterSpec.uniform("T4", 4, 2).save(str(path))
  assert _train(tmp_path, "--model", "tests.qsync_jax.train.tiny:make_task", "--cluster", str(path)) == 2
  err = capsys.readouterr().err
  assert "has 4 devices (all=4) but the job has 8. Fix: pass --local-devices 4 (simulated CPU devices)" in err


def test_device_count_fix_names_local_devices_first():
  """The fix names the command's own --local-devices N first (per process); GPUs name running on
  as many GPUs first, since --local-devices only simulates CPU devices."""
  from types import SimpleNamespace

  from qsync_cli.train import check_device_count
  from qsync_jax.errors import ClusterSpecError

  spec = ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 2, 16, 1)))
  cpus, gpus = [SimpleNamespace(platform="cpu")] * 4, [SimpleNamespace(platform="gpu")] * 4
  with pytest.raises(
    ClusterSpecError, match=r"has 6 devices \(a=4, t=2\) but the job has 4\. Fix: pass --local-devices 6 "
  ):
    check_device_count(spec, cpus, 1)
  with pytest.raises(
    ClusterSpecError,
    match=r"Fix: pass --local-devices 3 \(simulated CPU devices in each of the 2 processes\)",
  ):
    check_device_count(spec, cpus, 2)
  with pytest.raises(
    ClusterSpecError, match=r"Fix: run on 6 GPUs .*JAX_PLATFORMS=cpu and pass --local-devices 6\."
  ):
    check_device_count(spec, gpus, 1)
  check_device_count(spec, cpus + cpus[:2], 1)  # as many: no error


def test_plan_for_unknown_group_and_existing_run(tmp_path, capsys, cluster8):
  plan = tmp_path / "plan.json"
  plan.write_text(json.dumps({"policies": {"gpu": "int8_fwd"}}))
  model = ["--model", "tests.qsync_jax.train.tiny:make_task", "--cluster", cluster8]
  assert _train(tmp_path, *model, "--plan", str(plan)) == 2
  assert "names group(s) ['gpu']" in capsys.readouterr().err
  (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
  assert _train(tmp_path, *model) == 2
  assert "already holds checkpoints" in capsys.readouterr().err


def test_train_is_registered():
  parser = cli.build_parser()
  args = parser.parse_args(["train", "--model", "m", "--steps", "3", "--out", "o", "--resume"])
  assert args.resume and args.steps == 3 and args.command == "train"


def test_compilation_cache_is_written_and_reused(tmp_path):
  """``--compilation-cache``: the first run writes its compiled programs there, a second run
  with the same step finds them (fresh processes: JAX initialises its cache once)."""
  import os
  import subprocess
  import sys

  cache = tmp_path / "cache"
  env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu"}
  cmd = [
    sys.executable,
    "-m",
    "qsync_cli",
    "train",
    "--model",
    "tests.qsync_jax.train.tiny:make_task",
    "--steps",
    "1",
  ]
  cmd += ["--local-devices", "2", "--batch-per-device", "2", "--compilation-cache", str(cache)]
  subprocess.run([*cmd, "--out", str(tmp_path / "a")], env=env, check=True, capture_output=True)
  entries = set(os.listdir(cache))
  assert entries  # compiled programs were written
  subprocess.run([*cmd, "--out", str(tmp_path / "b")], env=env, check=True, capture_output=True)
  assert set(os.listdir(cache)) == entries  # the same programs: found, none added
