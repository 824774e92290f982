"""Every strategy trains a small CNN on scikit-learn digits to within 1 accuracy point of fp32.

Setup (all strategies): the same initial parameters and batch order (seed 0), global batch 64
over 8 devices, Adam(3e-3), 200 steps; accuracy on the 359-image held-out split. Every
strategy runs in ``qsync_jax.train.trainer.Trainer``, selected by name; SelSync with its defaults
(delta 0.3, window 25, warm-up 25), QSDP with buckets of 256.
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import optax
import pytest

from examples.data import digits
from examples.tasks.vision import classification_task
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.train.trainer import Trainer

pytestmark = pytest.mark.slow

SEED, STEPS, BATCH, LR = 0, 200, 64, 3e-3


class TinyCNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
    return nn.Dense(10)(x.reshape((x.shape[0], -1)))


@pytest.fixture(scope="module")
def task():
  train, test = digits.load(0.2, 0)
  return dataclasses.replace(classification_task("tiny_cnn", TinyCNN(), train, test), mutable=())


def _cluster():
  return ClusterSpec((DeviceGroup("cpu", "cpu", 8, 16, BATCH // 8),))


def accuracy(task, params) -> float:
  right = total = 0
  for batch in task.eval_batches(359):
    logits = task.model.apply({"params": params}, *task.inputs(batch), **task.eval_kwargs)
    right += int(jnp.sum(jnp.argmax(logits, -1) == jnp.asarray(batch["label"])))
    total += len(batch["label"])
  return right / total


def _run(task, name, **options):
  trainer = Trainer(task, _cluster(), None, optax.adam(LR), grad_sync=name, sync_options=options, seed=SEED)
  trainer.run(STEPS)
  return accuracy(task, trainer.params), trainer


@pytest.fixture(scope="module")
def fp32(task):
  return _run(task, "fp32")[0]


@pytest.mark.parametrize("name", ["bf16", "fp16", "global_qsgd", "selsync", "qsdp"])
def test_within_one_point_of_fp32(task, fp32, name):
  want = fp32
  assert want > 0.9  # the baseline itself learned
  got, trainer = _run(task, name, **({"bucket_size": 256} if name == "qsdp" else {}))
  if name == "selsync":
    assert 0 < int(trainer.state.strategy["syncs"]) < STEPS  # it did skip synchronizations
  print(f"{name}: accuracy {got:.4f} vs fp32 {want:.4f}")
  assert abs(got - want) <= 0.01, (name, got, want)
