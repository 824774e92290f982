"""``qsync train --plan`` runs the gradient sync the plan names (``Plan.sync``, ``qsync plan --sync``)
and refuses one that contradicts it, before any work."""

import json

import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.train import trainer


def _files(tmp_path, sync):
  cluster, plan = tmp_path / "c.json", tmp_path / "plan.json"
  ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1))).save(str(cluster))
  plan.write_text(json.dumps({"policies": {}, "optimizer_update": "replicated", "sync": sync}))
  return ["--model", "tests.qsync_jax.train.tiny:make_task", "--cluster", str(cluster), "--plan", str(plan)]


class Stop(Exception):
  """Raised by the stand-in trainer: what it was given is all the test needs."""


def test_train_runs_the_plans_sync(tmp_path, monkeypatch):
  given = {}

  def trainer_stand_in(*args, **kwargs):
    given.update(kwargs)
    raise Stop

  monkeypatch.setattr(trainer, "Trainer", trainer_stand_in)
  args = [*_files(tmp_path, "bf16"), "--steps", "1", "--out", str(tmp_path / "run")]
  with pytest.raises(Stop):
    cli.main(["train", *args])
  assert given["grad_sync"] == "bf16"  # the plan's payload, without --sync
  with pytest.raises(Stop):
    cli.main(["train", *args, "--sync", "bf16"])  # the same, named: no contradiction
  assert given["grad_sync"] == "bf16"


def test_train_refuses_a_sync_the_plan_contradicts_before_any_work(tmp_path, capsys):
  args = [*_files(tmp_path, "bf16"), "--sync", "global_qsgd", "--steps", "2", "--out", str(tmp_path / "run")]
  assert cli.main(["train", *args]) == 2
  err = capsys.readouterr().err
  assert "'global_qsgd' contradicts the plan's sync 'bf16'" in err and "Fix:" in err
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_trainer_refuses_a_sync_its_plan_contradicts():
  from qsync_jax.errors import PlanError
  from qsync_jax.plan import Plan
  from tests.qsync_jax.train.tiny import make_task

  cluster = ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1)))
  with pytest.raises(PlanError, match="'fp16' contradicts the plan's sync 'bf16'"):
    trainer.Trainer(make_task(), cluster, Plan(sync="bf16"), grad_sync="fp16", progress=None)
