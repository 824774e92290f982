"""Gradient accumulation (``Plan.micro_steps``): the full-batch gradient without BatchNorm,
per-micro-batch statistics with it, bad micro-steps refused before any work."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.train.train_step import make_train_step
from tests.qsync_jax.train.tiny import make_task


def _cluster(ba, bt):
  """One A100 and one T4 device (simulated CPUs), per-device batches ``ba`` and ``bt``."""
  return ClusterSpec((DeviceGroup("a", "A100", 1, 40, ba), DeviceGroup("t", "T4", 1, 16, bt)))


def _step(task, cluster, plan, seed=11):
  ts = make_train_step(task, cluster, plan, optax.sgd(0.1), devices=jax.devices()[:2], return_grads=True)
  batch = next(task.train_batches(ts.global_batch, 12))
  state = ts.init(seed, batch)
  new_state, metrics, grads = ts(state, ts.shard(batch))
  return ts, batch, state, new_state, metrics, grads


def test_micro_steps_give_the_full_batch_gradient_without_batchnorm():
  task, cluster = make_task(), _cluster(4, 2)
  ts, _, _, new1, metrics1, grads1 = _step(task, cluster, Plan())
  ts2, _, _, new2, metrics2, grads2 = _step(task, cluster, Plan(micro_steps={"a": 2}))
  assert [b.micro_steps for b in ts2.branches] == [2, 1]
  # fp32 tolerance: the accumulated gradient sums two half-batch partial means, another order.
  for g2, g1 in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads1)):
    np.testing.assert_allclose(g2, g1, rtol=1e-5, atol=1e-6)
  for p2, p1 in zip(jax.tree.leaves(new2.params), jax.tree.leaves(new1.params)):
    np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics2["loss"], metrics1["loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics2["mae"], metrics1["mae"], rtol=1e-6)


def test_batchnorm_statistics_are_per_micro_batch():
  task, cluster = make_task(batchnorm=True), _cluster(4, 2)
  ts, batch, state, new_state, metrics, grads = _step(task, cluster, Plan(micro_steps={"a": 2}))
  variables = {"params": state.params, **state.model_state}

  def hand_loss(params, chunks):
    """The weighted sum of the chunks' losses, BatchNorm over each chunk; the weighted statistics."""
    total, stats = jnp.float32(0.0), None
    for lo, hi in chunks:
      chunk = jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], batch)
      out, upd = task.model.apply(
        {**variables, "params": params}, *task.inputs(chunk), train=True, mutable=["batch_stats"]
      )
      w = jnp.float32((hi - lo) / ts.global_batch)
      total = total + w * task.loss(out, chunk)[0]
      weighted = jax.tree.map(lambda x, w=w: x * w, upd["batch_stats"])
      stats = weighted if stats is None else jax.tree.map(jnp.add, stats, weighted)
    return total, stats

  # Device a's two micro-batches, then device t's batch.
  hand = jax.jit(jax.value_and_grad(hand_loss, has_aux=True), static_argnums=1)
  (loss, stats), ref = hand(state.params, ((0, 2), (2, 4), (4, 6)))
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  # The bias of the Dense before BatchNorm has a true gradient of 0 (BatchNorm subtracts the
  # mean): both sides hold only fp32 round-off there, which BatchNorm's 1/std over a micro-batch
  # of two examples scales up to ~1e-5 (1e-5 of the BatchNorm parameters' gradients, ~0.8), and
  # which differs between two summation orders; it is checked against 0, not against each other.
  for side in (grads, ref):
    assert float(jnp.max(jnp.abs(side["Dense_0"]["bias"]))) < 1e-4
  # fp32 tolerance elsewhere: the same sums in another order (per-device partial sums, then the
  # all-reduce).
  compared = 0
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
    if jax.tree_util.keystr(path) != "['Dense_0']['bias']":
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
      compared += 1
  assert compared == 5
  for g, e in zip(jax.tree.leaves(new_state.model_state["batch_stats"]), jax.tree.leaves(stats)):
    np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
  # Statistics over the halves are not those over device a's whole batch (micro_steps 1, as
  # test_train_step checks): the gradient differs.
  _, whole = hand(state.params, ((0, 4), (4, 6)))
  assert any(not np.allclose(g, w, rtol=1e-3) for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(whole)))


def test_bad_micro_steps_raise_a_plan_error_naming_the_group():
  with pytest.raises(PlanError, match=r"micro_steps\['a'\]=0 must be an integer ≥ 1"):
    Plan.from_json({"micro_steps": {"a": 0}})
  with pytest.raises(PlanError, match=r"'micro_steps' must be an object"):
    Plan.from_json({"micro_steps": 2})
  with pytest.raises(PlanError, match=r"group 'a' .* batch 4 into micro_steps=3 .* Fix"):
    make_train_step(
      make_task(), _cluster(4, 2), Plan(micro_steps={"a": 3}), optax.sgd(0.1), devices=jax.devices()[:2]
    )
  with pytest.raises(PlanError, match=r"micro_steps names group\(s\) \['x'\]"):
    Plan(micro_steps={"x": 2}).validate_for(_cluster(4, 2))


def test_micro_steps_json_and_fingerprint():
  plan = Plan.from_json({"micro_steps": {"a": 2}, "batch_per_device": {"a": 4}})
  assert Plan.from_json(plan.to_json()) == plan and plan.micro_steps_of("t") == 1
  assert Plan(micro_steps={"a": 1}).fingerprint() == Plan().fingerprint()
  assert plan.fingerprint() != Plan(batch_per_device={"a": 4}).fingerprint()


def test_accumulating_plans_refuse_re_planning_and_step_builder_strategies():
  """Re-planning would change the batches the micro-steps divide; SelSync / QSDP build their own
  step, which does not accumulate: both are named errors before any compile."""
  from qsync_jax.errors import QsyncError
  from qsync_jax.train.strategy_step import make_strategy_step
  from qsync_jax.train.trainer import Trainer

  task, cluster = make_task(hidden=8), _cluster(4, 2)
  plan = Plan(micro_steps={"a": 2})
  with pytest.raises(QsyncError, match=r"replan='once'.*accumulates gradients on \['a'\].*replan='off'"):
    Trainer(task, cluster, plan, optax.sgd(0.1), replan="once", devices=jax.devices()[:2])
  with pytest.raises(PlanError, match="micro_steps.*'qsdp'.*does not accumulate"):
    make_strategy_step(task, cluster, plan, optax.sgd(0.1), "qsdp", {}, None, devices=jax.devices()[:2])
