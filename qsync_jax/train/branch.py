"""The per-device work of the hybrid step: a *branch* — one group's policy, per-device batch and
micro-steps — run on a device's rows of the global batch.

* ``plan_branches(cluster, plan)``: the distinct branches of a plan and each device's branch;
* ``device_switch(fns, device_branch)``: inside ``shard_map``, device ``i`` runs
  ``fns[device_branch[i]]`` (``lax.switch`` on a constant table indexed by ``lax.axis_index``);
  ``branch_switch``: the same for functions that compute gradients, with their convolutions in
  XLA:CPU's canonical order on the CPU (``canonical_convs``);
* ``branch_signature(...)``: what every branch's output looks like — the task's metric names and
  the order in which the backward pass produces the gradient leaves — from one jaxpr of a
  micro-step's gradient, traced abstractly before ``shard_map``;
* ``branch_run(...)``: the branch's gradient, loss, metrics and model state, each weighted by the
  branch's share of the global batch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync.common import AXIS, is_float
from qsync_jax.sync.order import backward_order
from qsync_jax.train.canonical_convs import canonical_convs
from qsync_jax.train.task import Task
from qsync_jax.train.task_step import task_loss


@dataclasses.dataclass(frozen=True)
class Branch:
  """A distinct (policy, per-device batch, micro-steps) and the device groups that run it."""

  groups: tuple[str, ...]
  policy: PrecisionPolicy
  batch_per_device: int
  micro_steps: int = 1  # the per-device batch runs as this many micro-batches (``Plan.micro_steps``)


def plan_branches(cluster: ClusterSpec, plan: Plan) -> tuple[tuple[Branch, ...], tuple[int, ...]]:
  """The branches of ``plan`` on ``cluster`` (batches already applied) and each device's branch."""
  keys: dict[tuple[str, int, int], int] = {}
  groups: list[list[str]] = []
  specs: list[tuple[PrecisionPolicy, int, int]] = []
  group_branch = []
  for g in cluster.groups:
    policy, k = plan.policy_on(g), plan.micro_steps_of(g.name)
    key = (json.dumps(policy.to_json(), sort_keys=True), g.batch_per_device, k)
    if key not in keys:
      keys[key] = len(specs)
      specs.append((policy, g.batch_per_device, k))
      groups.append([])
    groups[keys[key]].append(g.name)
    group_branch.append(keys[key])
  branches = tuple(Branch(tuple(n), p, b, k) for n, (p, b, k) in zip(groups, specs))
  return branches, tuple(group_branch[i] for i in cluster.device_group_indices())


def device_switch(fns: Sequence[Callable], device_branch: Sequence[int], axis_name: str = AXIS) -> Callable:
  """``f(*args)`` that runs ``fns[device_branch[i]](*args)`` on device ``i`` of ``axis_name``
  inside ``shard_map``: ``lax.switch`` on a constant table indexed by ``lax.axis_index``;
  ``fns[0]`` itself when there is one function."""
  if len(fns) == 1:
    return fns[0]
  table = np.asarray(device_branch, np.int32)

  def switched(*args):
    return lax.switch(jnp.asarray(table)[lax.axis_index(axis_name)], list(fns), *args)

  return switched


def branch_switch(
  fns: Sequence[Callable],
  branches: Sequence[Branch],
  device_branch: Sequence[int],
  platform: str,
  axis_name: str = AXIS,
) -> Callable:
  """``device_switch(fns, device_branch)`` of ``fns[i]``, the gradient computation of
  ``branches[i]``: on the CPU (``platform``), where a function sits in a ``lax.switch`` (several
  branches) or a ``lax.scan`` (micro-steps), its convolutions are put in XLA:CPU's canonical order
  (``canonical_convs``; XLA:CPU does so in the entry computation only). ``fns`` are not
  differentiated further (the rewrite inlines ``custom_jvp`` rules)."""
  nested = len(fns) > 1 or any(b.micro_steps > 1 for b in branches)
  if nested and platform == "cpu":
    fns = [canonical_convs(fn) for fn in fns]
  return device_switch(fns, device_branch, axis_name)


class BranchSignature(NamedTuple):
  """``metric_names``: the task's metrics (sorted), the order of ``scalars[1:]`` in every branch's
  output; ``backward_order``: the gradient leaves in the order the backward pass produces them
  (``qsync_jax.sync.order.backward_order``)."""

  metric_names: tuple[str, ...]
  backward_order: tuple[int, ...]


