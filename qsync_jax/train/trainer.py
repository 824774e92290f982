"""The hybrid synchronous data-parallel trainer: state, data feeding, metrics, checkpoints.

``Trainer`` wraps the compiled step of ``qsync_jax.train.train_step`` and owns what lives between
steps: the ``TrainState``, the training data iterator and its position, the metrics log
(``metrics.jsonl``, and TensorBoard events in ``tensorboard/`` when ``tensorboardX`` is installed),
progress on stderr and checkpoints (``checkpoints/``) in ``out_dir``.

Example::

  trainer = Trainer(task, ClusterSpec.load("cluster.json"), Plan.load("plan.json"),
                    optax.adam(1e-3), out_dir="runs/a", checkpoint_every=100, resume=True)
  last = trainer.run(1000)          # trains until step 1000 in total
  held_out = trainer.evaluate()

``grad_sync`` may name any strategy of ``qsync_jax.sync`` (options in ``sync_options``): a
gradient hook (fp32, bf16, fp16, global_qsgd) runs in the hybrid step; a step builder
(selsync, qsdp) runs as ``qsync_jax.train.strategy_step.StrategyStep``, with the same data,
metrics, progress, checkpoints and evaluation (at its consolidated / gathered parameters).

``replan`` (a mode of ``qsync_jax.train.replan``, or a ``Replanner``) measures each group's
compute while the hybrid step trains and re-balances the per-device batches from the
measurements: the step is rebuilt once with the new split and training continues from the same
step on the same data; a group whose 8-bit legs are measured faster at 16 bits also gets them
lifted (``qsync_jax.train.probes.lifted_policy``). A re-plan whose measured step is not shorter
than the step before it is undone: the trainer switches back to the step that ran before.
``metrics.jsonl`` gets a ``replan`` line for every decision and a ``replan_measured`` line once
a re-planned split's step is measured (``"undone": true`` when it was undone), and the
checkpoint records the plan that runs and the decisions, so ``resume`` rebuilds the step that
ran.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import optax

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import CheckpointError, Interrupted, PlanError, PolicyError, QsyncError
from qsync_jax.models.flax_quant import quantize
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync import get_strategy, make_grad_sync
from qsync_jax.sync.two_level import check_two_level_sync
from qsync_jax.train.batching import batch_size as batch_size_of
from qsync_jax.train.batching import check_batch, put_replicated
from qsync_jax.train.checkpoint import CheckpointStore, signature
from qsync_jax.train.distributed import Watchdog
from qsync_jax.train.outputs import TensorBoardWriter, check_run_dir
from qsync_jax.train.replan import Replanner, describe, describe_measured, describe_undone
from qsync_jax.train.strategy_step import make_strategy_step
from qsync_jax.train.task import Task
from qsync_jax.train.train_step import SyncFn, check_optimizer_update, make_train_step

# The default of ``Trainer(progress=...)``: ``sys.stderr`` as it is when the trainer is made (a default
# bound at import would miss a later redirection, e.g. pytest's capture).
_STDERR: Any = object()


class Trainer:
  """Trains ``task`` on ``cluster`` under ``plan``; see ``make_train_step`` for the step.

  Args:
    task, cluster, plan, optimizer, devices, loss_scale: as ``make_train_step``
      (optimizer default ``optax.adam(1e-3)``).
    grad_sync: a ``SyncFn`` as ``make_train_step``, or the name of a ``qsync_jax.sync``
      strategy (gradient hook or step builder, see the module doc); None: the plan's ``sync``
      (fp32 without one). A name the plan's ``sync`` contradicts is refused (``Plan.sync_for``).
    sync_options: options of the named strategy (its ``Strategy.options``).
    seed: seeds the parameters, the step RNG and the data order.
    out_dir: where ``metrics.jsonl``, ``checkpoints/`` and ``tensorboard/`` (the metrics as TensorBoard
      scalars, when ``tensorboardX`` is installed) go (None: nothing is written). Process 0 writes.
    checkpoint_every: save every this many steps (0: only at the end of ``run``).
    resume: restore the latest checkpoint of ``out_dir`` if there is one.
    log_every: write metrics every this many steps.
    progress: stream for progress lines, default ``sys.stderr`` (the one in place when the trainer
      is made); None: silent.
    step_timeout_s: multi-process watchdog: end the process if a step takes longer (after the
      first, which compiles). Default 120 s when there are several processes, else off.
    donate: let each step reuse the previous state's buffers (default: on accelerators; hybrid
      step only, a step-builder strategy's step keeps its input).
    replan: ``"off"`` (default), ``"once"`` or ``"auto"``, or a ``Replanner``: re-balance the
      per-device batches from measured group speeds (hybrid step only; module doc).
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
    progress: TextIO | None = _STDERR,
    step_timeout_s: float | None = None,
    donate: bool | None = None,
    replan: str | Replanner = "off",
  ):
    if out_dir and jax.process_index() == 0:
      check_run_dir("out_dir", out_dir, resume)
    self.task, self.seed = task, int(seed)
    optimizer = optimizer if optimizer is not None else optax.adam(1e-3)
    if grad_sync is None or isinstance(grad_sync, str):  # the plan's sync, unless told another
      grad_sync = (plan or Plan()).sync_for(grad_sync)
    self.sync = _sync_meta(grad_sync, sync_options)
    check_optimizer_update(plan or Plan(), grad_sync)
    check_two_level_sync((plan or Plan()).reduction, grad_sync)
    sizes = (plan or Plan()).apply_to(cluster).device_batch_sizes()
    sample = next(iter(task.train_batches(sum(sizes), self.seed)))
    check_batch(sample, sizes, f"task {task.name!r}")
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
      self._build = functools.partial(
        make_train_step,
        task,
        cluster,
        optimizer=optimizer,
        grad_sync=grad_sync,
        devices=devices,
        loss_scale=loss_scale,
        donate=donate,
      )
      self.program = self._build(plan)
      self._given_cluster = cluster
      self._programs = {_step_key(self.program.cluster, self.program.plan): self.program}  # not rebuilt
    self.replanner = replan if isinstance(replan, Replanner) else Replanner(mode=replan)
    if self.replanner.mode != "off" and not hasattr(self, "_build"):
      raise QsyncError(
        f"replan={self.replanner.mode!r}: sync strategy {grad_sync!r} builds its own step, which cannot be "
        "re-balanced. Fix: use replan='off', or a gradient-hook strategy (fp32, bf16, fp16, global_qsgd)."
      )
    accumulating = sorted(g for g, k in (plan or Plan()).micro_steps.items() if k != 1)
    if self.replanner.mode != "off" and accumulating:
      raise QsyncError(
        f"replan={self.replanner.mode!r}: the plan accumulates gradients on {accumulating} (micro_steps), "
        "whose per-device batches re-planning would change. Fix: use replan='off', or remove micro_steps "
        "from the plan."
      )
    self._sample = sample
    self.out_dir = out_dir
    progress = sys.stderr if progress is _STDERR else progress
    self.checkpoint_every, self.log_every, self.progress = checkpoint_every, max(1, log_every), progress
    self.is_primary = jax.process_index() == 0
    self.tensorboard = (
      TensorBoardWriter(os.path.join(out_dir, "tensorboard")) if out_dir and self.is_primary else None
    )
    # XLA's CPU collectives can deadlock with two multi-device steps in flight on a small host
    # (seen on 2 cores: "Termination timeout for all reduce"); accelerators pipeline steps.
    self._one_step_in_flight = jax.default_backend() == "cpu" and jax.device_count() > 1
    self.checkpoints = (
      CheckpointStore(os.path.join(out_dir, "checkpoints"), keep_checkpoints) if out_dir else None
    )
    self.state = self.program.init(self.seed, sample)
    check_plan_matches_model(task, self.program.plan, self.program.variables_of(self.state), sample)
    self.data_position = 0
    self._batches = None
    self._eval_fn = None
    if step_timeout_s is None and jax.process_count() > 1:
      step_timeout_s = 120.0
    self.step_timeout_s = step_timeout_s
    if resume and not self.resume():
      raise CheckpointError(
        f"resume: out_dir {out_dir!r} holds no checkpoint. Fix: start without resume, or pass the run's directory."
      )

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
      "plan_fingerprint": self.program.plan.fingerprint(),  # optimizer_update left out: checkpoints
      # hold the optimizer state whole, so a run resumes another's whatever their optimizer_update
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
      self._meta(),
      step=self.step,
      data_position=self.data_position,
      plan=self.program.plan.to_json(),
      replans=self.replanner.history,
    )
    self.checkpoints.save(self.step, self.program.full_state(self.state), self.params, meta)

  def resume(self, step: int | None = None) -> bool:
    """Restores checkpoint ``step`` (default: latest); False if there is none. The trainer
    changes only once the checkpoint has passed every check."""
    if self.checkpoints is None or (step is None and self.checkpoints.latest_step() is None):
      return False
    _, saved = self.checkpoints.read_meta(step)
    like = self.program.full_state(self.state)
    if saved.get("replans") and hasattr(self, "_build"):  # a re-planned run: rebuild its step
      plan = Plan.from_json(saved["plan"])
      plan = dataclasses.replace(plan, optimizer_update=self.program.plan.optimizer_update)
      if plan.fingerprint() != self.program.plan.fingerprint():
        self.program = self._program_for(plan)
      self.replanner.restore(saved["replans"])
    state, meta = self.checkpoints.restore(like, self._meta(), step)
    state = self.program.from_full_state(state)
    self.state, self.data_position, self._batches = state, int(meta["data_position"]), None
    if self.out_dir and self.is_primary:
      _drop_metrics_after(os.path.join(self.out_dir, "metrics.jsonl"), self.step)
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
    and at the end.

    Ctrl-C (SIGINT, in the main thread) stops the run between two steps: it logs and, in a
    one-process run with ``out_dir``, checkpoints the last finished step, then raises
    ``Interrupted`` naming that step. A second Ctrl-C stops at once (``KeyboardInterrupt``).
    """
    start_step = step = self.step
    last: dict[str, float] = {}
    watchdog = None
    pending = None  # metrics of the previous step, read after the next one is dispatched
    timing = _StepTimer()  # the replanner's step times, when it wants them
    clock = _Clock(start_step)
    if step < steps:
      self._say(
        f"compiling the step ({self.program.cluster.num_devices} devices, global batch {self.global_batch})…"
      )
    stop = _StopOnSigint()
    try:
      with stop:
        while step < steps and not stop.requested:
          self.state, metrics = self.program(self.state, self._next_batch())
          if self._one_step_in_flight or step == start_step:
            jax.block_until_ready(metrics)
          step += 1
          step_ms = None
          if self.replanner.times_steps():
            step_ms = timing.after(metrics)
          wants = self.replanner.wants_measurement(step, start_step, step_ms)
          if self._note_measured_replans():  # a re-plan undone: the split before it runs again
            timing.reset()
          if wants:
            if pending is not None:
              last, pending = self._log(*pending, steps, clock, callback), None
            self._replan(step)
            timing.reset()  # the next interval would hold the measurement (and a compile)
          if step == start_step + 1:
            self._say(f"compiled and ran the first step in {clock.first_step_done(step):.1f} s")
          if pending is not None:
            last = self._log(*pending, steps, clock, callback)
          pending = (step, metrics) if step % self.log_every == 0 or step == steps else None
          if watchdog is not None:
            watchdog.beat()
          if self.checkpoint_every and step % self.checkpoint_every == 0:
            if pending is not None:
              last, pending = self._log(*pending, steps, clock, callback), None
            self.save()
            if watchdog is not None:
              watchdog.beat()
          if watchdog is None and self.step_timeout_s:  # after the first step, which compiles
            jax.block_until_ready(self.program.step_count(self.state))
            watchdog = Watchdog(self.step_timeout_s).start()
      if pending is not None:
        last = self._log(*pending, steps, clock, callback)
      saves = self.checkpoints is not None and (not stop.requested or jax.process_count() == 1)
      if saves and self.step > 0 and self.checkpoints.latest_step() != self.step:
        self.save()
    finally:
      if watchdog is not None:
        watchdog.stop()
    if stop.requested:
      saved = self.checkpoints.latest_step() if self.checkpoints is not None else None
      raise Interrupted(
        f"interrupted at step {self.step}"
        + (
          f"; checkpoint {saved} is in {self.checkpoints.directory}"
          if saved is not None
          else "; nothing saved"
        )
      )
    return last

  def _replan(self, step: int) -> None:
    """Measures the groups and decides (``Replanner.replan``), logs the decision and, when the
    split changes, switches to the step of the new split (built once per split; the state
    carries over as it is on the same devices — the replanner drops no group —, else through
    its full form)."""
    batches, record = self.replanner.replan(step, self.program, self.state, self._sample)
    if record is not None:
      self._say("replan: " + describe(record))
      self._write_replan_line({"step": step, "replan": record}, record)
    if batches is not None:
      self._switch_to(batches, {g: lift["new"] for g, lift in record.get("lifted", {}).items()})

  def _switch_to(self, batches: Mapping[str, int], policies: Mapping[str, Any]) -> None:
    """Runs the step of the per-device ``batches`` and the groups' ``policies`` (JSON; the
    other groups' stay) from the next step on (the state carries over as it is on the same
    devices, else through its full form)."""
    plan = self.program.plan
    plan = dataclasses.replace(
      plan,
      batch_per_device={**plan.batch_per_device, **batches},
      policies={**plan.policies, **{g: PrecisionPolicy.from_json(p) for g, p in policies.items()}},
    )
    program = self._program_for(plan)
    if program.mesh.devices.tolist() != self.program.mesh.devices.tolist():
      self.state = program.from_full_state(self.program.full_state(self.state))
    self.program = program

  def _note_measured_replans(self) -> bool:
    """Logs the measured step of each re-planned split once the replanner has timed it, and
    switches back to the split before a re-plan the replanner undid; True when it did."""
    undone = False
    for note in self.replanner.take_notes():
      self._say("replan: " + (describe_undone(note) if note.get("undone") else describe_measured(note)))
      measured = {k: v for k, v in note.items() if k != "step"}
      self._write_replan_line({"step": note["step"], "replan_measured": measured}, measured)
      if note.get("undone"):
        self._switch_to(note["restored"], note.get("restored_policies", {}))
        undone = True
    return undone

  def _write_replan_line(self, line: Mapping[str, Any], scalars: Mapping[str, Any]) -> None:
    if self.out_dir and self.is_primary:
      os.makedirs(self.out_dir, exist_ok=True)
      with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
      self.tensorboard.write(line["step"], scalars, prefix="replan/")

  def _program_for(self, plan: Plan):
    """The hybrid step of ``plan`` (the batch split and policies of a plan run before: its step
    again)."""
    key = _step_key(plan.apply_to(self._given_cluster), plan)
    if key not in self._programs:
      self._programs[key] = self._build(plan)
    return self._programs[key]

  def _say(self, msg: str) -> None:
    if self.progress is not None and self.is_primary:
      print(msg, file=self.progress, flush=True)

  def _log(self, step, metrics, steps, clock, callback) -> dict[str, float]:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # one transfer
    rate = clock.steps_per_s(step)
    record = {"step": step, **values, "steps_per_s": rate, "samples_per_s": rate * self.global_batch}
    record["time_s"] = clock.elapsed()
    if self.out_dir and self.is_primary:
      os.makedirs(self.out_dir, exist_ok=True)
      with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
      self.tensorboard.write(step, record)
    eta = f"ETA {(steps - step) / rate:.0f}s" if rate > 0 else "ETA after the next step"
    self._say(
      f"step {step}/{steps}  loss {values['loss']:.4f}  {rate * self.global_batch:.1f} samples/s  "
      f"{rate:.2f} steps/s  {eta}"
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
    if self.tensorboard is not None:
      self.tensorboard.close()
    if self.checkpoints is not None:
      self.checkpoints.close()


def check_plan_matches_model(task: Task, plan: Plan, variables, batch) -> None:
  """Raises ``PlanError`` if a rule of a group's policy matches none of the model's ops (traced
  abstractly on ``batch`` in training mode; nothing runs)."""
  if not any(p.rules for p in plan.policies.values()):
    return
  kwargs = {**task.train_kwargs, **({"mutable": list(task.mutable)} if task.mutable else {})}
  kwargs["rngs"] = {name: jax.random.key(0) for name in task.rng_streams}
  ops = quantize(task.model, PrecisionPolicy()).ops(jax.device_get(variables), *task.inputs(batch), **kwargs)
  for group, policy in sorted(plan.policies.items()):
    try:
      policy.check_rules_match(ops, f"plan: group {group!r}")
    except PolicyError as e:
      raise PlanError(str(e)) from None


def _drop_metrics_after(path: str, step: int) -> None:
  """Removes the lines of metrics file ``path`` logged after ``step`` (the steps a resumed run
  will log again) and a line a kill cut short, atomically; keeps other lines it cannot parse."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()

  def keep(line: str) -> bool:
    try:
      return int(json.loads(line)["step"]) <= step
    except (ValueError, KeyError, TypeError):
      return True

  kept = [line for line in lines if line.endswith("\n") and keep(line)]
  if len(kept) != len(lines):
    with open(f"{path}.tmp", "w") as f:
      f.writelines(kept)
    os.replace(f"{path}.tmp", path)


