"""Every strategy's state survives an orbax checkpoint (``qsync_jax.train.checkpoint``) and resumes
to the same next step."""

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.sync import make_grad_sync, make_qsdp_step, make_selsync_step
from qsync_jax.train.checkpoint import CheckpointStore
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.sync import toy
from tests.qsync_jax.train.tiny import make_task

N = 8


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["global_qsgd"])
def test_grad_sync_state_resumes_in_the_trainer(tmp_path, name):
  task = make_task()
  cluster = ClusterSpec((DeviceGroup("cpu", "cpu", N, 16, 2),))
  seed = 101

  def trainer(resume):
    return Trainer(
      task,
      cluster,
      None,
      optax.adam(1e-2),
      grad_sync=make_grad_sync(name),
      seed=seed,
      out_dir=str(tmp_path),
      resume=resume,
    )

  first = trainer(False)
  first.run(2)
  assert int(first.state.sync_state["steps"][0]) == 2
  second = trainer(True)
  _same(second.state, first.state)
  first.run(3)
  second.run(3)
  _same(second.state, first.state)  # global_qsgd: the same rounding noise too (keys come from the step)


@pytest.mark.parametrize("name", ["selsync", "qsdp"])
def test_step_builder_state_resumes(tmp_path, mesh, name):
  params = toy.init_params(jax.random.key(102))
  if name == "selsync":
    trainer = make_selsync_step(toy.loss_fn, optax.adam(1e-2), mesh, warmup=1)
  else:
    trainer = make_qsdp_step(toy.loss_fn, optax.adam(1e-2), params, mesh, bucket_size=64)
  batches = [toy.make_batch(jax.random.key(103 + i), 8 * N) for i in range(3)]
  state = trainer.init(params)
  for i in range(2):
    state, _ = trainer.step(state, batches[i], jax.random.key(i))
  store = CheckpointStore(str(tmp_path))
  store.save(2, state, trainer.params_of(state), {"strategy": name})
  restored, meta = store.restore(trainer.init(params), {"strategy": name})
  store.close()
  _same(restored, state)
  assert all(r.sharding == s.sharding for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
  a, _ = trainer.step(state, batches[2], jax.random.key(2))
  b, _ = trainer.step(restored, batches[2], jax.random.key(2))
  _same(a, b)
