"""Tiny tasks for the trainer tests: an MLP regression and a BatchNorm classifier.

Importable as ``tests.qsync_jax.train.tiny:make_task`` (the CLI's ``package.module:attr`` form).
"""

from __future__ import annotations

import os
import signal
import time

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qsync_jax.train.task import Task

FEATURES = 6


class MLP(nn.Module):
  hidden: int = 16

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(3)(x)


class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.Dense(3)(nn.relu(x))


def _batches(global_batch, seed, delay_s=0.0, hangup_at=0):
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(FEATURES, 3)).astype(np.float32)
  loaded = 0
  while True:
    loaded += 1
    if loaded == hangup_at:  # as a dropped SSH session would, while the batch loads
      os.kill(os.getpid(), signal.SIGHUP)
    if delay_s:
      time.sleep(delay_s)
    x = rng.normal(size=(global_batch, FEATURES)).astype(np.float32)
    yield {"x": x, "y": (x @ w + 0.1 * rng.normal(size=(global_batch, 3))).astype(np.float32)}


def _mse(out, batch):
  err = out - batch["y"]
  loss = jnp.mean(jnp.square(err))
  return loss, {"mae": jnp.mean(jnp.abs(err))}


def _held_out(examples: int, batch_size: int):
  batches = _batches(batch_size, 12345)
  for start in range(0, examples, batch_size):
    batch = next(batches)
    yield {k: v[: examples - start] for k, v in batch.items()}


def make_task(
  hidden: int = 16, batchnorm: bool = False, fixed_batch: int = 0, eval_examples: int = 0, hangup_at: int = 0
) -> Task:
  """``QSYNC_TEST_BATCH_DELAY_S`` slows data loading (for kill tests); ``fixed_batch`` > 0 makes
  every batch that many examples, whatever the global batch asked (a task that ignores it);
  ``eval_examples`` > 0 gives the MLP a held-out set of that many examples; ``hangup_at`` > 0 sends
  this process SIGHUP while the MLP's training data loads its batch of that number."""
  delay = float(os.environ.get("QSYNC_TEST_BATCH_DELAY_S", "0"))
  if fixed_batch:
    return Task(
      "tiny_fixed", MLP(hidden), lambda b: (b["x"],), _mse, lambda n, seed: _batches(fixed_batch, seed)
    )
  if batchnorm:
    return Task(
      name="tiny_bn",
      model=BNNet(),
      inputs=lambda b: (b["x"],),
      loss=_mse,
      train_batches=lambda n, seed: _batches(n, seed, delay),
      train_kwargs={"train": True},
      eval_kwargs={"train": False},
      mutable=("batch_stats",),
    )
  return Task(
    name="tiny_mlp",
    model=MLP(hidden),
    inputs=lambda b: (b["x"],),
    loss=_mse,
    train_batches=lambda n, seed: _batches(n, seed, delay, hangup_at),
    eval_batches=(lambda n: _held_out(eval_examples, n)) if eval_examples else None,
  )


class NnxNet(nnx.Module):
  """The flax.nnx twin of the BatchNorm classifier, with dropout (BatchNorm optional)."""

  def __init__(self, rngs: nnx.Rngs, batchnorm: bool = True):
    self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs) if batchnorm else None
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x, train: bool = True):
    x = self.hidden(x)
    if self.norm is not None:
      x = self.norm(x, use_running_average=not train)
    return self.out(self.dropout(nnx.relu(x), deterministic=not train))


def make_nnx_task(seed: int = 0, batchnorm: bool = True) -> Task:
  """A Task whose model is an nnx module (``tests.qsync_jax.train.tiny:make_nnx_task`` on the CLI)."""
  return Task(
    name="tiny_nnx",
    model=NnxNet(nnx.Rngs(params=seed, dropout=seed + 1), batchnorm),
    inputs=lambda b: (b["x"],),
    loss=_mse,
    train_batches=lambda n, seed: _batches(n, seed),
    train_kwargs={"train": True},
    eval_kwargs={"train": False},
    mutable=("batch_stats",) if batchnorm else (),
    rng_streams=("dropout",),
  )
