"""One synchronous data-parallel training step over hybrid device groups.

The step is one SPMD program: ``shard_map`` over the ``data`` mesh axis, one device per
position. Every device runs its group's precision policy: the model is quantized once per
distinct (policy, per-device batch) pair — a *branch* — and ``lax.switch`` on the device's
branch index (a constant table indexed by ``lax.axis_index``) picks the branch; a cluster with
one branch calls it directly.

Semantics, per step, with ``b_i`` the per-device batch of device ``i`` and ``B = Σ b_i``:

* the global batch is cut in device order (``qsync_jax.train.batching``); each branch slices its
  static ``b_i`` rows, so padding never reaches the model;
* device ``i`` computes ``g_i = ∇ mean_loss_i`` of its fp32 master params (under its policy)
  and hands ``(b_i / B) · g_i`` to the gradient sync, which combines the devices' weighted
  gradients (default: fp32 ``psum``), so the result equals the full-batch gradient;
* the loss and metrics reported are the same ``b_i / B``-weighted sums (= full-batch means);
* mutable collections (BatchNorm statistics) are *synchronized*: every device normalizes with
  its own batch's statistics (as in DDP without SyncBN), and the running statistics kept in the
  state are the ``b_i / B``-weighted average of the devices' updated ones, so replicas agree;
* master params, optimizer state and model state are fp32 and replicated; the optimizer
  (optax) runs on every device on the same combined gradient — unless the plan's
  ``optimizer_update`` is ``"sharded"`` (ZeRO-1, ``shard_optimizer_state``): then every param
  leaf is flattened and zero padded to ``N · m`` elements (N running devices, ``m = ⌈size /
  N⌉``: QSDP's ``even_layout``), the weighted fp32 gradients are reduce-scattered
  (``lax.psum_scatter``, one per leaf) instead of all-reduced, device ``i`` runs the optimizer
  on elements ``[i·m, (i+1)·m)`` of every leaf with its shard of the optimizer state, and the
  updated shards are all-gathered into the replicated params. The result equals the
  replicated update up to the fp32 summation order of the reduction; the optimizer must be
  elementwise (sgd, momentum, adam, adamw…; not a global-norm clip, which would see only a
  shard);
* randomness: the step key is ``fold_in(train key, step)``; it is split into one key for the
  gradient sync (the same on every device) and a device base folded with the device index,
  from which the ``"qsync"`` stream (stochastic rounding) and the task's ``rng_streams``
  (dropout…) are drawn, so a run is a pure function of the seed and the data;
* with dynamic loss scaling (plans with an fp16 leg) the local loss is multiplied by the
  scale before differentiation and the gradient divided by it (fp32) before the sync; a step
  whose combined gradient is not finite on any device is skipped everywhere.

Gradients of replicated params are taken w.r.t. params cast to *varying* (``pcast``): under
``check_vma`` the gradient of an invariant input would come back already summed over the
axis, and the sync would count it twice.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import QsyncError
from qsync_jax.ops.quant_ops import RNG_COLLECTION
from qsync_jax.ops.vma import shard_map
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync import make_grad_sync
from qsync_jax.sync.common import (
  AXIS,
  STEP_COMPILER_OPTIONS,
  all_gather_invariant,
  is_float,
  optimizer_init,
  to_varying,
)
from qsync_jax.sync.elementwise import check_elementwise_optimizer
from qsync_jax.sync.order import backward_order, from_order, in_order
from qsync_jax.sync.qsdp import even_layout
from qsync_jax.sync.two_level import two_level_sync
from qsync_jax.train.batching import pad_shards, put_replicated, put_sharded
from qsync_jax.train.loss_scale import DynamicLossScale, LossScaleState, NoLossScale
from qsync_jax.train.step_plan import check_step_plan
from qsync_jax.train.task import Task
from qsync_jax.train.task_step import task_loss

SyncFn = Callable[[Any, Any, jax.Array], tuple[Any, Any]]
"""``(weighted_local_grads, sync_state, key) -> (combined_grads, sync_state)``.

