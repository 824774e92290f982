"""SelSync and QSDP run in the ``Trainer`` (``qsync_jax.train.strategy_step``): plans with several
policies and batch sizes, checkpoints, evaluation at the consolidated parameters."""

import dataclasses
import shutil

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import CheckpointError, PlanError, QsyncError
from qsync_jax.plan import Plan
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import _batches, make_task

# Two groups with different per-device batches (dynamic batch sizing) and, per test, policies.
CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 6, 40, 3), DeviceGroup("b", "A100", 2, 40, 1)))
UNIFORM = ClusterSpec.uniform("cpu", 8, 2)
# Exact payloads: SelSync averaging gradients every step and QSDP with fp32 collectives are the
# hybrid trainer's synchronous SGD, computed another way.
EXACT = {
  "selsync": {"mode": "grads", "warmup": 1000},
  "qsdp": {"weight_payload": "fp32", "grad_payload": "fp32"},
}
LOSSY = {"selsync": {"warmup": 3}, "qsdp": {"bucket_size": 16}}


def _task():
  eval_seed = 101
  return dataclasses.replace(
    make_task(), eval_batches=lambda n: [next(_batches(n, eval_seed))], eval_kwargs={}
  )


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["selsync", "qsdp"])
def test_multi_policy_plan_runs_each_groups_policy_and_batch(name):
  task, seed = _task(), 102
  plan = Plan.from_json({"policies": {"b": "bf16"}})
  strategy = Trainer(task, CLUSTER, plan, optax.sgd(0.1), grad_sync=name, sync_options=EXACT[name], seed=seed)
  hybrid = Trainer(task, CLUSTER, plan, optax.sgd(0.1), seed=seed)
  float_only = Trainer(task, CLUSTER, None, optax.sgd(0.1), seed=seed)
  # The same initial parameters for one seed (SelSync: each device's copy; its consolidated
  # params are a weighted average of the copies, exact only to 1 ulp).
  stored = strategy.state.strategy["params"]
  _same(jax.tree.map(lambda x: x[0], stored) if name == "selsync" else strategy.params, hybrid.params)
  for _ in range(3):
    got, want = strategy.train_step(), hybrid.train_step()
    float_only.train_step()
    # Same sums in another order (psum vs psum_scatter, weights folded in elsewhere): fp32 rounding.
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  for x, y in zip(jax.tree.leaves(strategy.params), jax.tree.leaves(hybrid.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # fp32 rounding, as above

  def gap(other):
    pairs = zip(jax.tree.leaves(strategy.params), jax.tree.leaves(other.params))
    return max(float(np.max(np.abs(x - y))) for x, y in pairs)

  # The bf16 group really ran bf16: without the plan the parameters move by far more.
  assert gap(float_only) > 20 * gap(hybrid), (gap(float_only), gap(hybrid))
  evaluated = strategy.evaluate()
  assert evaluated["loss"] == pytest.approx(hybrid.evaluate()["loss"], rel=1e-5)  # fp32 rounding


@pytest.mark.parametrize("name", ["selsync", "qsdp"])
def test_resume_is_bit_identical(tmp_path, name):
  task, seed = make_task(), 103

  def trainer(out=None, resume=False, **options):  # QSDP rounds stochastically: its keys must resume too
    options = {**LOSSY[name], **options}
    return Trainer(
      task,
      UNIFORM,
      None,
      optax.adam(1e-2),
      grad_sync=name,
      sync_options=options,
      seed=seed,
      out_dir=out,
      resume=resume,
    )

  first = trainer(str(tmp_path / "a"))
  first.run(2)
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  resumed = trainer(str(tmp_path / "b"), resume=True)
  assert resumed.step == 2 and resumed.data_position == 2
  metrics = []
  resumed.run(5, callback=lambda step, m: metrics.append(m))
  first.run(5)  # uninterrupted
  _same(resumed.state, first.state)
  if name == "selsync":  # warm-up steps 1-3 synchronize (across the resume); after that only
    # steps whose gradient-norm change exceeds δ do, which depends on the random seed.
    assert metrics[0]["synced"] == 1.0
    assert int(resumed.state.strategy["syncs"]) == 2 + sum(int(m["synced"]) for m in metrics)
  other = "window" if name == "selsync" else "bucket_size"
  with pytest.raises(CheckpointError, match="different sync strategy or options.*Fix:"):
    trainer(str(tmp_path / "b"), resume=True, **{other: 32})
  first.close()
  resumed.close()


def test_unsupported_combinations_are_refused():
  task = make_task()
  with pytest.raises(PlanError, match="fp16 legs.*Fix:"):
    Trainer(task, CLUSTER, Plan.from_json({"policies": {"b": "fp16"}}), grad_sync="qsdp")
  with pytest.raises(QsyncError, match="has no option 'delta'.*Fix:"):
    Trainer(task, CLUSTER, None, grad_sync="qsdp", sync_options={"delta": 0.1})
  with pytest.raises(QsyncError, match="BatchNorm"):
    Trainer(make_task(batchnorm=True), CLUSTER, None, grad_sync="selsync")
