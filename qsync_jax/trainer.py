"""The hybrid synchronous data-parallel trainer: state, data feeding, metrics, checkpoints.

``Trainer`` wraps the compiled step of ``qsync_jax.train_step`` and owns what lives between
steps: the ``TrainState``, the training data iterator and its position, the metrics log
(``metrics.jsonl``), progress on stderr and checkpoints (``checkpoints/``) in ``out_dir``.

Example::

  trainer = Trainer(task, ClusterSpec.load("cluster.json"), Plan.load("plan.json"),
                    optax.adam(1e-3), out_dir="runs/a", checkpoint_every=100, resume=True)
  last = trainer.run(1000)          # trains until step 1000 in total
  held_out = trainer.evaluate()

``grad_sync`` may name any strategy of ``qsync_jax.sync`` (options in ``sync_options``): a
gradient hook (fp32, bf16, fp16, global_qsgd) runs in the hybrid step; a step builder
(selsync, qsdp) runs as ``qsync_jax.strategy_step.StrategyStep``, with the same data,
metrics, progress, checkpoints and evaluation (at its consolidated / gathered parameters).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import optax

from qsync_jax.batching import batch_size as batch_size_of
from qsync_jax.batching import put_replicated
from qsync_jax.checkpoint import CheckpointStore, signature
from qsync_jax.cluster import ClusterSpec
from qsync_jax.distributed import Watchdog
from qsync_jax.errors import CheckpointError, QsyncError
from qsync_jax.plan import Plan
from qsync_jax.strategy_step import make_strategy_step
from qsync_jax.sync import get_strategy, make_grad_sync
from qsync_jax.task import Task
from qsync_jax.train_step import SyncFn, make_train_step


class Trainer:
  """Trains ``task`` on ``cluster`` under ``plan``; see ``make_train_step`` for the step.

  Args:
    task, cluster, plan, optimizer, devices, loss_scale: as ``make_train_step``
      (optimizer default ``optax.adam(1e-3)``).
    grad_sync: a ``SyncFn`` as ``make_train_step``, or the name of a ``qsync_jax.sync``
      strategy (gradient hook or step builder, see the module doc).
    sync_options: options of the named strategy (its ``Strategy.options``).
    seed: seeds the parameters, the step RNG and the data order.
    out_dir: where ``metrics.jsonl`` and ``checkpoints/`` go (None: nothing is written).
    checkpoint_every: save every this many steps (0: only at the end of ``run``).
    resume: restore the latest checkpoint of ``out_dir`` if there is one.
    log_every: write metrics every this many steps.
    progress: stream for progress lines (None: silent).
    step_timeout_s: multi-process watchdog: end the process if a step takes longer (after the
      first, which compiles). Default 120 s when there are several processes, else off.
    donate: let each step reuse the previous state's buffers (default: on accelerators; hybrid
      step only, a step-builder strategy's step keeps its input).
  """

  def __init__(
    self,
    task: Task,
    cluster: ClusterSpec,
    plan: Plan | None = None,
    optimizer: optax.GradientTransformation | None = None,
    *,
    grad_sync: SyncFn | str | None = None,
    sync_options: Mapping[str, Any] | None = None,
    seed: int = 0,
    out_dir: str | None = None,
    devices: Sequence[Any] | None = None,
    loss_scale=None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 3,
    resume: bool = False,
    log_every: int = 1,
    progress: TextIO | None = None,
    step_timeout_s: float | None = None,
    donate: bool | None = None,
  ):
    self.task, self.seed = task, int(seed)
    optimizer = optimizer if optimizer is not None else optax.adam(1e-3)
    self.sync = _sync_meta(grad_sync, sync_options)
    sample = next(iter(task.train_batches((plan or Plan()).apply_to(cluster).global_batch, self.seed)))
    if isinstance(grad_sync, str) and get_strategy(grad_sync).kind == "train_step":
      if loss_scale is not None:
        raise QsyncError(
          f"loss_scale: sync strategy {grad_sync!r} builds its own step, which has no loss scaling. "
          "Fix: drop loss_scale, or use a gradient-hook strategy."
        )
      self.program = make_strategy_step(
        task, cluster, plan, optimizer, grad_sync, sync_options, sample, devices=devices
      )
    else:
      if isinstance(grad_sync, str):
        grad_sync = make_grad_sync(grad_sync, **(sync_options or {}))
      self.program = make_train_step(
        task, cluster, plan, optimizer, grad_sync, devices=devices, loss_scale=loss_scale, donate=donate
      )
    self.out_dir = out_dir
    self.checkpoint_every, self.log_every, self.progress = checkpoint_every, max(1, log_every), progress
    self.is_primary = jax.process_index() == 0
    # XLA's CPU collectives can deadlock with two multi-device steps in flight on a small host
    # (seen on 2 cores: "Termination timeout for all reduce"); accelerators pipeline steps.
    self._one_step_in_flight = jax.default_backend() == "cpu" and jax.device_count() > 1
    self.checkpoints = (
      CheckpointStore(os.path.join(out_dir, "checkpoints"), keep_checkpoints) if out_dir else None
    )
    if out_dir and self.is_primary:
      os.makedirs(out_dir, exist_ok=True)
    self.state = self.program.init(self.seed, sample)
    self.data_position = 0
    self._batches = None
    self._eval_fn = None
    if step_timeout_s is None and jax.process_count() > 1:
      step_timeout_s = 120.0
    self.step_timeout_s = step_timeout_s
    if resume:
      self.resume()

  # -- properties -------------------------------------------------------------------------
  @property
  def global_batch(self) -> int:
    return self.program.global_batch

  @property
  def step(self) -> int:
    return int(self.program.step_count(self.state))

  @property
  def params(self):
    """The model's parameters (a step-builder strategy's consolidated / gathered ones)."""
    return self.program.params_of(self.state)

  # -- data ---------------------------------------------------------------------------------
  def _next_batch(self):
    if self._batches is None:
      self._batches = iter(self.task.train_batches(self.global_batch, self.seed))
      for _ in range(self.data_position):  # a resumed run skips what was consumed
        next(self._batches)
    batch = next(self._batches)
    self.data_position += 1
    return self.program.shard(batch)

  # -- checkpoints --------------------------------------------------------------------------
  def _meta(self) -> dict[str, Any]:
    return {
      "task": self.task.name,
      "params": signature(jax.eval_shape(self.program.params_of, self.state)),
      "plan_fingerprint": self.program.plan.fingerprint(),
      **self.sync,
      # What shapes the training (not memory or link speeds, which only the planner reads).
      "cluster": [[g.name, g.count, g.batch_per_device] for g in self.program.cluster.groups],
      "seed": self.seed,
    }

  def save(self) -> None:
    """Checkpoints the current state (all processes must call it)."""
    if self.checkpoints is None:
      raise CheckpointError("this trainer has no out_dir, so it cannot save. Fix: pass out_dir=...")
    meta = dict(
      self._meta(), step=self.step, data_position=self.data_position, plan=self.program.plan.to_json()
    )
    self.checkpoints.save(self.step, self.state, self.params, meta)

  def resume(self, step: int | None = None) -> bool:
    """Restores checkpoint ``step`` (default: latest); False if there is none. The trainer
    changes only once the checkpoint has passed every check."""
    if self.checkpoints is None or (step is None and self.checkpoints.latest_step() is None):
      return False
    state, meta = self.checkpoints.restore(self.state, self._meta(), step)
    self.state, self.data_position, self._batches = state, int(meta["data_position"]), None
    return True

  # -- training -----------------------------------------------------------------------------
  def train_step(self) -> dict[str, float]:
    """One step; returns its metrics (host floats)."""
    self.state, metrics = self.program(self.state, self._next_batch())
    return {k: float(v) for k, v in metrics.items()}

  def run(
    self, steps: int, callback: Callable[[int, dict[str, float]], None] | None = None
  ) -> dict[str, float]:
    """Trains until ``steps`` steps in total have run (a resumed run continues); returns the
    last metrics. Logs every ``log_every`` steps, checkpoints every ``checkpoint_every`` steps
    and at the end."""
    start_step, t0 = self.step, time.perf_counter()
    last: dict[str, float] = {}
    watchdog = None
    pending = None  # metrics of the previous step, read after the next one is dispatched
    step = start_step
    try:
      while step < steps:
        self.state, metrics = self.program(self.state, self._next_batch())
        if self._one_step_in_flight:
          jax.block_until_ready(metrics)
        step += 1
        if pending is not None:
          last = self._log(*pending, start_step, steps, t0, callback)
        pending = (step, metrics) if step % self.log_every == 0 or step == steps else None
        if watchdog is not None:
          watchdog.beat()
        if self.checkpoint_every and step % self.checkpoint_every == 0:
          if pending is not None:
            last, pending = self._log(*pending, start_step, steps, t0, callback), None
          self.save()
          if watchdog is not None:
            watchdog.beat()
        if watchdog is None and self.step_timeout_s:  # after the first step, which compiles
          jax.block_until_ready(self.program.step_count(self.state))
          watchdog = Watchdog(self.step_timeout_s).start()
      if pending is not None:
        last = self._log(*pending, start_step, steps, t0, callback)
      if self.checkpoints is not None and self.step > 0 and self.checkpoints.latest_step() != self.step:
        self.save()
    finally:
      if watchdog is not None:
        watchdog.stop()
    return last

  def _log(self, step, metrics, start_step, steps, t0, callback) -> dict[str, float]:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # one transfer
    elapsed = time.perf_counter() - t0
    rate = (step - start_step) / elapsed if elapsed > 0 else 0.0
    record = {"step": step, **values, "steps_per_s": rate, "time_s": elapsed}
    if self.out_dir and self.is_primary:
      with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if self.progress is not None and self.is_primary:
      eta = (steps - step) / rate if rate > 0 else float("nan")
      print(
        f"step {step}/{steps}  loss {values['loss']:.4f}  {rate:.2f} steps/s  ETA {eta:.0f}s",
        file=self.progress,
        flush=True,
      )
    if callback is not None:
      callback(step, values)
    return values

  # -- evaluation ---------------------------------------------------------------------------
  def evaluate(self, batch_size: int = 256, max_batches: int | None = None) -> dict[str, float]:
    """Held-out loss and metrics of the float model at the current params (means over examples).

    Runs ``task.eval_batches(batch_size)`` with ``task.eval_kwargs`` on every device of the
    job (replicated); {} when the task has no held-out set.
    """
    if self.task.eval_batches is None:
      return {}
    if self._eval_fn is None:
      task = self.task

      def eval_fn(variables, batch):
        loss, metrics = task.loss(task.model.apply(variables, *task.inputs(batch), **task.eval_kwargs), batch)
        return {"loss": loss, **metrics}

      self._eval_fn = jax.jit(eval_fn)
    variables = self.program.variables_of(self.state)
    totals: dict[str, float] = {}
    count = 0
    for i, batch in enumerate(self.task.eval_batches(batch_size)):
      if max_batches is not None and i >= max_batches:
        break
      n = batch_size_of(batch)
      metrics = self._eval_fn(variables, put_replicated(batch, self.program.mesh))
      for k, v in metrics.items():
        totals[k] = totals.get(k, 0.0) + float(v) * n
      count += n
    return {k: v / count for k, v in totals.items()} if count else {}

  def close(self) -> None:
    if self.checkpoints is not None:
      self.checkpoints.close()


def _sync_meta(grad_sync, options) -> dict[str, Any]:
  """What a checkpoint records of a step-builder strategy (its name and options must match
  on resume); {} for gradient hooks (their state's layout is checked instead)."""
  if isinstance(grad_sync, str) and get_strategy(grad_sync).kind == "train_step":
    return {
      "sync": json.loads(json.dumps({"name": grad_sync, **(options or {})}, sort_keys=True, default=_name))
    }
  if options and not isinstance(grad_sync, str):
    raise QsyncError(
      "sync_options apply to a strategy given by name. Fix: pass grad_sync='<name>', or drop sync_options."
    )
  return {}


def _name(obj) -> str:
  return getattr(obj, "__qualname__", type(obj).__name__)
