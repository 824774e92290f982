"""Tiny tasks for the planner tests and benchmarks (importable as ``tests.planners.tiny:mlp``).

* ``mlp``: a 3-layer MLP classifier on random features;
* ``attn``: a one-block transformer encoder (attention + MLP) classifier on random tokens;
* ``cnn``: two 3×3 convolutions and a dense head on random images.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from qsync_jax.train.task import Task


class MLP(nn.Module):
  hidden: int = 64
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.classes)(x)


class Attn(nn.Module):
  vocab: int = 64
  dim: int = 32
  heads: int = 2
  classes: int = 10

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.dim)(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(x, x)
    x = nn.LayerNorm()(x)
    x = x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(x)))
    return nn.Dense(self.classes)(jnp.mean(x, axis=1))


class CNN(nn.Module):
  width: int = 8
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(self.width, (3, 3))(x))
    x = nn.relu(nn.Conv(self.width, (3, 3))(x))
    return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def _xent(logits, batch):
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def _task(name, model, make_x):
  def batches(global_batch, seed):
    rng = np.random.default_rng(seed)
    while True:
      yield {"x": make_x(rng, global_batch), "label": rng.integers(0, 10, global_batch).astype(np.int32)}

  return Task(name=name, model=model, inputs=lambda b: (b["x"],), loss=_xent, train_batches=batches)


def mlp(features: int = 32, hidden: int = 64) -> Task:
  return _task("mlp", MLP(hidden), lambda rng, n: rng.normal(size=(n, features)).astype(np.float32))


def attn(seq: int = 16, dim: int = 32) -> Task:
  return _task("attn", Attn(dim=dim), lambda rng, n: rng.integers(0, 64, (n, seq)).astype(np.int32))


def cnn(size: int = 8, width: int = 8) -> Task:
  return _task("cnn", CNN(width), lambda rng, n: rng.normal(size=(n, size, size, 3)).astype(np.float32))
