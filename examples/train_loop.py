"""A plain single-process Flax/optax training loop over a ``Task``, with an optional policy.

What a user writes without qsync-jax's hybrid trainer, plus one line: the model is wrapped by
``qsync_jax.quantize(model, policy)`` when a precision policy is given, so the same loop runs
float or low-precision ops. Both examples (``examples/vision``, ``examples/lm``) use it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsync_jax.models.flax_quant import quantize
from qsync_jax.ops.quant_ops import RNG_COLLECTION
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train.task import Task


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Hyper-parameters of ``train_and_evaluate``."""

  steps: int = 300
  batch_size: int = 64
  learning_rate: float = 3e-3
  weight_decay: float = 1e-4
  seed: int = 0
  eval_batch_size: int = 256
  eval_max_batches: int | None = None  # None: the whole held-out split
  log_every: int = 100
  policy: str | None = None  # a policy JSON file or a preset name ("int8", "bf16", ...)


def load_policy(policy: str | PrecisionPolicy | None) -> PrecisionPolicy | None:
  """A policy from a JSON path or a preset name (``None`` keeps the float model)."""
  if policy is None or isinstance(policy, PrecisionPolicy):
    return policy
  if policy.endswith(".json"):
    return PrecisionPolicy.load(policy)
  return PrecisionPolicy.uniform(policy)


class Runner:
  """The model's init / train step / eval step for one task and policy (jitted)."""

  def __init__(self, task: Task, policy: PrecisionPolicy | None, optimizer: optax.GradientTransformation):
    self.task, self.optimizer = task, optimizer
    self.model = task.model if policy is None else quantize(task.model, policy)
    self.init = jax.jit(self._init)  # eager init would dispatch every op one by one
    self.train_step = jax.jit(self._train_step)
    self.eval_step = jax.jit(self._eval_step)

  def _init(self, key, batch) -> dict[str, Any]:
    variables = self.model.init({"params": key}, *self.task.inputs(batch), **self.task.eval_kwargs)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    return {"params": params, "state": state, "opt_state": self.optimizer.init(params)}

  def _rngs(self, key):
    names = (RNG_COLLECTION, *self.task.rng_streams)
    return dict(zip(names, jax.random.split(key, len(names))))

  def _train_step(self, carry, batch, key):
    task = self.task

    def loss_fn(params):
      variables = {"params": params, **carry["state"]}
      kwargs = dict(task.train_kwargs, rngs=self._rngs(key))
      if task.mutable:
        outputs, updates = self.model.apply(
          variables, *task.inputs(batch), mutable=list(task.mutable), **kwargs
        )
      else:
        outputs, updates = self.model.apply(variables, *task.inputs(batch), **kwargs), {}
      loss, metrics = task.loss(outputs, batch)
      return loss, (metrics, updates)

    (loss, (metrics, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(carry["params"])
    # optax's Adam bias correction computes ``decay ** count`` (float ** int32), which strict
    # dtype promotion (as in the tests) rejects; standard promotion is what optax is written for.
    with jax.numpy_dtype_promotion("standard"):
      deltas, opt_state = self.optimizer.update(grads, carry["opt_state"], carry["params"])
    params = optax.apply_updates(carry["params"], deltas)
    return {"params": params, "state": {**carry["state"], **updates}, "opt_state": opt_state}, dict(
      metrics, loss=loss
    )

  def _eval_step(self, carry, batch, key):
    variables = {"params": carry["params"], **carry["state"]}
    outputs = self.model.apply(
      variables, *self.task.inputs(batch), rngs=self._rngs(key), **self.task.eval_kwargs
    )
    loss, metrics = self.task.loss(outputs, batch)
    return dict(metrics, loss=loss)

  def evaluate(
    self, carry, batch_size: int, max_batches: int | None = None, seed: int = 0
  ) -> dict[str, float]:
    """Held-out metrics, each a mean over examples (batches weighted by their size)."""
    if self.task.eval_batches is None:
      return {}
    totals: dict[str, float] = {}
    count = 0
    key = jax.random.key(seed)
    for i, batch in enumerate(self.task.eval_batches(batch_size)):
      if max_batches is not None and i >= max_batches:
        break
      n = len(next(iter(batch.values())))
      metrics = self.eval_step(carry, batch, jax.random.fold_in(key, i))
      for k, v in metrics.items():
        totals[k] = totals.get(k, 0.0) + float(v) * n
      count += n
    return {k: v / count for k, v in totals.items()}


def train_and_evaluate(
  task: Task, config: LoopConfig, log: Callable[[str], None] | None = print
) -> dict[str, Any]:
  """Trains ``task`` for ``config.steps`` steps; returns final train and held-out metrics."""
  policy = load_policy(config.policy)
  optimizer = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
  runner = Runner(task, policy, optimizer)
  batches = task.train_batches(config.batch_size, config.seed)
  key = jax.random.key(config.seed)
  init_key, key = jax.random.split(key)
  carry = runner.init(init_key, next(task.train_batches(config.batch_size, config.seed)))
  history = []
  start = time.perf_counter()
  for step in range(1, config.steps + 1):
    carry, metrics = runner.train_step(carry, next(batches), jax.random.fold_in(key, step))
    if log is not None and (step % config.log_every == 0 or step == config.steps):
      metrics = {k: float(v) for k, v in metrics.items()}
      history.append({"step": step, **metrics})
      log(f"step {step:5d}  loss {metrics['loss']:.4f}  accuracy {metrics.get('accuracy', float('nan')):.4f}")
  train_metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  seconds = time.perf_counter() - start
  held_out = runner.evaluate(carry, config.eval_batch_size, config.eval_max_batches, config.seed)
  if log is not None and held_out:
    log(f"held-out  loss {held_out['loss']:.4f}  accuracy {held_out['accuracy']:.4f}")
  return {
    "task": task.name,
    "policy": None if policy is None else policy.to_json(),
    "train": train_metrics,
    "eval": held_out,
    "history": history,
    "train_seconds": seconds,
    "params": int(sum(np.size(x) for x in jax.tree.leaves(carry["params"]))),
    "variables": carry,
  }


def perplexity(loss: float) -> float:
  return float(jnp.exp(jnp.float32(loss)))
