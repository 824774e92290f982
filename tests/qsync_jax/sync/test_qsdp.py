"""QSDP: sharded parameters and optimizer state, int8 all-gather, integer reduce-scatter."""

import jax
import numpy as np
import optax
import pytest

from planners.profiler import hlo
from qsync_jax.errors import QsyncError
from qsync_jax.sync import make_qsdp_step
from tests.qsync_jax.sync import toy

N = 8
BUCKET = 64


def _sgd_reference(params, batch, lr):
  loss, grads = jax.value_and_grad(toy.loss_fn)(params, batch, None)
  return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads)


def test_full_precision_qsdp_equals_full_batch_sgd(mesh):
  """With fp32 payloads QSDP is exactly FSDP: the sharding and padding change nothing."""
  params = toy.init_params(jax.random.key(201))
  batch = toy.make_batch(jax.random.key(202), 8 * N)
  trainer = make_qsdp_step(
    toy.loss_fn, optax.sgd(0.5), params, mesh, bucket_size=BUCKET, weight_payload="fp32", grad_payload="fp32"
  )
  state = trainer.init(params)
  assert state["params"]["hidden"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("data")
  state, metrics = trainer.step(state, batch, jax.random.key(0))
  loss, want = _sgd_reference(params, batch, 0.5)
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
  for got, w in zip(jax.tree.leaves(trainer.gather(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(w), atol=1e-5)


def test_quantized_qsdp_step_is_close_to_sgd(mesh):
  params = toy.init_params(jax.random.key(203))
  batch = toy.make_batch(jax.random.key(204), 8 * N)
  trainer = make_qsdp_step(toy.loss_fn, optax.sgd(0.5), params, mesh, bucket_size=BUCKET)
  state, metrics = trainer.step(trainer.init(params), batch, jax.random.key(205))
  loss, want = _sgd_reference(params, batch, 0.5)
  # int8 weights (absmax/127 per 64-value bucket): the loss moves by well under 1 %
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-2)
  for got, w, p in zip(
    jax.tree.leaves(trainer.gather(state)), jax.tree.leaves(want), jax.tree.leaves(params)
  ):
    step = np.abs(np.asarray(w) - np.asarray(p)).max()
    # error of the update: int8 weight noise through the gradient plus integer gradient levels (L = 15)
    assert np.abs(np.asarray(got) - np.asarray(w)).max() < 0.35 * step + 1e-6


def test_hlo_all_gather_moves_int8(mesh):
  params = toy.init_params(jax.random.key(0))
  trainer = make_qsdp_step(toy.loss_fn, optax.adam(1e-3), params, mesh, bucket_size=BUCKET)
  state = trainer.init(params)
  text = hlo.compiled_text(trainer.step, state, toy.make_batch(jax.random.key(1), 8 * N), jax.random.key(2))
  found = hlo.collectives(text)
  kernels = [x for x in jax.tree.leaves(params) if x.ndim > 1]
  padded = sum(-(-x.size // (N * BUCKET)) * N * BUCKET for x in kernels)
  gathers = [c for c in found if c.op == "all-gather"]
  assert sum(c.bytes for c in gathers if c.dtypes == ("s8",)) == padded  # one byte per kernel weight
  fp32_gathered = sum(c.bytes for c in gathers if c.dtypes == ("f32",))  # bucket scales and biases
  assert (
    fp32_gathered
    <= 4 * (padded // BUCKET) + 4 * sum(x.size for x in jax.tree.leaves(params) if x.ndim <= 1) + 64
  )
  scatters = [c for c in found if c.op == "reduce-scatter"]
  assert sum(c.bytes for c in scatters if c.dtypes == ("s8",)) == padded
  # all-reduces: only the pmax of the gradient bucket maxima and the loss (no fp32 gradient sum)
  assert sum(c.bytes for c in found if c.op == "all-reduce") <= 4 * (padded // BUCKET) + 64


def test_bad_options():
  params = toy.init_params(jax.random.key(0))
  with pytest.raises(QsyncError, match="weight_payload"):
    make_qsdp_step(toy.loss_fn, optax.sgd(0.1), params, weight_payload="int4")
  with pytest.raises(QsyncError, match="grad_payload"):
    make_qsdp_step(toy.loss_fn, optax.sgd(0.1), params, grad_payload="bf16")