Called inside ``shard_map`` with axis name ``"data"``. ``weighted_local_grads`` is this
device's fp32 gradient times its share of the global batch; ``combined_grads`` must be the
same on every device (typed invariant, e.g. the result of a ``psum``). ``sync_state`` is this
device's own state (error feedback, EMAs…): if the callable has an ``init(params)`` method its
result is the initial per-device state, else the state is ``()``. ``key`` is one PRNG key per
step, the same on every device (fold in ``lax.axis_index("data")`` for per-device noise).
``weighted_local_grads`` is the gradient tree, or, when the callable's ``leaf_order``
attribute is ``"backward"``, the tree's leaves as a list in the order the backward pass
produces them (``qsync_jax.sync.order``); ``combined_grads`` comes back in the same form.
"""


def psum_sync(weighted_local_grads, sync_state, key):
  """Default ``SyncFn``: the fp32 sum over ``data`` of the weighted local gradients."""
  del key
  return lax.psum(jax.tree.map(lambda g: g.astype(jnp.float32), weighted_local_grads), AXIS), sync_state


# -- state ------------------------------------------------------------------------------------
class TrainState(NamedTuple):
  """Everything a step reads and writes. All replicated except ``sync_state`` (one per device,
  stacked on a leading axis sharded over ``data``) and, when the plan's ``optimizer_update`` is
  ``"sharded"``, ``opt_state`` (``shard_optimizer_state``: each device's shard, stacked the same way)."""

  step: jax.Array  # int32 scalar: steps taken (skipped steps included)
  params: Any  # fp32 master weights
  opt_state: Any  # optax state (replicated, or each device's shard: see above)
  model_state: Any  # non-param collections (e.g. {"batch_stats": ...})
  rng: jax.Array  # uint32 key data of the training key; step keys fold in ``step``
  loss_scale: LossScaleState
  sync_state: Any


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
    policy, k = plan.policy_for(g.name), plan.micro_steps_of(g.name)
    key = (json.dumps(policy.to_json(), sort_keys=True), g.batch_per_device, k)
    if key not in keys:
      keys[key] = len(specs)
      specs.append((policy, g.batch_per_device, k))
      groups.append([])
    groups[keys[key]].append(g.name)
    group_branch.append(keys[key])
  branches = tuple(Branch(tuple(n), p, b, k) for n, (p, b, k) in zip(groups, specs))
  return branches, tuple(group_branch[i] for i in cluster.device_group_indices())


def _float32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """What every compiled training program (``TrainStep``, ``StrategyStep``) offers the trainer:
  the fields they share (subclasses add theirs, among them ``step``) and the methods below."""

  task: Task
  cluster: ClusterSpec  # plan's batch overrides applied
  plan: Plan
  mesh: Mesh
  branches: tuple[Branch, ...]
  device_branch: tuple[int, ...]

  @property
  def global_batch(self) -> int:
    return self.cluster.global_batch

  def __call__(self, state, batch):
    return self.step(state, batch)

  def shard(self, host_batch):
    """Host global batch (``global_batch`` rows) → padded per-device shards on the mesh."""
    return shard_batch(host_batch, self.cluster, self.mesh)

  def full_state(self, state):
    """``state`` in its full form: what checkpoints store and what moves between programs
    (``from_full_state`` is the inverse). Here: ``state`` as it is."""
    return state

  def from_full_state(self, state):
    """This program's state from its full form (``full_state``). Here: ``state`` as it is."""
    return state


@dataclasses.dataclass(frozen=True)
class TrainStep(StepProgram):
  """A compiled hybrid data-parallel step and what it needs to run.

  ``step(state, sharded_batch) -> (state, metrics)`` (plus the combined gradient when built
  with ``return_grads=True``); ``init(seed, host_batch)`` makes the first state;
  ``shard(host_batch)`` cuts a global batch into per-device shards on the mesh.

  ``step`` is a top-level ``jax.jit`` compiled with ``STEP_COMPILER_OPTIONS``: call it (or its
  ``lower`` / ``trace``), do not nest it inside another jit, where JAX refuses XLA options.
  """

  optimizer: optax.GradientTransformation
  loss_scale: Any
  sync_init: Callable[[Any], Any]
  step: Callable
  state_sharding: Any

  def init(self, seed: int, host_batch) -> TrainState:
    """Initial state: params from ``init_variables`` (fp32), fresh optimizer/loss-scale/sync state
    (a sharded update's optimizer state: the shards of the replicated one)."""
    task, n = self.task, self.mesh.size
    optimizer = self.optimizer

    def init(sample):
      variables, rng = init_variables(task, seed, sample)
      params = variables.pop("params")
      one = self.sync_init(params)
      opt_state = optimizer_init(optimizer, params)
      if self.plan.optimizer_update == "sharded":
        check_sharded_optimizer(optimizer, params, n)
        opt_state = shard_optimizer_state(optimizer, opt_state, params, n)
      return TrainState(
        step=jnp.int32(0),
        params=params,
        opt_state=opt_state,
        model_state=variables,
        rng=rng,
        loss_scale=self.loss_scale.init(),
        sync_state=jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), one),
      )

    return jax.jit(init, out_shardings=self.state_sharding)(init_sample(host_batch, self.cluster, self.mesh))

  # -- what the trainer reads from a state (a step-builder strategy's program answers the same) --
  def step_count(self, state: TrainState) -> jax.Array:
    """Steps taken (int32 scalar)."""
    return state.step

  def params_of(self, state: TrainState):
    """The model's parameters (fp32 master weights)."""
    return state.params

  def variables_of(self, state: TrainState) -> dict:
    """``{"params": ..., **model_state}``: what ``task.model.apply`` takes for evaluation."""
    return {"params": state.params, **state.model_state}

  # -- the full form (checkpoints; moving a state between programs) ----------------------------
  @property
  def full_state_sharding(self) -> TrainState:
    """Shardings of ``full_state``: this program's, with the optimizer state replicated."""
    return self.state_sharding._replace(opt_state=NamedSharding(self.mesh, P()))

  def full_state(self, state: TrainState) -> TrainState:
    """``state`` with the optimizer state whole and replicated, as a replicated update holds it
    (``gather_optimizer_state`` of a sharded update's; ``state`` itself otherwise): the form
    checkpoints store, so any run resumes from any other's checkpoint."""
    if self.plan.optimizer_update != "sharded":
      return state
    return self._gather_state(state)

  def from_full_state(self, state: TrainState) -> TrainState:
    """This program's state from ``full_state``'s form (held on any devices): placed on this
    program's mesh, the optimizer state sharded when the plan shards the update."""
    state = jax.device_put(state, self.full_state_sharding)
    if self.plan.optimizer_update != "sharded":
      return state
    return self._shard_state(state)

  @functools.cached_property
  def _gather_state(self) -> Callable[[TrainState], TrainState]:
    return self._opt_state_converter(gather_optimizer_state, self.full_state_sharding)

  @functools.cached_property
  def _shard_state(self) -> Callable[[TrainState], TrainState]:
    return self._opt_state_converter(shard_optimizer_state, self.state_sharding)

  def _opt_state_converter(self, convert, out_shardings) -> Callable[[TrainState], TrainState]:
    """A jitted ``state -> state`` with ``opt_state = convert(optimizer, opt_state, params, n)``."""
    n, optimizer = self.mesh.size, self.optimizer

    def converted(s: TrainState) -> TrainState:
      return s._replace(opt_state=convert(optimizer, s.opt_state, s.params, n))

    return jax.jit(converted, out_shardings=out_shardings)


