"""A step-builder sync strategy (SelSync, QSDP) as the trainer's program.

``make_strategy_step(task, cluster, plan, optimizer, name, options, host_batch)`` returns a
``StrategyStep``: the same interface as the hybrid ``TrainStep`` (``init(seed, host_batch)``,
``shard``, ``step(state, batch)``, ``step_count`` / ``params_of`` / ``variables_of``), so the
``Trainer`` feeds data, logs, checkpoints and evaluates either one alike. Semantics:

* the mesh, the device-to-group assignment and the cut of the global batch are the hybrid
  step's (``plan.place``, ``shard_batch``);
* each device's loss is its group's: the model quantized under its branch's policy
  (``plan_branches``: one per distinct policy and per-device batch) on its own ``b_i`` rows,
  picked on the device index when there are several branches (``device_switch``; so plans
  with different policies per group, and dynamic batch sizes, work); the strategy weights
  devices by ``b_i / B`` (its ``shares``);
* initial parameters are ``init_variables(task, seed, ...)``: the hybrid trainer's for the
  same seed; the step key is ``fold_in(train key, step)``, so a run is a pure function of the
  seed and the data, and resumes bit-identically;
* the state is ``StrategyState(strategy, rng)``: the strategy's own state dict and the key data
  of the training key (checkpointed as is).

Not supported, with a clear error: fp16 legs (they need dynamic loss scaling, which these
steps do not have) and tasks with mutable collections (``task_loss(..., params_only=True)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import QsyncError
from qsync_jax.plan import Plan
from qsync_jax.sync import get_strategy, make_step_strategy
from qsync_jax.sync.common import AXIS
from qsync_jax.train.branch import Branch, branch_switch, device_switch, plan_branches
from qsync_jax.train.step_plan import check_step_plan
from qsync_jax.train.task import Task
from qsync_jax.train.task_step import task_loss
from qsync_jax.train.train_step import StepProgram, init_sample, init_variables


class StrategyState(NamedTuple):
  """``strategy``: the strategy's state dict (it counts ``"step"``); ``rng``: training key data."""

  strategy: dict
  rng: jax.Array


def branch_loss_fn(
  task: Task,
  branches: Sequence[Branch],
  device_branch: Sequence[int],
  platform: str = "cpu",
  axis_name: str = AXIS,
):
  """``loss_fn(params, batch, key)`` for a strategy's ``shard_map``: each device runs its branch's
  policy on the first ``batch_per_device`` rows of its (padded) shard.

  With several branches its gradient is each branch's own ``jax.value_and_grad``, computed in
  the forward pass inside the device's switch (a ``custom_vjp`` whose backward scales it by the
  cotangent): a branch holds its forward and backward together, as the hybrid step's do, and
  ``branch_switch`` gives it XLA:CPU's canonical convolutions on ``platform == "cpu"``.
  Differentiable once (what SelSync and QSDP take); equal to differentiating the switch."""

  def rows(branch: Branch, batch):
    return jax.tree.map(lambda x: x[: branch.batch_per_device], batch)

  def one(branch: Branch, grad: bool):
    loss_fn = task_loss(task, branch.policy, params_only=True)
    loss_fn = jax.value_and_grad(loss_fn) if grad else loss_fn
    return lambda params, batch, key: loss_fn(params, rows(branch, batch), key)

  losses = device_switch([one(b, False) for b in branches], device_branch, axis_name)
  if len(branches) == 1:
    return losses
  value_and_grad = branch_switch(
    [one(b, True) for b in branches], branches, device_branch, platform, axis_name
  )

  @jax.custom_vjp
  def loss_fn(params, batch, key):
    return losses(params, batch, key)

  def backward(grads, cotangent):
    return jax.tree.map(lambda g: g * cotangent.astype(g.dtype), grads), None, None

  loss_fn.defvjp(value_and_grad, backward)
  return loss_fn


@dataclasses.dataclass(frozen=True)
class StrategyStep(StepProgram):
  """A compiled step-builder strategy and what the trainer needs to run it."""

  name: str
  strategy: Any  # SelSyncTrainer / QSDPTrainer: init, step, params_of
  step: Any

  def init(self, seed: int, host_batch) -> StrategyState:
    """The strategy's initial state at the hybrid trainer's initial parameters for ``seed``."""
    replicated = NamedSharding(self.mesh, P())
    variables, rng = jax.jit(lambda s: init_variables(self.task, seed, s), out_shardings=replicated)(
      init_sample(host_batch, self.cluster, self.mesh)
    )
    return StrategyState(self.strategy.init(variables["params"]), rng)

  def step_count(self, state: StrategyState) -> jax.Array:
    return state.strategy["step"]

  def params_of(self, state: StrategyState):
    """The model's parameters (SelSync: the share-weighted average; QSDP: gathered)."""
    return self.strategy.params_of(state.strategy)

  def variables_of(self, state: StrategyState) -> dict:
    return {"params": self.params_of(state)}


def make_strategy_step(
  task: Task,
  cluster: ClusterSpec,
  plan: Plan | None,
  optimizer: optax.GradientTransformation,
  name: str,
  options: Mapping[str, Any] | None = None,
  host_batch=None,
  *,
  devices: Sequence[Any] | None = None,
  clip_norm: float | None = None,
) -> StrategyStep:
  """Builds the ``train_step`` strategy ``name`` (``options``: its ``Strategy.options``) for
  ``task`` on ``cluster`` under ``plan``. ``host_batch``: one global batch (the parameter
  shapes are traced from it; default: the task's first). ``clip_norm``: refused (these steps do
  not clip; ``check_step_plan``), taken so that the trainer can pass its own."""
  plan = plan if plan is not None else Plan()
  if get_strategy(name).kind != "train_step":
    raise QsyncError(f"sync strategy {name!r} is a gradient hook. Fix: pass it to make_train_step.")
  check_step_plan(plan, name, clip_norm=clip_norm, cluster=cluster)
  cluster, devices = plan.place(cluster, list(jax.devices() if devices is None else devices))
  mesh = Mesh(np.asarray(devices), (AXIS,))
  branches, device_branch = plan_branches(cluster, plan)
  if host_batch is None:
    host_batch = next(iter(task.train_batches(cluster.global_batch, 0)))
  params = jax.eval_shape(
    lambda s: init_variables(task, 0, s)[0]["params"], init_sample(host_batch, cluster, mesh)
  )
  shares = np.asarray(cluster.device_batch_sizes(), np.float64) / cluster.global_batch
  loss_fn = branch_loss_fn(task, branches, device_branch, mesh.devices.flat[0].platform)
  strategy = make_step_strategy(
    name, loss_fn, optimizer, params, mesh, shares=list(shares), **(options or {})
  )

  @jax.jit
  def step(state: StrategyState, batch):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.strategy["step"])
    inner, metrics = strategy.step(state.strategy, batch, key)
    return StrategyState(inner, state.rng), metrics

  return StrategyStep(task, cluster, plan, mesh, branches, device_branch, name, strategy, step)
