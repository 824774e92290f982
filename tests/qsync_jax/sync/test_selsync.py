"""SelSync: synchronizes only when a smoothed gradient norm changes; a non-sync step sends 2 floats."""

import jax
import numpy as np
import optax
import pytest

from planners.profiler import hlo
from qsync_jax.errors import QsyncError
from qsync_jax.sync import make_selsync_step
from tests.qsync_jax.sync import toy

N = 8


@pytest.mark.parametrize("mode,sync_opt_state", [("params", False), ("params", True), ("grads", False)])
def test_synchronous_selsync_equals_full_batch_sgd(mesh, mode, sync_opt_state):
  """During warm-up every step synchronizes: with momentum SGD, one step is full-batch SGD."""
  params = toy.init_params(jax.random.key(201))
  batch = toy.make_batch(jax.random.key(202), 8 * N)
  opt = optax.sgd(0.5, momentum=0.9)
  trainer = make_selsync_step(toy.loss_fn, opt, mesh, warmup=10, mode=mode, sync_opt_state=sync_opt_state)
  state, metrics = trainer.step(trainer.init(params), batch, jax.random.key(0))
  assert bool(metrics["synced"]) and int(state["syncs"]) == 1 and float(metrics["flags"]) == N
  loss, grads = jax.value_and_grad(toy.loss_fn)(params, batch, None)
  want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
  for got, w in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(want)):
    for d in range(N):  # every device holds the averaged model
      np.testing.assert_allclose(np.asarray(got[d]), np.asarray(w), atol=1e-5)
  trace = np.asarray(jax.tree.leaves(state["opt_state"])[0])  # momentum of the first leaf
  same = all(np.allclose(trace[d], trace[0], atol=1e-6) for d in range(N))
  assert same == (mode == "grads" or sync_opt_state)  # local optimizer state unless synchronized


def test_non_sync_steps_update_locally(mesh):
  params = toy.init_params(jax.random.key(203))
  trainer = make_selsync_step(toy.loss_fn, optax.sgd(0.1), mesh, warmup=0, delta=1e9)
  state = trainer.init(params)
  for i in range(3):
    state, metrics = trainer.step(state, toy.make_batch(jax.random.key(204 + i), 8 * N), jax.random.key(i))
    assert not bool(metrics["synced"])
  assert int(state["syncs"]) == 0 and int(state["step"]) == 3
  kernel = np.asarray(state["params"]["hidden"]["kernel"])
  assert not np.allclose(kernel[0], kernel[1])  # devices drifted apart: nothing was averaged
  averaged = trainer.consolidate(state)
  np.testing.assert_allclose(np.asarray(averaged["hidden"]["kernel"]), kernel.mean(0), atol=1e-6)


@pytest.mark.parametrize("mode", ["params", "grads"])
def test_non_sync_step_sends_only_the_flag(mesh, mode):
  """Per step: one 2-float all-reduce outside the cond; the local branch has no collective."""
  params = toy.init_params(jax.random.key(0))
  trainer = make_selsync_step(toy.loss_fn, optax.adam(1e-3), mesh, mode=mode)
  state = trainer.init(params)
  text = hlo.compiled_text(trainer.step, state, toy.make_batch(jax.random.key(1), 8 * N), jax.random.key(2))
  always = hlo.outside_conditionals(text)
  assert [(c.op, c.bytes) for c in always] == [("all-reduce", 8)]
  (branches,) = hlo.conditional_branches(text)
  local, synced = sorted(branches, key=len)
  assert local == []
  param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
  assert hlo.summarize(synced)["bytes"] == param_bytes


def test_bad_options():
  with pytest.raises(QsyncError, match="mode"):
    make_selsync_step(toy.loss_fn, optax.sgd(0.1), mode="both")
  with pytest.raises(QsyncError, match="delta"):
    make_selsync_step(toy.loss_fn, optax.sgd(0.1), delta=0.0)
  with pytest.raises(QsyncError, match="shares"):
    make_selsync_step(toy.loss_fn, optax.sgd(0.1), shares=[0.5, 0.5])
