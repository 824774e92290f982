"""``qsync train --plan`` runs the gradient sync the plan names (``Plan.sync``, ``qsync plan --sync``)
and refuses one that contradicts it, before any work."""

import json

import numpy as np

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.train import trainer


def _files(tmp_path, sync):
  cluster, plan = tmp_path / "c.json", tmp_path / "plan.json"
  ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1))).save(str(cluster))
  plan.write_text(json.dumps({"policies": {}, "optimizer_update": "replicated", "sync": sync}))
  return ["--model", "tests.trainer.tiny:make_task", "--cluster", str(cluster), "--plan", str(plan)]


def test_train_runs_the_plans_sync(tmp_path, monkeypatch, capsys):
  built = []
  real = trainer.make_grad_sync

  def spy(name, **options):
    built.append(name)
    return real(name, **options)

  monkeypatch.setattr(trainer, "make_grad_sync", spy)
  args = [*_files(tmp_path, "bf16"), "--steps", "1", "--out", str(tmp_path / "run")]
  assert cli.main(["train", *args]) == 0, capsys.readouterr().err
  assert built == ["bf16"]  # the plan's payload, without --sync
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert all(np.isfinite(x["loss"]) for x in lines if "loss" in x)


def test_train_refuses_a_sync_the_plan_contradicts_before_any_work(tmp_path, capsys):
  args = [*_files(tmp_path, "bf16"), "--sync", "global_qsgd", "--steps", "2", "--out", str(tmp_path / "run")]
  assert cli.main(["train", *args]) == 2
  err = capsys.readouterr().err
  assert "'global_qsgd' contradicts the plan's sync 'bf16'" in err and "Fix:" in err
  assert not (tmp_path / "run" / "metrics.jsonl").exists()