def _step_key(cluster: ClusterSpec, plan: Plan) -> tuple:
  """What tells two hybrid steps of one trainer apart: each group's per-device batch and
  policy."""
  return tuple(
    (g.name, g.batch_per_device, json.dumps(plan.policy_for(g.name).to_json(), sort_keys=True))
    for g in cluster.groups
  )


class _StepTimer:
  """Step times without a host sync of the step just dispatched: ``after(metrics)`` waits for
  the previous step's metrics (the device has this step queued meanwhile) and returns the
  wall time between the previous two completions (None until there are two)."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self._previous, self._done = None, None

  def after(self, metrics) -> float | None:
    if self._previous is None:
      self._previous = metrics
      return None
    jax.block_until_ready(self._previous)
    now = time.perf_counter()
    ms = None if self._done is None else 1e3 * (now - self._done)
    self._previous, self._done = metrics, now
    return ms


class _Clock:
  """Throughput of a run, measured from the end of its first (compiling) step."""

  def __init__(self, start_step: int):
    self.t0 = time.perf_counter()
    self.t_first, self.first = None, start_step + 1

  def first_step_done(self, step: int) -> float:
    """Seconds the first step took (compilation included); the rate counts from here."""
    self.t_first, self.first = time.perf_counter(), step
    return self.t_first - self.t0

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def steps_per_s(self, step: int) -> float:
    """Steps per second since the first step (0.0 until a second one has finished)."""
    if self.t_first is None or step <= self.first:
      return 0.0
    return (step - self.first) / (time.perf_counter() - self.t_first)


class _StopOnSigint:
  """Within ``with``: the first SIGINT sets ``requested`` (the loop stops between two steps), a
  second raises ``KeyboardInterrupt``. Does nothing outside the main thread."""

  def __init__(self):
    self.requested, self._previous = False, None

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
      self._previous = None


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