# -- the sharded optimizer update (plan.optimizer_update == "sharded") ----------------------------
def _map_param_leaves(optimizer, f, opt_state, params, n: int, other):
  """``opt_state`` with ``f(leaf, layout)`` on every leaf that mirrors a param leaf (``mu``,
  ``nu``, momentum traces…: ``optax.tree_utils.tree_map_params``; ``layout``: that param's
  ``even_layout`` over ``n`` devices) and ``other(leaf)`` on the rest (step counts, injected
  hyperparameters)."""
  return optax.tree_utils.tree_map_params(
    functools.partial(optimizer_init, optimizer),
    f,
    opt_state,
    even_layout(params, n),
    transform_non_params=other,
  )


def shard_optimizer_state(optimizer: optax.GradientTransformation, opt_state, params, n: int):
  """The sharded form of ``optimizer``'s replicated state ``opt_state`` (of ``params``) over ``n``
  devices: every leaf stacked on a leading axis of ``n`` (row ``i``: device ``i``'s), equivalent to
  ``layout.padded(x, n).reshape(n, layout.shard)`` for a leaf that mirrors a param and
  ``jnp.broadcast_to(x, (n, *x.shape))`` for any other. ``gather_optimizer_state`` inverts it."""
  return _map_param_leaves(
    optimizer,
    lambda x, lay: lay.padded(x, n).reshape(n, lay.shard),
    opt_state,
    params,
    n,
    lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))),
  )