def _gradient(task: Task, policy: PrecisionPolicy, scaled: bool) -> Callable:
  """``(params, model_state, batch, key, scale) -> (grads, loss, metrics, updated)``: the gradient
  of the task's fp32 loss under ``policy`` (times ``scale`` when ``scaled``) w.r.t. ``params``."""
  loss_fn = task_loss(task, policy)

  def gradient(params, model_state, batch, key, scale):
    def scaled_loss(p):
      loss, metrics, updated = loss_fn({"params": p, **model_state}, batch, key)
      loss = loss.astype(jnp.float32)
      return (loss * scale if scaled else loss), (loss, metrics, updated)

    value, vjp_fn, (loss, metrics, updated) = jax.vjp(scaled_loss, params, has_aux=True)
    (grads,) = vjp_fn(jnp.ones_like(value))
    return grads, loss, metrics, updated

  return gradient


def branch_signature(
  task: Task, branch: Branch, params, model_state, device_batch, scaled: bool
) -> BranchSignature:
  """The ``BranchSignature`` of the step, from one jaxpr of ``branch``'s micro-step gradient on
  abstract inputs (``params``, ``model_state``: the replicated trees; ``device_batch``: one
  device's rows). Nothing runs; every branch computes the same metrics, and the backward order of
  the first branch is the one the gradient sync gets."""

  def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)

  rows = branch.batch_per_device // branch.micro_steps
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((rows, *jnp.shape(x)[1:]), jnp.result_type(x)), device_batch
  )
  key, scale = jax.random.key(0), jax.ShapeDtypeStruct((), jnp.float32)
  gradient = _gradient(task, branch.policy, scaled)
  jaxpr, out = jax.make_jaxpr(gradient, return_shape=True)(
    abstract(params), abstract(model_state), batch, key, scale
  )
  return BranchSignature(tuple(out[2]), backward_order(jaxpr, len(jax.tree.leaves(params))))


def branch_run(
  task: Task,
  branch: Branch,
  global_batch: int,
  metric_names: Sequence[str],
  *,
  scaled: bool,
  varying: Callable[[Any], Any],
) -> Callable:
  """``run(params, model_state, batch, key, scale) -> (grads, scalars, new_state)`` of ``branch``.

  Its ``k = micro_steps`` micro-batches of ``b/k`` (its rows of the batch in order), each weighted
  by its share ``(b/k)/B`` of the global batch, summed in fp32 — ``sum(micro(params, model_state,
  local[i*b/k:(i+1)*b/k], fold_in(key, i), scale) for i)``, with the key unfolded when ``k == 1``;
  ``micro`` returns the fp32 gradient (divided by ``scale`` when ``scaled``), ``scalars = [loss,
  *metrics[metric_names]]`` and the updated model state, each times the weight. Every
  micro-batch starts from the same model state, so the state kept is the weighted average of the
  micro-batches' (non-float leaves: the last). ``varying`` types the scan's carry as the
  micro-steps' results are typed (``to_varying`` inside ``shard_map``, else the identity)."""
  gradient = _gradient(task, branch.policy, scaled)
  b, k = branch.batch_per_device, branch.micro_steps
  weight = (b // k) / global_batch

  def micro(params, model_state, batch, key, scale):
    grads, loss, metrics, updated = gradient(params, model_state, batch, key, scale)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    scalars = jnp.stack([loss, *(jnp.asarray(metrics[m], jnp.float32) for m in metric_names)])
    new_state = {c: updated.get(c, model_state[c]) for c in model_state}
    if scaled or weight != 1.0:  # one device with the whole batch: nothing to weight
      factor = weight / scale if scaled else jnp.float32(weight)
      grads = jax.tree.map(lambda g: g * factor, grads)
      scalars = scalars * jnp.float32(weight)
      new_state = jax.tree.map(lambda x: x * jnp.float32(weight) if is_float(x) else x, new_state)
    return grads, scalars, new_state

  def run(params, model_state, batch, key, scale):
    local = jax.tree.map(lambda x: x[:b], batch)
    if k == 1:
      return micro(params, model_state, local, key, scale)

    def step(acc, i_and_slice):
      i, mb = i_and_slice
      out = micro(params, model_state, mb, jax.random.fold_in(key, i), scale)
      return jax.tree.map(lambda a, x: a + x if is_float(x) else x, acc, out), None

    slices = jax.tree.map(lambda x: x.reshape(k, b // k, *x.shape[1:]), local)
    first = jax.tree.map(lambda x: x[0], slices)
    shapes = jax.eval_shape(lambda mb: micro(params, model_state, mb, key, scale), first)
    # The carry is typed varying like the micro-steps' results (a constant zero is invariant).
    zeros = varying(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    out, _ = lax.scan(step, zeros, (jnp.arange(k, dtype=jnp.int32), slices))
    return out

  return run
