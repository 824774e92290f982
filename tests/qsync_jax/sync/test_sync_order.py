"""The gradient leaves reach the all-reduce in the order the backward pass produces them."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import QsyncError
from qsync_jax.sync import make_grad_sync
from qsync_jax.sync.order import backward_order, from_order, in_order
from qsync_jax.train.train_step import make_train_step
from tests.qsync_jax.train.tiny import make_task


class Deep(nn.Module):
  """Four Dense layers of distinct widths, so every kernel has its own shape."""

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate((5, 7, 9)):
      x = nn.tanh(nn.Dense(width, name=f"layer{i}")(x))
    return nn.Dense(3, name="layer3")(x)


def _kernel_positions(order, params):
  """Position in ``order`` of each layer's kernel leaf, by layer."""
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  return {f"layer{i}": order.index(paths.index(f"['layer{i}']['kernel']")) for i in range(4)}


def test_backward_order_puts_the_last_layer_first():
  model = Deep()
  x = jnp.ones((4, 6))
  params = model.init(jax.random.key(0), x)["params"]

  def loss(p):
    return jnp.sum(model.apply({"params": p}, x) ** 2), ()

  jaxpr = jax.make_jaxpr(jax.grad(loss, has_aux=True))(params)
  order = backward_order(jaxpr, len(jax.tree.leaves(params)))
  assert sorted(order) == list(range(len(jax.tree.leaves(params))))
  pos = _kernel_positions(order, params)
  # tree order is layer0 … layer3; the backward produces layer3's gradient first
  assert pos["layer3"] < pos["layer2"] < pos["layer1"] < pos["layer0"]


def test_in_order_and_from_order_are_inverse():
  tree = {"a": np.arange(2), "b": {"c": np.arange(3), "d": np.arange(4)}}
  order = (2, 0, 1)
  leaves = in_order(tree, order)
  assert [x.size for x in leaves] == [4, 2, 3]
  back = from_order(leaves, tree, order)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(x, y)


class _RecordingSync:
  """A stateless GradSync that records the shapes it is handed (at trace time)."""

  def __init__(self, leaf_order):
    self.leaf_order = leaf_order
    self.seen = []

  def __call__(self, grads, state, key):
    self.seen.append(grads)
    return jax.lax.psum(grads, "data"), state


def _deep_task():
  task = make_task()
  return dataclasses.replace(task, model=Deep(), name="deep")


@pytest.mark.parametrize(
  "leaf_order, override", [("backward", "auto"), ("tree", "auto"), ("backward", "tree")]
)
def test_train_step_hands_the_sync_what_its_leaf_order_asks(leaf_order, override):
  task = _deep_task()
  cluster = ClusterSpec.uniform("cpu", 2, 3)
  sync = _RecordingSync(leaf_order)
  ts = make_train_step(
    task, cluster, None, optax.sgd(0.1), sync, devices=jax.devices()[:2], sync_leaf_order=override
  )
  batch = next(task.train_batches(ts.global_batch, 0))
  state = ts.init(0, batch)
  ts(state, ts.shard(batch))
  (got,) = sync.seen
  if leaf_order == "backward" and override == "auto":
    assert isinstance(got, list)
    # the last layer's kernel (9 x 3) comes before the first layer's (6 x 5)
    shapes = [g.shape for g in got]
    assert shapes.index((9, 3)) < shapes.index((7, 9)) < shapes.index((5, 7)) < shapes.index((6, 5))
  else:
    assert isinstance(got, dict) and set(got) == {f"layer{i}" for i in range(4)}


def test_backward_ordered_sync_gives_the_tree_ordered_result():
  """Same combined gradient and the same next params whichever order the leaves travel in."""
  task = _deep_task()
  cluster = ClusterSpec.uniform("cpu", 2, 3)
  batch = next(task.train_batches(6, 1))
  results = []
  for override in ("auto", "tree"):
    ts = make_train_step(
      task,
      cluster,
      None,
      optax.sgd(0.1),
      make_grad_sync("fp32"),
      devices=jax.devices()[:2],
      return_grads=True,
      sync_leaf_order=override,
    )
    state = ts.init(3, batch)
    new, _, grads = ts(state, ts.shard(batch))
    results.append((new.params, grads))
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_leaf_order_is_refused():
  task = make_task()
  with pytest.raises(QsyncError, match="sync_leaf_order='reverse'.*Fix"):
    make_train_step(
      task,
      ClusterSpec.uniform("cpu", 2, 2),
      None,
      optax.sgd(0.1),
      devices=jax.devices()[:2],
      sync_leaf_order="reverse",
    )
  bad = _RecordingSync("forward")
  with pytest.raises(QsyncError, match="leaf_order='forward'.*Fix"):
    make_train_step(
      task, ClusterSpec.uniform("cpu", 2, 2), None, optax.sgd(0.1), bad, devices=jax.devices()[:2]
    )
