"""The trainer runs a task whose model is a flax.nnx module: hybrid plans, BatchNorm, dropout,
checkpoints under the module's own names, resume, and a step-builder strategy."""

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.models.nnx_model import NnxModel
from qsync_jax.plan import Plan
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import make_nnx_task

pytestmark = pytest.mark.standard_promotion  # optax.adam is not strict-promotion clean

CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 6, 40, 3), DeviceGroup("t", "T4", 2, 16, 1)))
PLAN = Plan.from_json({"policies": {"t": "int8"}})  # stochastic rounding and dropout: two RNG streams


def test_nnx_task_trains_under_a_hybrid_plan_and_its_loss_falls():
  task = make_nnx_task()
  assert isinstance(task.model, NnxModel)
  trainer = Trainer(task, CLUSTER, PLAN, optax.adam(0.02), seed=0)
  losses = []
  trainer.run(40, callback=lambda step, metrics: losses.append(metrics["loss"]))
  assert np.isfinite(losses).all()
  # A linear target through dropout: 40 steps halve the loss (ratio 0.50 to 0.51 on seeds 0-2).
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
  stats = trainer.state.model_state["batch_stats"]["norm"]
  assert np.abs(np.asarray(stats["mean"])).sum() > 0  # the synchronized running statistics moved


def test_nnx_checkpoint_holds_the_module_names_and_resumes_bit_identically(tmp_path):
  task = make_nnx_task()
  out = str(tmp_path / "run")
  first = Trainer(task, CLUSTER, PLAN, optax.adam(0.02), seed=0, out_dir=out)
  first.run(3)
  first.close()
  params, meta = first.checkpoints.read_params()
  assert sorted(params) == ["hidden", "norm", "out"] and sorted(params["norm"]) == ["bias", "scale"]
  assert meta["step"] == 3
  resumed = Trainer(task, CLUSTER, PLAN, optax.adam(0.02), seed=0, out_dir=out, resume=True)
  assert resumed.step == 3
  first.run(6)
  resumed.run(6)
  for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(first.state)):
    np.testing.assert_array_equal(a, b)
  resumed.close()


def test_nnx_task_under_selsync():
  task = make_nnx_task(batchnorm=False)
  trainer = Trainer(task, CLUSTER, PLAN, optax.adam(0.02), grad_sync="selsync", seed=0)
  losses = []
  trainer.run(20, callback=lambda step, metrics: losses.append(metrics["loss"]))
  assert np.isfinite(losses).all() and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  assert sorted(trainer.params) == ["hidden", "out"]