def gather_optimizer_state(optimizer: optax.GradientTransformation, sharded, params, n: int):
  """The replicated state from ``shard_optimizer_state``'s form: ``layout.unpadded(x.reshape(-1))``
  for a leaf that mirrors a param, row 0 for any other (every row holds the same)."""
  return _map_param_leaves(
    optimizer, lambda x, lay: lay.unpadded(x.reshape(-1)), sharded, params, n, lambda x: x[0]
  )


def check_sharded_optimizer(optimizer: optax.GradientTransformation, params, n: int) -> None:
  """``QsyncError`` unless ``optimizer``'s update on each device's flat shard of every leaf of
  ``params`` (``even_layout`` over ``n`` devices) equals its update on the whole tree
  (``qsync_jax.sync.elementwise``). Traces the update abstractly; runs nothing."""
  shards = [
    lay.shard for lay in jax.tree.leaves(even_layout(params, n), is_leaf=lambda x: hasattr(x, "shard"))
  ]
  check_elementwise_optimizer(
    optimizer,
    params,
    shards,
    where="optimizer_update='sharded'",
    fix="set the plan's optimizer_update to 'replicated'",
    step_clips=True,
  )


def clip_by_global_norm(grads, clip_norm: float, sharded: bool):
  """``(clipped grads, global norm)``: the global L2 norm of ``grads`` (with ``sharded``: of the
  whole gradient whose shards the devices hold, the ``psum`` of their sums of squares; padding is
  zero) and ``grads`` scaled by ``clip_norm / norm`` when the norm is not below ``clip_norm`` —
  ``optax.clip_by_global_norm(clip_norm)``'s arithmetic, on the whole gradient in both forms."""
  sum_of_squares = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
  if sharded:
    sum_of_squares = lax.psum(sum_of_squares, AXIS)
  norm = jnp.sqrt(sum_of_squares)
  below = norm < clip_norm
  return jax.tree.map(lambda g: jnp.where(below, g, (g / norm.astype(g.dtype)) * clip_norm), grads), norm


def shard_batch(host_batch, cluster: ClusterSpec, mesh: Mesh):
  """Host global batch (``cluster.global_batch`` rows) → padded per-device shards on ``mesh``."""
  return put_sharded(pad_shards(host_batch, cluster.device_batch_sizes()), mesh, AXIS)


def init_sample(host_batch, cluster: ClusterSpec, mesh: Mesh):
  """The first ``max_batch_per_device`` rows of a host batch, replicated: the input of ``init_variables``."""
  return put_replicated(
    jax.tree.map(lambda x: np.asarray(x)[: cluster.max_batch_per_device], host_batch), mesh
  )


