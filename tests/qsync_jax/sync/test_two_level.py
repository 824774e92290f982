"""The two-level gradient sum (tree inside each group, ring between group leaders) and the
trainer's ``reduction="two_level"``, over the 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from planners.profiler import hlo
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import QsyncError
from qsync_jax.ops.vma import shard_map
from qsync_jax.plan import Plan
from qsync_jax.sync import make_grad_sync, two_level
from qsync_jax.sync.allreduce import pack
from qsync_jax.sync.two_level import tree_reduce_pairs, tree_rounds, two_level_allreduce, two_level_sync
from qsync_jax.train.train_step import make_train_step
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import make_task


def _tree(n: int):
  """A gradient-like tree with one row per device (leading axis ``n``); 7 + 15 + 24 = 46 values,
  so the ring pads its chunks for 3 and 4 leaders."""
  rng = np.random.default_rng(5)
  shapes = {"bias": (n, 7), "kernel": (n, 3, 5), "conv": (n, 2, 3, 4)}
  return {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}


def _both(sizes, check_vma=True, bucket_bytes=None):
  """``(two_level_allreduce, lax.psum)`` of each device's row, every device's result stacked."""
  mesh = Mesh(np.asarray(jax.devices()[: sum(sizes)]), ("data",))

  def local(tree):
    mine = jax.tree.map(lambda x: x[0], tree)
    pair = two_level_allreduce(mine, sizes, bucket_bytes=bucket_bytes), lax.psum(mine, "data")
    return jax.tree.map(lambda x: x[None], pair)

  return jax.jit(shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma))


def _check_sum(out, ref, n):
  """Every device's result the same bit for bit, and equal to ``lax.psum``'s up to fp32 order."""
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert got.dtype == jnp.float32
    for d in range(n):
      np.testing.assert_array_equal(got[d], got[0])  # phase 3 copies one buffer to every device
      # Same n addends in another order (tree, ring): fp32 rounding of an n-term sum of O(1)
      # values, a few ulps of the largest partial sum.
      np.testing.assert_allclose(got[d], want[d], rtol=0, atol=4 * n * 1.2e-7 * float(np.abs(want).max() + 1))


def test_reduce_tree_pairs():
  assert tree_reduce_pairs((1, 3, 4), 0) == ((2, 1), (5, 4), (7, 6))
  assert tree_reduce_pairs((1, 3, 4), 1) == ((3, 1), (6, 4))
  assert tree_reduce_pairs((1, 7), 2) == ((5, 1),)


@pytest.mark.parametrize("sizes", [(1, 3, 4), (2, 2), (4, 4), (1, 7), (1,), (3,), (3, 1, 1, 2)])
def test_equals_psum_on_every_device(sizes):
  n = sum(sizes)
  out, ref = _both(sizes)(_tree(n))
  _check_sum(out, ref, n)


@pytest.mark.parametrize(
  "sizes,bucket_bytes,buckets,typed", [((1, 3, 4), 64, 3, True), ((3, 1, 1, 2), 130, 2, False)]
)
def test_buckets_equal_psum_on_every_device(sizes, bucket_bytes, buckets, typed):
  """Leaves of 28, 96 and 60 fp32 bytes (flattening order: bias, conv, kernel) packed greedily into
  buckets of at most ``bucket_bytes``: 64 → one per leaf, 130 → (bias, conv), (kernel); typed
  invariant (``check_vma``) or not."""
  n = sum(sizes)
  out, ref = _both(sizes, check_vma=typed, bucket_bytes=bucket_bytes)(_tree(n))
  _check_sum(out, ref, n)
  # each bucket runs every round of its own: 2 R + 2 (G - 1) collective-permutes per bucket
  rounds = 2 * tree_rounds(sizes) + 2 * (len(sizes) - 1)
  assert len(pack([28, 96, 60], bucket_bytes)) == buckets
  assert _sync_collectives(sizes, False, bucket_bytes) == ["collective-permute"] * rounds * buckets


def test_unchecked_types_give_the_same_sum():
  """Under ``check_vma=False`` the result is not retyped (no all-gather) and is still the sum."""
  tree = _tree(8)
  out, ref = _both((1, 3, 4), check_vma=False)(tree)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * 8 * 1.2e-7 * float(np.abs(want).max() + 1))


def _sync_collectives(sizes, check_vma, bucket_bytes=None):
  mesh = Mesh(np.asarray(jax.devices()[: sum(sizes)]), ("data",))
  sync = two_level_sync(sizes, bucket_bytes=bucket_bytes)

  def local(tree):
    combined, _ = sync(jax.tree.map(lambda x: x[0], tree), (), jax.random.key(0))
    return combined

  fn = jax.jit(shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=check_vma))
  return [c.op for c in hlo.collectives(hlo.compiled_text(fn, _tree(sum(sizes))))]


def test_hlo_is_point_to_point():
  """(1, 3, 4): 2 rounds of each tree (n_max = 4) and 2 (G - 1) = 4 ring rounds; no all-reduce.
  Typed invariant (``check_vma``) it adds one all-gather; unchecked, nothing else."""
  assert sorted(_sync_collectives((1, 3, 4), check_vma=False)) == ["collective-permute"] * 8
  typed = _sync_collectives((1, 3, 4), check_vma=True)
  assert sorted(typed) == ["all-gather"] + ["collective-permute"] * 8


def test_bad_inputs_are_named():
  with pytest.raises(QsyncError, match="group_sizes"):
    two_level_sync((2, 0))
  with pytest.raises(QsyncError, match="bucket_bytes=0 is not a positive number of bytes. Fix: pass an int"):
    two_level_sync((2, 2), bucket_bytes=0)
  with pytest.raises(QsyncError, match="covers 4 devices but axis 'data' has 8"):
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    fn = shard_map(lambda x: two_level_allreduce(x, (2, 2)), mesh=mesh, in_specs=P("data"), out_specs=P())
    jax.eval_shape(fn, jnp.zeros((8,)))


# -- the trainer -----------------------------------------------------------------------------
def _cluster():
  """Two groups of unequal sizes (2 + 3 devices, 2 rows each)."""
  return ClusterSpec((DeviceGroup("a", "A100", 2, 40, 2), DeviceGroup("t", "T4", 3, 16, 2)))


def _independent_of(entry, name: str, marker: str) -> bool:
  """Whether entry instruction ``name`` does not depend (through operands) on any instruction whose
  ``op_name`` contains ``marker``."""
  by_name = {ins.name: ins for ins in entry}
  seen, todo = set(), [name]
  while todo:
    for operand in by_name[todo.pop()].operands:
      if operand in by_name and operand not in seen:
        if marker in by_name[operand].op_name:
          return False
        seen.add(operand)
        todo.append(operand)
  return True


def test_step_two_level_equals_flat(monkeypatch):
  """The trainer's two-level sum in buckets of 64 bytes (4 buckets of the MLP's 4 leaves, in
  backward order) equals the flat sum; its first buckets' sends do not wait for the first layer's
  backward, so XLA may run them during it."""
  monkeypatch.setattr(two_level, "BUCKET_BYTES", 64)
  task, cluster = make_task(hidden=8), _cluster()
  batches = task.train_batches(cluster.global_batch, 3)
  host = [next(batches) for _ in range(3)]
  programs = [
    make_train_step(
      task, cluster, Plan(reduction=r), optax.sgd(0.1), devices=jax.devices()[:5], return_grads=True
    )
    for r in ("flat", "two_level")
  ]
  first = programs[0].init(3, host[0])  # the same state form for both (neither sync keeps state)
  params, grads = [], []
  for ts in programs:
    state = first
    for batch in host:
      state, _, combined = ts(state, ts.shard(batch))
    params.append(jax.tree.leaves(state.params))
    grads.append(jax.tree.leaves(combined))
  assert all(not np.array_equal(a, b) for a, b in zip(params[0], jax.tree.leaves(first.params)))  # it trained
  # the two-level step sends the gradient point to point only: no all-gather (typing) and no all-reduce
  # but the step's small one of metrics and loss (a few floats)
  text = hlo.compiled_text(programs[1].step, first, programs[1].shard(host[0]))
  ops = hlo.collectives(text)
  assert "all-gather" not in {c.op for c in ops} and {c.op for c in ops} >= {"collective-permute"}
  assert all(c.op != "all-reduce" or c.bytes <= 64 for c in ops), ops
  # (2, 3) devices: 2 R + 2 (G - 1) = 2·2 + 2 rounds per bucket; 4 buckets
  assert [c.op for c in ops].count("collective-permute") == 6 * 4
  # one branch (no conditional): the sends are in the entry computation. The buckets of Dense_1's
  # bias (12 B) and kernel (96 B) depend on nothing of Dense_0's backward; those of Dense_0's bias
  # (32 B) and kernel (192 B) do (one buffer of every leaf would make all 6 rounds depend on it)
  entry = hlo.entry_instructions(text)
  sends = [ins.name for ins in entry if ins.opcode == "collective-permute"]
  assert len(sends) == 24 and any("transpose(jvp(MLP))/Dense_0" in ins.op_name for ins in entry)
  free = [_independent_of(entry, name, "transpose(jvp(MLP))/Dense_0") for name in sends]
  assert sum(free) == 2 * 6, free
  for a, b in zip(grads[0], grads[1]):
    # the same 5 weighted addends summed in another order (tree, ring): a few fp32 ulps of O(1) values
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  for a, b in zip(params[0], params[1]):
    # 3 sgd steps (lr 0.1) on those gradients: each adds at most 0.1 * 1e-6, plus the params' own ulps
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bad_combinations_are_named():
  task, cluster = make_task(hidden=8), _cluster()
  plan = Plan(reduction="two_level")
  five = jax.devices()[:5]
  with pytest.raises(
    QsyncError, match="reduction='two_level' with sync 'LeafOrderFreeSync'.*reduction to 'flat'"
  ):
    make_train_step(task, cluster, plan, optax.sgd(0.1), make_grad_sync("bf16"), devices=five)
  for name in ("fp16", "selsync"):  # a gradient hook, a step builder: named before anything is built
    with pytest.raises(QsyncError, match=f"reduction='two_level' with sync '{name}'.*leave the sync unset"):
      Trainer(task, cluster, plan, optax.sgd(0.1), grad_sync=name, devices=five, progress=None)
  with pytest.raises(QsyncError, match="optimizer_update='sharded' with reduction='two_level'"):
    make_train_step(task, cluster, Plan(reduction="two_level", optimizer_update="sharded"), optax.sgd(0.1))
