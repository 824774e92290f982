"""The data-parallel step on two GPUs with the Pallas kernels in it (``gpu`` marker: run with the
device tool on a kind of two or more GPUs,
``JAX_PLATFORMS=cuda pytest -m gpu tests/qsync_jax/train/test_multi_gpu.py``).

On the CPU the int8 products run through XLA; only on a GPU does the Mosaic GPU GEMM, whose
output came back typed invariant under ``shard_map``, join the step. That made the backward
pass sum every int8 op's input gradient over the devices (an all-reduce per op, and wrong
gradients), which these tests would have caught.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from planners.profiler import hlo
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.train.task import Task
from qsync_jax.train.train_step import make_train_step

pytestmark = pytest.mark.gpu

WIDTH, BATCH = 512, 256  # on the Hopper GEMM's tile grid (M, K multiples of 128, N of 256)


class WideMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.relu(nn.Dense(WIDTH)(x))
    return nn.Dense(WIDTH)(x)


def wide_task() -> Task:
  def batches(n, seed):
    rng = np.random.default_rng(seed)
    while True:
      x = rng.normal(size=(n, WIDTH)).astype(np.float32)
      yield {"x": x, "y": np.tanh(x)}

  def loss(out, batch):
    return ((out - batch["y"]) ** 2).mean(), {}

  return Task("wide_mlp", WideMLP(), lambda b: (b["x"],), loss, batches)


def step_of(n: int, batch: int):
  have = len(jax.devices("gpu"))
  # a fail, not a skip: on a host with one GPU these tests cannot show anything
  assert have >= n, f"needs {n} GPUs, this host has {have}. Fix: run on a kind of two or more GPUs."
  kind = jax.devices()[0].device_kind
  cluster = ClusterSpec.uniform("H200" if "H200" in kind else "H100", n, batch)
  plan = Plan.from_json({"policies": {"all": "int8_fwd"}})
  return make_train_step(
    wide_task(), cluster, plan, optax.sgd(0.1), devices=jax.devices()[:n], return_grads=True
  )


def test_two_gpu_int8_gradient_equals_one_gpu_on_the_full_batch():
  two, one = step_of(2, BATCH), step_of(1, 2 * BATCH)
  batch = next(wide_task().train_batches(2 * BATCH, 0))
  state2, state1 = two.init(0, batch), one.init(0, batch)
  _, m2, g2 = two(state2, two.shard(batch))
  _, m1, g1 = one(state1, one.shard(batch))
  np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(g2)), jax.tree.leaves(jax.device_get(g1))):
    # per-row / per-channel int8 scales do not depend on the split; what differs is the fp16
    # backward's summation order. A summed activation gradient is off by ~100 %.
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


def test_two_gpu_int8_step_all_reduces_the_gradient_only():
  two = step_of(2, BATCH)
  batch = next(wide_task().train_batches(2 * BATCH, 0))
  state = two.init(0, batch)
  text = two.step.lower(state, two.shard(batch)).compile().as_text()
  assert "mosaic" in text.lower()  # the Mosaic GPU GEMM runs in this step
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  reduced = sum(c.bytes for c in hlo.collectives(text) if c.op == "all-reduce")
  assert param_bytes <= reduced <= param_bytes + 1024  # + the loss scaler's finite flag, metrics