def init_variables(task: Task, seed: int, sample) -> tuple[dict, jax.Array]:
  """``(variables, rng)``: the fp32 variables of ``task.model.init`` and the key data of the
  training key, both derived from ``seed`` (traceable; every program of the trainer starts here,
  so one seed gives the same initial parameters whatever the sync strategy)."""
  init_key, train_key = jax.random.split(jax.random.key(seed))
  keys = jax.random.split(init_key, 2 + len(task.rng_streams))
  rngs = {"params": keys[0], RNG_COLLECTION: keys[1]}
  rngs.update({s: k for s, k in zip(task.rng_streams, keys[2:])})
  variables = task.model.init(rngs, *task.inputs(sample), **task.train_kwargs)
  return _float32(dict(variables)), jax.random.key_data(train_key)


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


def _split_sync(grad_sync) -> tuple[Callable, Callable[[Any], Any], str]:
  """(sync function, per-device state init, leaf order) of a ``SyncFn`` callable or an
  ``(init, sync)`` object; the leaf order is its ``leaf_order`` attribute (default ``"tree"``;
  ``"backward"`` for ``psum_sync``)."""
  sync = getattr(grad_sync, "sync", grad_sync)
  if not callable(sync):
    raise TypeError(
      f"grad_sync must be a callable (grads, state, key) -> (grads, state) or have .init and .sync, "
      f"got {type(grad_sync).__name__}. Fix: pass e.g. qsync_jax.sync.make_grad_sync('fp32')."
    )
  init = getattr(grad_sync, "init", None)
  order = "backward" if grad_sync is psum_sync else getattr(grad_sync, "leaf_order", "tree")
  if order not in ("tree", "backward"):
    raise QsyncError(f"grad_sync.leaf_order={order!r} is not an order. Fix: set it to 'tree' or 'backward'.")
  return sync, (init if callable(init) else (lambda params: ())), order


