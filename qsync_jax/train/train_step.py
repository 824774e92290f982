"""One synchronous data-parallel training step over hybrid device groups.

The step is one SPMD program: ``shard_map`` over the ``data`` mesh axis, one device per
position. Every device runs its group's precision policy: the model is quantized once per
distinct (policy, per-device batch, micro-steps) — a *branch* (``qsync_jax.train.branch``) — and
``lax.switch`` on the device's branch index (a constant table indexed by ``lax.axis_index``)
picks the branch; a cluster with one branch calls it directly. Each device's step
(``_StepFunction.local_step``) reads: gradients → sync (or reduce-scatter) → clip → optimizer
update → finite check.

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
* with ``clip_norm``, the combined gradient is scaled to at most that global L2 norm before the
  optimizer (``optax.clip_by_global_norm``'s arithmetic, the norm over the whole gradient; metric
  ``grad_norm``: the norm before clipping); an optimizer made with ``optax.inject_hyperparams``
  (``qsync_jax.train.optimizers.make_optimizer``) has its learning rate logged as ``lr``;
* master params, optimizer state and model state are fp32 and replicated; the optimizer
  (optax) runs on every device on the same combined gradient — unless the plan's
  ``optimizer_update`` is ``"sharded"`` (ZeRO-1, ``qsync_jax.train.sharded_update``): the
  gradients are reduce-scattered, each device updates its 1/N shard of every leaf with its
  shard of the optimizer state, and the shards are all-gathered; the result equals the
  replicated update up to the fp32 summation order, and an optimizer whose update would not
  (a global-norm clip, LAMB, a mask chosen by leaf rank) is refused when the step is traced;
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
from qsync_jax.sync import make_grad_sync
from qsync_jax.sync.common import (
  AXIS,
  STEP_COMPILER_OPTIONS,
  is_float,
  optimizer_init,
  to_varying,
)
from qsync_jax.sync.order import from_order, in_order
from qsync_jax.sync.qsdp import even_layout
from qsync_jax.sync.two_level import two_level_sync
from qsync_jax.train.batching import pad_shards, put_replicated, put_sharded
from qsync_jax.train.branch import Branch, branch_run, branch_signature, branch_switch, plan_branches
from qsync_jax.train.loss_scale import DynamicLossScale, LossScaleState, NoLossScale
from qsync_jax.train.optimizers import learning_rate_of
from qsync_jax.train.sharded_update import (
  ShardedUpdate,
  check_sharded_optimizer,
  clip_by_global_norm,
  gather_optimizer_state,
  shard_optimizer_state,
)
from qsync_jax.train.step_plan import check_step_plan
from qsync_jax.train.task import Task

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
      its flat shard of every leaf, so an optimizer reading across elements or choosing by a
      leaf's shape is refused, ``check_sharded_optimizer``; clip with ``clip_norm``).
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
  if sync_leaf_order not in ("auto", "tree"):
    raise QsyncError(
      f"sync_leaf_order={sync_leaf_order!r} is not an option. Fix: pass 'auto' (the sync's own "
      "leaf_order) or 'tree' (the gradient tree as is)."
    )
  if isinstance(grad_sync, str):
    grad_sync = make_grad_sync(grad_sync, **(sync_options or {}))
  elif sync_options:
    raise QsyncError(
      "sync_options apply to a strategy given by name. Fix: pass grad_sync='<name>', or drop sync_options."
    )
  cluster, devices = plan.place(cluster, list(jax.devices() if devices is None else devices))
  mesh = Mesh(np.asarray(devices), (AXIS,))
  if plan.reduction == "two_level":  # the two-level fp32 sum (buckets in backward order) in place of the psum
    grad_sync = two_level_sync(tuple(g.count for g in cluster.groups))
  sync, sync_init, leaf_order = _split_sync(grad_sync if grad_sync is not None else psum_sync)
  if loss_scale is None:
    loss_scale = DynamicLossScale() if plan.needs_fp16_loss_scaling else NoLossScale()
  branches, device_branch = plan_branches(cluster, plan)
  sharded = plan.optimizer_update == "sharded"
  step_fn = _StepFunction(
    task=task,
    global_batch=cluster.global_batch,
    branches=branches,
    device_branch=device_branch,
    optimizer=optimizer,
    sync=sync,
    # One device with the default sync: every collective is the identity, so emit none (a
    # 1-device all-reduce still copies every gradient) and skip the varying/invariant typing.
    # (A sharded update keeps its collectives: its state has the sharded form on any mesh.)
    alone=mesh.size == 1 and sync is psum_sync and not sharded,
    backward=leaf_order == "backward" and sync_leaf_order == "auto",
    sharded=sharded,
    loss_scale=loss_scale,
    clip_norm=clip_norm,
    return_grads=return_grads,
    mesh=mesh,
    # The two-level sum is point-to-point sends, typed varying, and the same on every device: typing it
    # invariant would cost a collective over every device, so that step is not type-checked.
    check_vma=plan.reduction != "two_level",
  )
  if donate is None:
    donate = devices[0].platform != "cpu"
  step = jax.jit(step_fn, donate_argnums=(0,) if donate else (), compiler_options=STEP_COMPILER_OPTIONS)
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
    state_sharding=TrainState(*(NamedSharding(mesh, s) for s in step_fn.state_specs)),
  )


@dataclasses.dataclass(frozen=True)
class ReplicatedUpdate:
  """The replicated update's per-step pieces (the interface of ``ShardedUpdate``): the gradient
  sync's combined gradient; every device updates the whole tree."""

  sync: Callable
  alone: bool
  order: Sequence[int] | None = None

  def gradients(self, grads, sync_state, key):
    if self.alone:
      return grads, sync_state
    if self.order is None:
      return self.sync(grads, sync_state, key)
    # the leaves as a list, in the order the backward pass produces them
    combined, sync_state = self.sync(in_order(grads, self.order), sync_state, key)
    return from_order(combined, grads, self.order), sync_state

  def local(self, params, opt_state):
    return params, opt_state

  def whole(self, params, opt_state):
    return params, opt_state

  def whole_grads(self, grads):
    return grads


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: jax.jit caches on it
class _StepFunction:
  """``step(state, batch)`` of ``make_train_step``, before ``jax.jit``: traces the branches'
  signature (``branch_signature``) and the optimizer check on the state's shapes, then runs
  ``local_step`` under ``shard_map``."""

  task: Task
  global_batch: int
  branches: tuple[Branch, ...]
  device_branch: tuple[int, ...]
  optimizer: optax.GradientTransformation
  sync: Callable
  alone: bool
  backward: bool  # the sync takes the gradient leaves in backward order
  sharded: bool
  loss_scale: Any
  clip_norm: float | None
  return_grads: bool
  mesh: Mesh
  check_vma: bool

  @property
  def state_specs(self) -> TrainState:
    return TrainState(P(), P(), P(AXIS) if self.sharded else P(), P(), P(), P(), P(AXIS))

  def __call__(self, state: TrainState, batch):
    n = self.mesh.size
    if self.sharded:  # on the params' shapes, when the step is traced (before it compiles)
      check_sharded_optimizer(self.optimizer, state.params, n)
    device_batch = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), batch
    )
    signature = branch_signature(
      self.task, self.branches[0], state.params, state.model_state, device_batch, self.loss_scale.enabled
    )
    order = signature.backward_order if self.backward and not self.alone else None
    if self.sharded:
      update = ShardedUpdate(even_layout(state.params, n), n, order)
    else:
      update = ReplicatedUpdate(self.sync, self.alone, order)
    specs = self.state_specs
    out_specs = (specs, P(), P()) if self.return_grads else (specs, P())
    local = functools.partial(self.local_step, update, signature.metric_names)
    mapped = shard_map(
      local,
      mesh=self.mesh,
      in_specs=(specs, P(AXIS)),
      out_specs=out_specs,
      check_vma=self.check_vma and not self.alone,
    )
    return mapped(state, batch)

  def branch_runs(self, metric_names) -> Callable:
    """``run(params, model_state, batch, key, scale)`` of this device's branch (``branch_switch``:
    on the CPU, a branch in a ``lax.switch`` or with micro-steps has its convolutions in XLA:CPU's
    canonical order)."""
    varying = (lambda t: t) if self.alone else to_varying
    scaled = self.loss_scale.enabled
    runs = [
      branch_run(self.task, b, self.global_batch, metric_names, scaled=scaled, varying=varying)
      for b in self.branches
    ]
    return branch_switch(runs, self.branches, self.device_branch, self.mesh.devices.flat[0].platform)

  def local_step(self, update, metric_names, state: TrainState, batch):
    """One device's step: gradients → sync or reduce-scatter → (clip) → update → finite check."""
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    sync_key, device_base = jax.random.split(step_key)
    varying = (lambda t: t) if self.alone else to_varying
    operands = (varying(state.params), varying(state.model_state), batch)
    key = jax.random.fold_in(device_base, lax.axis_index(AXIS))
    grads, scalars, new_state = self.branch_runs(metric_names)(*operands, key, state.loss_scale.scale)
    sync_state = jax.tree.map(lambda x: x[0], state.sync_state)
    grads, sync_state = update.gradients(grads, sync_state, sync_key)
    if not self.alone:
      scalars = lax.psum(scalars, AXIS)
      new_state = jax.tree.map(lambda x: lax.psum(x, AXIS) if is_float(x) else lax.pmax(x, AXIS), new_state)
    metrics = {"loss": scalars[0], **{m: scalars[1 + i] for i, m in enumerate(metric_names)}}
    params, opt_state = update.local(state.params, state.opt_state)
    new_params, new_opt = self.optimizer_update(grads, opt_state, params, metrics)
    lr = learning_rate_of(new_opt)  # an optax.inject_hyperparams state: the rate this update used
    if lr is not None:  # (sharded: every device's row holds it; the pmax types it invariant)
      metrics["lr"] = lax.pmax(lr, AXIS) if self.sharded else lr
    ls_state = state.loss_scale
    if self.loss_scale.enabled:
      finite = self.all_finite(grads)
      new_params, new_opt, new_state = jax.tree.map(
        lambda n, o: jnp.where(finite, n, o),
        (new_params, new_opt, new_state),
        (params, opt_state, state.model_state),
      )
      ls_state = self.loss_scale.update(state.loss_scale, finite)
      metrics.update(loss_scale=state.loss_scale.scale, skipped=1.0 - finite.astype(jnp.float32))
    new_params, new_opt = update.whole(new_params, new_opt)
    sync_state = jax.tree.map(lambda x: x[None], sync_state)
    new = TrainState(state.step + 1, new_params, new_opt, new_state, state.rng, ls_state, sync_state)
    return (new, metrics, update.whole_grads(grads)) if self.return_grads else (new, metrics)

  def optimizer_update(self, grads, opt_state, params, metrics):
    """``(params, opt_state)`` after the optimizer's update on ``grads`` (clipped to
    ``clip_norm`` first, the norm logged in ``metrics["grad_norm"]``)."""
    if self.clip_norm is not None:
      grads, metrics["grad_norm"] = clip_by_global_norm(grads, self.clip_norm, self.sharded)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

  def all_finite(self, grads) -> jax.Array:
    """True when every device's ``grads`` (a sharded update: each device's shard) are finite."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    if self.alone:
      return finite
    return lax.pmin(to_varying(finite.astype(jnp.int32)), AXIS) > 0
