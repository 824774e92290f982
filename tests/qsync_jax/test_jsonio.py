"""JSON files: the shared load/save scaffolding, and writes that never leave a partial file."""

import errno
import os

import pytest

from qsync_jax import jsonio
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import ClusterSpecError, PlanError, PolicyError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy

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
  with pytest.raises(PlanError, match=r"plan '.*plan.json' cannot be written \(No space left on device\); nothing"):
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
