"""The hybrid data-parallel step: full-batch equivalence, per-group precision by structure,
determinism, BatchNorm synchronization, dynamic loss scaling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.train.batching import pad_shards, put_replicated, unpad_shards
from qsync_jax.train.loss_scale import DynamicLossScale, LossScaleState
from qsync_jax.train.train_step import make_train_step
from qsync_jax.train.trainer import Trainer
from tests.jaxpr_dtypes import gemm_dtypes
from tests.qsync_jax.train.tiny import make_task


def _cluster(a, ba, t, bt):
  return ClusterSpec((DeviceGroup("a", "A100", a, 40, ba), DeviceGroup("t", "T4", t, 16, bt)))


def _fresh_batch(task, n):
  return next(task.train_batches(n, 101))


def test_pad_shards_round_trip():
  sizes = (3, 1, 2, 2)
  batch = {"x": np.random.default_rng(102).normal(size=(8, 2)).astype(np.float32)}
  padded = pad_shards(batch, sizes)
  assert padded["x"].shape == (12, 2)
  np.testing.assert_array_equal(unpad_shards(padded, sizes)["x"], batch["x"])
  with pytest.raises(ValueError, match="global batch is 8"):
    pad_shards({"x": batch["x"][:7]}, sizes)


@pytest.mark.parametrize(
  "cluster, plan",
  [
    (_cluster(4, 3, 4, 3), None),  # equal batches: one branch
    (_cluster(3, 3, 3, 3), Plan(batch_per_device={"a": 4, "t": 2})),  # dynamic batch sizing: two branches
    (ClusterSpec.uniform("cpu", 1, 6), None),  # one device: no collectives at all
    (_cluster(2, 3, 3, 2), Plan(batch_per_device={"a": 6, "t": 0})),  # the t group sits out
  ],
)
def test_fp32_step_equals_single_device_grad(cluster, plan):
  """Loss and combined gradient equal ``jax.grad`` of the full-batch loss (catches a stray psum/pmean)."""
  task = make_task()
  devices = jax.devices()[: cluster.num_devices]
  ts = make_train_step(task, cluster, plan, optax.sgd(0.1), devices=devices, return_grads=True)
  if plan is not None and 0 in plan.batch_per_device.values():
    assert ts.mesh.devices.size == plan.apply_to(cluster).num_devices < cluster.num_devices
  batch = _fresh_batch(task, ts.global_batch)
  state = ts.init(103, batch)
  _, metrics, grads = ts(state, ts.shard(batch))

  def full_loss(params):
    out = task.model.apply({"params": params}, *task.inputs(batch))
    return task.loss(out, batch)

  (loss, aux), ref = jax.value_and_grad(full_loss, has_aux=True)(state.params)
  # fp32 tolerance: the trainer sums per-device partial means, a different addition order.
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  np.testing.assert_allclose(metrics["mae"], aux["mae"], rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def _dot_dtypes(jaxpr, found):
  found.update((lhs, rhs) for _, lhs, rhs in gemm_dtypes(jaxpr, ("dot_general",)))
  return found


def _find_cond(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      return eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns") and (found := _find_cond(inner)) is not None:
          return found
  return None


def test_each_group_branch_has_its_planned_dtypes():
  cluster = ClusterSpec(
    (
      DeviceGroup("train", "A100", 4, 40, 2),
      DeviceGroup("infer", "T4", 2, 16, 2),
      DeviceGroup("l4", "L4", 2, 24, 2),
    )
  )
  plan = Plan.from_json({"policies": {"infer": "int8_fwd", "l4": "bf16"}})
  task = make_task()
  ts = make_train_step(task, cluster, plan, optax.sgd(0.1))
  batch = _fresh_batch(task, ts.global_batch)
  state = ts.init(0, batch)
  # the step is a top-level jit with XLA options (it cannot be traced as a nested jit)
  jaxpr = ts.step.trace(state, ts.shard(batch)).jaxpr.jaxpr
  cond = _find_cond(jaxpr)
  assert cond is not None and len(cond.params["branches"]) == 3
  by_group = {
    ts.branches[i].groups: _dot_dtypes(b.jaxpr, set()) for i, b in enumerate(cond.params["branches"])
  }
  assert by_group[("train",)] == {("float32", "float32")}
  assert by_group[("l4",)] == {("bfloat16", "bfloat16")}
  infer = by_group[("infer",)]
  assert ("int8", "int8") in infer and ("float16", "float16") in infer
  assert {d for pair in infer for d in pair} == {"int8", "float16"}
  assert (
    ts.device_branch == tuple(ts.branches.index(b) for b in ts.branches for _ in range(0))
    or len(ts.device_branch) == 8
  )
  assert [ts.branches[i].groups[0] for i in ts.device_branch] == ["train"] * 4 + ["infer"] * 2 + ["l4"] * 2


def test_same_seed_gives_bit_identical_params():
  task = make_task()
  cluster = _cluster(4, 2, 4, 1)
  plan = Plan.from_json({"policies": {"t": "int8"}})  # stochastic gradient rounding: uses the step RNG
  # The second run donates its state buffers, as on accelerators: that must not change a bit.
  runs = [Trainer(task, cluster, plan, optax.adam(1e-2), seed=7, donate=d) for d in (False, True)]
  for trainer in runs:
    trainer.run(3)
  for a, b in zip(jax.tree.leaves(runs[0].state), jax.tree.leaves(runs[1].state)):
    np.testing.assert_array_equal(a, b)
  other = runs[0].program.init(8, next(task.train_batches(cluster.global_batch, 8)))
  assert any(
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(runs[0].params))
  )


def test_batchnorm_running_stats_are_share_weighted_average():
  task = make_task(batchnorm=True)
  cluster = _cluster(2, 3, 2, 1)
  devices = jax.devices()[:4]
  ts = make_train_step(task, cluster, None, optax.sgd(0.0), devices=devices)
  batch = _fresh_batch(task, ts.global_batch)
  state = ts.init(3, batch)
  new_state, _ = ts(state, ts.shard(batch))
  variables = {"params": state.params, **state.model_state}
  expected, start = None, 0
  for b in cluster.device_batch_sizes():
    chunk = jax.tree.map(lambda x, s=start, b=b: x[s : s + b], batch)
    _, upd = task.model.apply(variables, *task.inputs(chunk), train=True, mutable=["batch_stats"])
    weighted = jax.tree.map(lambda x, b=b: x * (b / ts.global_batch), upd["batch_stats"])
    expected = weighted if expected is None else jax.tree.map(jnp.add, expected, weighted)
    start += b
  got = new_state.model_state["batch_stats"]
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
  assert any(not np.allclose(g, s) for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(state.model_state)))


def test_fp16_overflow_skips_step_and_no_inf_reaches_params():
  task = make_task()
  cluster = _cluster(2, 2, 2, 2)
  plan = Plan.from_json({"policies": {"t": "fp16"}})
  ts = make_train_step(
    task,
    cluster,
    plan,
    optax.adam(1e-2),
    devices=jax.devices()[:4],
    loss_scale=DynamicLossScale(growth_interval=2),
  )
  batches = task.train_batches(cluster.global_batch, 104)
  state0 = ts.init(1, next(batches))
  # A loss scale of 2**24 turns dL/dY (~0.1) into ~1e6 > 65504: the fp16 backward overflows.
  state = state0._replace(
    loss_scale=put_replicated(LossScaleState(np.float32(2.0**24), np.int32(0)), ts.mesh)
  )
  for _ in range(3):
    state, metrics = ts(state, ts.shard(next(batches)))
    assert float(metrics["skipped"]) == 1.0
  assert float(state.loss_scale.scale) == 2.0**21 and int(state.step) == 3
  for a, b in zip(
    jax.tree.leaves((state0.params, state0.opt_state)), jax.tree.leaves((state.params, state.opt_state))
  ):
    np.testing.assert_array_equal(a, b)
  # A sane scale trains: finite params that move, and the scale grows after growth_interval steps.
  state = state._replace(loss_scale=put_replicated(LossScaleState(np.float32(2.0**6), np.int32(0)), ts.mesh))
  for _ in range(2):
    state, metrics = ts(state, ts.shard(next(batches)))
    assert float(metrics["skipped"]) == 0.0
  assert float(state.loss_scale.scale) == 2.0**7
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((state.params, state.opt_state)))
  assert any(
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state0.params), jax.tree.leaves(state.params))
  )


def test_dynamic_loss_scale_schedule():
  ls = DynamicLossScale(init_scale=16.0, growth_interval=3, min_scale=2.0)
  s = ls.init()
  scales = []
  for finite in (True, True, True, False, False, False, False, True):
    s = ls.update(s, jnp.bool_(finite))
    scales.append(float(s.scale))
  assert scales == [16.0, 16.0, 32.0, 16.0, 8.0, 4.0, 2.0, 2.0]


def test_evaluate_matches_float_model_on_held_out_batches():
  base = make_task(batchnorm=True)
  rng = np.random.default_rng(105)
  held_out = [next(base.train_batches(n, int(rng.integers(1 << 30)))) for n in (5, 3)]
  task = dataclasses.replace(base, eval_batches=lambda batch_size: iter(held_out))
  trainer = Trainer(task, _cluster(2, 2, 2, 1), None, optax.sgd(0.1), devices=jax.devices()[:4])
  trainer.run(1)
  got = trainer.evaluate(batch_size=8)
  variables = {"params": trainer.params, **trainer.state.model_state}
  losses = [task.loss(task.model.apply(variables, b["x"], train=False), b)[0] for b in held_out]
  np.testing.assert_allclose(got["loss"], (5 * losses[0] + 3 * losses[1]) / 8, rtol=1e-6)
  assert set(got) == {"loss", "mae"}
  assert trainer.evaluate(max_batches=1)["loss"] == pytest.approx(float(losses[0]), rel=1e-6)


class _NormRecordingSync:
  """A GradSync with per-device state: records the norm of what each device hands in."""

  def init(self, params):
    return {"norm": jnp.zeros((), jnp.float32), "calls": jnp.zeros((), jnp.int32)}

  def sync(self, weighted_local_grads, state, key):
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(weighted_local_grads)))
    combined = jax.lax.psum(weighted_local_grads, "data")
    return combined, {"norm": norm, "calls": state["calls"] + 1}


def test_grad_sync_gets_share_weighted_local_grads_and_keeps_per_device_state():
  task = make_task()
  cluster = _cluster(2, 3, 2, 1)
  ts = make_train_step(task, cluster, None, optax.sgd(0.1), _NormRecordingSync(), devices=jax.devices()[:4])
  batch = _fresh_batch(task, ts.global_batch)
  state = ts.init(2, batch)
  assert state.sync_state["norm"].shape == (4,)
  new, _ = ts(state, ts.shard(batch))
  expected, start = [], 0
  for b in cluster.device_batch_sizes():
    chunk = jax.tree.map(lambda x, s=start, b=b: x[s : s + b], batch)
    grads = jax.grad(lambda p, c=chunk: task.loss(task.model.apply({"params": p}, c["x"]), c)[0])(
      state.params
    )
    expected.append(b / ts.global_batch * np.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads))))
    start += b
  np.testing.assert_allclose(new.sync_state["norm"], expected, rtol=1e-5)
  np.testing.assert_array_equal(new.sync_state["calls"], [1, 1, 1, 1])
