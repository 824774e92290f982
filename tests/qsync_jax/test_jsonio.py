"""JSON files: the shared load/save scaffolding, and writes that never leave a partial file."""

import errno
import json
import os
import stat

import pytest

from planners import indicator
from planners.inputs import load_indicator
from planners.profile import Profile
from qsync_jax import jsonio
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import ClusterSpecError, PlanError, PolicyError, QsyncError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from tests.planners.fakes import fake_indicator, fake_profile

PLAN = {"policies": {"infer": {"rules": [{"path": "Dense_0", "policy": "int8_fwd"}], "__default__": "bf16"}}}


def test_each_file_type_round_trips_through_save_and_load(tmp_path):
  plan = Plan.from_json(PLAN)
  policy = plan.policy_for("infer")
  cluster = ClusterSpec.uniform("T4", 2, 8)
  for obj, name in ((plan, "plan.json"), (policy, "policy.json"), (cluster, "cluster.json")):
    obj.save(tmp_path / name)
    assert type(obj).load(tmp_path / name) == obj
    assert type(obj).loads(obj.dumps()) == obj


@pytest.mark.parametrize(
  "cls, error", [(Plan, PlanError), (PrecisionPolicy, PolicyError), (ClusterSpec, ClusterSpecError)]
)
def test_load_errors_name_the_file(tmp_path, cls, error):
  bad = tmp_path / "bad.json"
  bad.write_text('{"nope": 1}')
  with pytest.raises(error, match=rf"{bad}: .*unknown key"):
    cls.load(bad)
  with pytest.raises(error, match=r"cannot be read"):
    cls.load(tmp_path / "missing.json")


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
  path = tmp_path / "plan.json"
  Plan.from_json(PLAN).save(path)
  before = path.read_bytes()

  def full_disk(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(jsonio.os, "fsync", full_disk)
  with pytest.raises(
    PlanError, match=r"plan '.*plan.json' cannot be written \(No space left on device\); nothing"
  ):
    Plan().save(path)
  assert path.read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


def test_writes_refuse_a_device_or_directory_and_a_missing_folder(tmp_path):
  with pytest.raises(PlanError, match=r"'/dev/null' exists and is not a regular file"):
    Plan().save("/dev/null")
  with pytest.raises(PlanError, match=r"exists and is not a regular file"):
    Plan().save(tmp_path)
  with pytest.raises(PlanError, match=r"cannot be written \(No such file or directory\)"):
    Plan().save(tmp_path / "no_such_dir" / "plan.json")
  assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


@pytest.fixture
def umask_022():
  before = os.umask(0o022)
  yield
  os.umask(before)


def test_outputs_get_the_permissions_a_plain_write_gives(tmp_path, umask_022):
  """New files 0o666 less the umask (0o644 here), as ``open(path, "w")`` makes them, not the 0o600
  of a temporary file; an existing file keeps its own mode."""
  profile = fake_profile([(1.0, 1.0, 1.0)])
  writers = {
    "plan.json": lambda path: Plan.from_json(PLAN).save(path),
    "cluster.yaml": lambda path: ClusterSpec.uniform("T4", 2, 8).save(str(path)),
    "profile.json": lambda path: profile.save(str(path)),
    "omega.json": lambda path: indicator.save(fake_indicator(profile.op_names, [1.0]), path),
    "params.msgpack": lambda path: jsonio.write_atomic(
      path, lambda tmp: open(tmp, "wb").close(), "x", QsyncError
    ),
  }
  for name, write in writers.items():
    path = tmp_path / name
    write(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, name
    os.chmod(path, 0o640)
    write(path)  # replaced: keeps the mode the user gave it
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640, name
  assert sorted(os.listdir(tmp_path)) == sorted(writers)  # no temporary file left


def test_a_key_given_twice_is_refused_naming_the_key_and_the_file(tmp_path):
  profile = fake_profile([(1.0, 1.0, 1.0)]).to_json()
  cases = {
    "cluster.json": (ClusterSpec.load, ClusterSpecError, '{"groups": [], "name": "a", "name": "b"}'),
    "plan.json": (Plan.load, PlanError, '{"policies": {"g": "int8", "g": "fp32"}}'),
    "policy.json": (
      PrecisionPolicy.load,
      PolicyError,
      '{"rules": [], "__default__": "int8", "__default__": null}',
    ),
    "omega.json": (
      indicator.load,
      QsyncError,
      '{"format": "qsync-indicator/1", "omega": {"a": {"int8": 1, "int8": 2}}}',
    ),
    "plan_input.json": (load_indicator, PlanError, '{"omega": {}, "omega": {}}'),
    "profile.json": (Profile.load, PlanError, json.dumps(profile)[:-1] + ', "optimizer_ms": 5.0}'),
  }
  for name, (load, error, text) in cases.items():
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(
      error, match=rf"{path} gives key '.*' twice in one object.*Fix: keep the one you mean"
    ):
      load(str(path))


def test_json_lines_keep_what_they_cannot_read(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1}\n\xff\xfe not text\nnot json\n{"step": 2}')
  lines, undecodable = jsonio.read_json_lines(str(path))
  assert [line.value for line in lines] == [{"step": 1}, None, None, {"step": 2}]
  assert undecodable == [2] and [line.complete for line in lines] == [True, True, True, False]
  assert b"".join(line.raw for line in lines) == path.read_bytes()
  path.write_bytes(b"\xff{}")
  with pytest.raises(PlanError, match=r"plan '.*' is not UTF-8 text \(byte 0 is b'\\xff'\).*Fix"):
    Plan.load(path)