def make_train_step(
  task: Task,
  cluster: ClusterSpec,
  plan: Plan | None,
  optimizer: optax.GradientTransformation,
  grad_sync: SyncFn | str | None = None,
  *,
  sync_options: Mapping[str, Any] | None = None,
  devices: Sequence[Any] | None = None,
  loss_scale: DynamicLossScale | NoLossScale | None = None,
  return_grads: bool = False,
  donate: bool | None = None,
  sync_leaf_order: str = "auto",
  clip_norm: float | None = None,
) -> TrainStep:
  """Builds the hybrid synchronous data-parallel step of ``task`` on ``cluster`` under ``plan``.

  Args:
    task: the model, its inputs, loss and data.
    cluster: device groups; device ``i`` of ``devices`` belongs to ``cluster.device_group_indices()[i]``.
    plan: one precision policy per group (None: every group runs the float model), optional
      per-device batch overrides and where the optimizer runs (``optimizer_update``:
      ``"replicated"`` on every device, ``"sharded"`` each device its 1/N share; module doc).
    optimizer: an optax transformation, applied to the combined fp32 gradient (elementwise —
      sgd, momentum, adam, adamw… — when the plan shards the update: each device's update sees
      its flat shard of every leaf, not the whole tree, so a global-norm clip or a mask chosen by
      leaf rank would be wrong).
    grad_sync: a ``SyncFn`` callable (default ``psum_sync``), an object with ``init`` and
      ``sync`` such as ``qsync_jax.sync.make_grad_sync(name)``, or the name of a gradient-hook
      strategy (``make_grad_sync(grad_sync, **sync_options)``).
    sync_options: the named strategy's options.
    devices: the devices of the job, in order (default ``jax.devices()``: all processes').
    loss_scale: default ``DynamicLossScale()`` when the plan has an fp16 leg, else ``NoLossScale()``.
    return_grads: the step also returns the combined (unscaled) gradient.
    donate: donate the input state's buffers (default: on accelerators, not on the CPU).
    sync_leaf_order: ``"auto"``: the sync's own ``leaf_order`` (``"backward"`` for the default
      and the built-in all-reduces: the gradient leaves are handed over as a list in the order
      the backward pass produces them, so an all-reduce's buckets can start during the
      backward; see ``qsync_jax.sync.order`` for what it does and does not change on GPUs);
      ``"tree"``: the gradient tree as is, whatever the sync says (the order before this
      option existed).
    clip_norm: the largest global L2 norm of the combined fp32 gradient (None: no clipping): the
      gradient is scaled by ``clip_norm / norm`` when its norm is larger, before the optimizer —
      ``optax.clip_by_global_norm``'s arithmetic, with the norm over the whole gradient in both
      update modes; the pre-clip norm is logged as the metric ``grad_norm``.
  """
  plan = plan if plan is not None else Plan()
  check_step_plan(plan, None if grad_sync is psum_sync else grad_sync, clip_norm=clip_norm)
  if isinstance(grad_sync, str):
    grad_sync = make_grad_sync(grad_sync, **(sync_options or {}))
  elif sync_options:
    raise QsyncError(
      "sync_options apply to a strategy given by name. Fix: pass grad_sync='<name>', or drop sync_options."
    )
  cluster, devices = plan.place(cluster, list(jax.devices() if devices is None else devices))
  mesh = Mesh(np.asarray(devices), (AXIS,))
  if plan.reduction == "two_level":  # the two-level fp32 sum in place of the default psum
    grad_sync = two_level_sync(tuple(g.count for g in cluster.groups))
  grad_sync, sync_init, leaf_order = _split_sync(grad_sync if grad_sync is not None else psum_sync)
  if sync_leaf_order not in ("auto", "tree"):
    raise QsyncError(
      f"sync_leaf_order={sync_leaf_order!r} is not an option. Fix: pass 'auto' (the sync's own "
      "leaf_order) or 'tree' (the gradient tree as is)."
    )
  leaf_order = "tree" if sync_leaf_order == "tree" else leaf_order
  if loss_scale is None:
    loss_scale = DynamicLossScale() if plan.needs_fp16_loss_scaling else NoLossScale()
  branches, device_branch = plan_branches(cluster, plan)
  global_batch = cluster.global_batch

  def branch_fn(branch: Branch):
    """The branch's run: its ``k = micro_steps`` micro-batches of ``b/k`` (its rows of the batch
    in order), each weighted by its share ``(b/k)/B`` of the global batch, summed in fp32 —
    ``sum(micro(params, model_state, local[i*b/k:(i+1)*b/k], fold_in(key, i), scale) for i)``,
    with the key unfolded when ``k == 1``; every micro-batch starts from the same model state,
    so the state kept is the weighted average of the micro-batches' (non-float leaves: the last)."""
    task_loss_fn = task_loss(task, branch.policy)
    b, k = branch.batch_per_device, branch.micro_steps
    micro_batch = b // k
    weight = micro_batch / global_batch

    def run(params, model_state, batch, key, scale):
      local = jax.tree.map(lambda x: x[:b], batch)
      if k == 1:
        return micro(params, model_state, local, key, scale)
      names: list[tuple[str, ...]] = []

      def step(acc, i_and_slice):
        i, mb = i_and_slice
        grads, scalars, new_state, metric_names = micro(
          params, model_state, mb, jax.random.fold_in(key, i), scale
        )
        names.append(metric_names)
        return jax.tree.map(lambda a, x: a + x if is_float(x) else x, acc, (grads, scalars, new_state)), None

      slices = jax.tree.map(lambda x: x.reshape(k, micro_batch, *x.shape[1:]), local)
      first = jax.tree.map(lambda x: x[0], slices)
      shapes = jax.eval_shape(lambda mb: micro(params, model_state, mb, key, scale)[:3], first)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      # The carry is typed varying like the micro-steps' results (a constant zero is invariant).
      zeros = zeros if alone else to_varying(zeros)
      (grads, scalars, new_state), _ = lax.scan(step, zeros, (jnp.arange(k, dtype=jnp.int32), slices))
      return grads, scalars, new_state, names[-1]

    def micro(params, model_state, local, key, scale):
      """One micro-batch's fp32 gradient, loss and metrics, and updated state, each times ``weight``."""

      def loss_fn(p):
        loss, metrics, updated = task_loss_fn({"params": p, **model_state}, local, key)
        loss = loss.astype(jnp.float32)
        scaled = loss * scale if loss_scale.enabled else loss
        return scaled, (loss, metrics, updated)

      scaled, vjp_fn, (loss, metrics, updated) = jax.vjp(loss_fn, params, has_aux=True)
      cotangent = jnp.ones_like(scaled)
      if want_order and not orders:  # the first traced branch decides the sync's leaf order
        orders.append(backward_order(jax.make_jaxpr(vjp_fn)(cotangent), len(jax.tree.leaves(params))))
      (grads,) = vjp_fn(cotangent)
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      scalars = jnp.stack([loss, *(jnp.asarray(v, jnp.float32) for v in metrics.values())])
      new_state = {c: updated.get(c, model_state[c]) for c in model_state}
      if loss_scale.enabled or weight != 1.0:  # one device with the whole batch: nothing to weight
        factor = weight / scale if loss_scale.enabled else jnp.float32(weight)
        grads = jax.tree.map(lambda g: g * factor, grads)
        scalars = scalars * jnp.float32(weight)
        new_state = jax.tree.map(lambda x: x * jnp.float32(weight) if is_float(x) else x, new_state)
      return grads, scalars, new_state, tuple(metrics)

    return run

  runs = [branch_fn(b) for b in branches]
  sharded = plan.optimizer_update == "sharded"
  # One device with the default sync: every collective is the identity, so emit none (a
  # 1-device all-reduce still copies every gradient) and skip the varying/invariant typing.
  # (A sharded update keeps its collectives: its state has the sharded form on any mesh.)
  alone = mesh.size == 1 and grad_sync is psum_sync and not sharded
  want_order = leaf_order == "backward" and not alone
  metric_names: list[tuple[str, ...]] = []
  orders: list[tuple[int, ...]] = []  # the gradient leaves' backward order (``sync.order``)
  n = mesh.size

  def reduce_scatter(grads, layout):
    """This device's shard of the sum over ``data`` of every leaf of ``grads`` (padded as
    ``layout`` says): one ``psum_scatter`` per leaf, issued in the backward pass's leaf order
    when the sync has one (as the all-reduce's buckets are)."""

    def one(g, lay):
      return lax.psum_scatter(lay.padded(g, n), AXIS, tiled=True)

    if not want_order:
      return jax.tree.map(one, grads, layout)
    shards = [one(g, lay) for g, lay in zip(in_order(grads, orders[0]), in_order(layout, orders[0]))]
    return from_order(shards, grads, orders[0])

  def local_step(state: TrainState, batch):
    index = lax.axis_index(AXIS)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    sync_key, device_base = jax.random.split(step_key)
    scale = state.loss_scale.scale
    varying = (lambda t: t) if alone else to_varying
    operands = (
      varying(state.params),
      varying(state.model_state),
      batch,
      jax.random.fold_in(device_base, index),
      scale,
    )

    def strip(run):
      def f(*args):
        grads, scalars, new_state, names = run(*args)
        metric_names.append(names)
        return grads, scalars, new_state

      return f

    grads, scalars, new_state = device_switch([strip(r) for r in runs], device_branch)(*operands)

    sync_state = jax.tree.map(lambda x: x[0], state.sync_state)
    if sharded:  # reduce-scattered below, with the optimizer update
      combined = None
    elif alone:
      combined = grads
    elif want_order:  # the leaves as a list, in the order the backward pass produces them
      combined, sync_state = grad_sync(in_order(grads, orders[0]), sync_state, sync_key)
      combined = from_order(combined, grads, orders[0])
    else:
      combined, sync_state = grad_sync(grads, sync_state, sync_key)
    sync_state = jax.tree.map(lambda x: x[None], sync_state)
    if not alone:
      scalars = lax.psum(scalars, AXIS)
      new_state = jax.tree.map(lambda x: lax.psum(x, AXIS) if is_float(x) else lax.pmax(x, AXIS), new_state)

    if sharded:
      layout = even_layout(state.params, n)
      grad_shards = reduce_scatter(grads, layout)
      param_shards = jax.tree.map(
        lambda p, lay: lax.dynamic_slice_in_dim(lay.padded(p, n), index * lay.shard, lay.shard),
        state.params,
        layout,
      )
      old_params, old_opt = param_shards, jax.tree.map(lambda x: x[0], state.opt_state)
      update_grads = grad_shards
    else:
      old_params, old_opt, update_grads = state.params, state.opt_state, combined
    names = metric_names[-1]
    metrics = {"loss": scalars[0], **{k: scalars[1 + i] for i, k in enumerate(names)}}
    clipped = update_grads
    if clip_norm is not None:
      clipped, metrics["grad_norm"] = clip_by_global_norm(update_grads, clip_norm, sharded)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
      updates, opt_state = optimizer.update(clipped, old_opt, old_params)
      params = optax.apply_updates(old_params, updates)
    ls_state = state.loss_scale
    if loss_scale.enabled:  # a sharded update: each device checks its shard, pmin checks them all
      finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(update_grads)]))
      if not alone:
        finite = lax.pmin(to_varying(finite.astype(jnp.int32)), AXIS) > 0

      def keep(new, old):
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

      params, opt_state = keep(params, old_params), keep(opt_state, old_opt)
      new_state = keep(new_state, state.model_state)
      ls_state = loss_scale.update(state.loss_scale, finite)
      metrics["loss_scale"] = scale
      metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
    if sharded:  # every device's updated shard → the replicated params
      params = jax.tree.map(lambda x, lay: lay.unpadded(all_gather_invariant(x, AXIS)), params, layout)
      opt_state = jax.tree.map(lambda x: x[None], opt_state)
      if return_grads:
        combined = jax.tree.map(
          lambda x, lay: lay.unpadded(all_gather_invariant(x, AXIS)), grad_shards, layout
        )
    new = TrainState(state.step + 1, params, opt_state, new_state, state.rng, ls_state, sync_state)
    return (new, metrics, combined) if return_grads else (new, metrics)

  state_specs = TrainState(P(), P(), P(AXIS) if sharded else P(), P(), P(), P(), P(AXIS))
  out_specs = (state_specs, P(), P()) if return_grads else (state_specs, P())
  # The two-level sum is point-to-point sends, typed varying, and the same on every device: typing it
  # invariant would cost a collective over every device, so that step is not type-checked.
  check_vma = not alone and plan.reduction != "two_level"
  mapped = shard_map(
    local_step, mesh=mesh, in_specs=(state_specs, P(AXIS)), out_specs=out_specs, check_vma=check_vma
  )

  def checked(state: TrainState, batch):
    if sharded:  # on the params' shapes, when the step is traced (before it compiles)
      check_sharded_optimizer(optimizer, state.params, n)
    return mapped(state, batch)

  if donate is None:
    donate = devices[0].platform != "cpu"
  step = jax.jit(checked, donate_argnums=(0,) if donate else (), compiler_options=STEP_COMPILER_OPTIONS)
  state_sharding = TrainState(*(NamedSharding(mesh, s) for s in state_specs))
  return TrainStep(
    task=task,
    cluster=cluster,
    plan=plan,
    mesh=mesh,
    branches=branches,
    device_branch=device_branch,
    optimizer=optimizer,
    loss_scale=loss_scale,
    sync_init=sync_init,
    step=step,
    state_sharding=state_sharding,
  )
