"""The hybrid synchronous data-parallel trainer: state, data feeding, metrics, checkpoints.

``Trainer`` wraps the compiled step of ``qsync_jax.train.train_step`` and owns what lives between
steps: the ``TrainState``, the training data iterator and its position, the metrics log
(``metrics.jsonl``, and the same numbers as TensorBoard events in ``tensorboard/``, tagged
``train/``, ``eval/`` and ``replan/``), progress on stderr and checkpoints (``checkpoints/``) in
``out_dir``.

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
lifted (``qsync_jax.train.replan.lifted_policy``). A re-plan whose measured step is not shorter
than the step before it is undone: the trainer switches back to the step that ran before.
``metrics.jsonl`` gets a ``replan`` line for every decision and a ``replan_measured`` line once
a re-planned split's step is measured (``"undone": true`` when it was undone), and the
checkpoint records the plan that runs and the decisions, so ``resume`` rebuilds the step that
ran.

``run`` is a loop over step hooks (``qsync_jax.train.run_hooks``): after each step, the finite-loss
check, re-planning, logging, evaluation (``eval_every``), checkpoints and the watchdog, in that
order.

Nothing is lost: ``out_dir`` is held for the run (``qsync_jax.train.outputs.lock_run_dir``: another
run into it is refused, naming its process); a checkpoint that cannot be written is said in one
line, training goes on and the next interval tries again (a failure at the end raises, naming the
last checkpoint written); a step whose loss is not finite stops the run (``NonFiniteLossError``)
without checkpointing a non-finite state. The rates it prints and logs (steps, samples
and tokens per second, TFLOP/s per device, MFU, the ETA) are over the last steps of training,
pauses left out (``qsync_jax.train.progress``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import optax

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import (
  CheckpointError,
  Interrupted,
  NonFiniteLossError,
  PlanError,
  PolicyError,
  QsyncError,
)
from qsync_jax.models.flax_quant import quantize
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.sync import get_strategy
from qsync_jax.train.batching import batch_size as batch_size_of
from qsync_jax.train.batching import check_batch, put_replicated
from qsync_jax.train.checkpoint import CheckpointStore, check_meta, signature
from qsync_jax.train.outputs import check_run_dir, lock_run_dir
from qsync_jax.train.progress import peak_tflops, step_flops
from qsync_jax.train.replan import ReplanEvent, Replanner, trainer_replanner
from qsync_jax.train.run_hooks import (
  CheckpointHook,
  EvalHook,
  FiniteLossHook,
  LogHook,
  ReplanHook,
  RunState,
  StopOnSigint,
  WatchdogHook,
)
from qsync_jax.train.run_log import RunLog
from qsync_jax.train.strategy_step import make_strategy_step
from qsync_jax.train.task import Task
from qsync_jax.train.train_step import SyncFn, make_train_step

# The default of ``Trainer(progress=...)``: ``sys.stderr`` as it is when the trainer is made (a default
# bound at import would miss a later redirection, e.g. pytest's capture).
_STDERR: Any = object()


class Trainer:
  """Trains ``task`` on ``cluster`` under ``plan``; see ``make_train_step`` for the step.

  Args:
    task, cluster, plan, optimizer, devices, loss_scale: as ``make_train_step``
      (optimizer default ``optax.adam(1e-3)``; warmup and decay schedules, weight decay:
      ``qsync_jax.train.optimizers.make_optimizer``, whose scheduled rate is logged as ``lr``).
    grad_sync: a ``SyncFn`` as ``make_train_step``, or the name of a ``qsync_jax.sync``
      strategy (gradient hook or step builder, see the module doc); None: the plan's ``sync``
      (fp32 without one). A name the plan's ``sync`` contradicts is refused (``Plan.sync_for``).
    sync_options: options of the named strategy (its ``Strategy.options``).
    seed: seeds the parameters, the step RNG and the data order.
    out_dir: where ``metrics.jsonl``, ``checkpoints/`` and ``tensorboard/`` (the metrics as TensorBoard
      scalars) go (None: nothing is written). Process 0 writes.
    checkpoint_every: save every this many steps (0: only at the end of ``run``).
    resume: restore the latest checkpoint of ``out_dir`` if there is one.
    log_every: write metrics every this many steps.
    progress: stream for progress lines, default ``sys.stderr`` (the one in place when the trainer
      is made); None: silent.
    step_timeout_s: watchdog: end the process if a step takes longer (after the first, which
      compiles). Default 120 s when there are several processes, else off (None or 0).
    donate: let each step reuse the previous state's buffers (default: on accelerators; hybrid
      step only, a step-builder strategy's step keeps its input).
    replan: ``"off"``, ``"once"`` or ``"auto"``, or a ``Replanner``: re-balance the per-device
      batches from measured group speeds (hybrid step only; module doc). Default (None):
      ``default_replan``, ``"once"`` where re-planning can change something, else ``"off"``. A pool
      of one device group has nothing to balance: it never measures, whatever the mode.
    clip_norm: clip the combined gradient to this global L2 norm before the optimizer (None: off;
      ``make_train_step``; the metric ``grad_norm`` is its norm before clipping). Hybrid step only.
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
    replan: str | Replanner | None = None,
    clip_norm: float | None = None,
  ):
    _check_run_settings(checkpoint_every, step_timeout_s)
    if out_dir and jax.process_index() == 0:
      check_run_dir("out_dir", out_dir, resume, api=True)
    self.task, self.seed = task, int(seed)
    optimizer = optimizer if optimizer is not None else optax.adam(1e-3)
    if grad_sync is None or isinstance(grad_sync, str):  # the plan's sync, unless told another
      grad_sync = (plan or Plan()).sync_for(grad_sync)
    self.sync = _sync_meta(grad_sync, sync_options)
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
        task, cluster, plan, optimizer, grad_sync, sync_options, sample, devices=devices, clip_norm=clip_norm
      )
    else:
      self._build = functools.partial(
        make_train_step,
        task,
        cluster,
        optimizer=optimizer,
        grad_sync=grad_sync,
        sync_options=sync_options,
        devices=devices,
        loss_scale=loss_scale,
        donate=donate,
        clip_norm=clip_norm,
      )
      self.program = self._build(plan)
      self._given_cluster = cluster
      self._programs = {_step_key(self.program.cluster, self.program.plan): self.program}  # not rebuilt
    self.replanner = trainer_replanner(replan, self.program, grad_sync)
    self._sample = sample
    self.out_dir = out_dir
    progress = sys.stderr if progress is _STDERR else progress
    self.checkpoint_every, self.log_every, self.progress = checkpoint_every, max(1, log_every), progress
    self.is_primary = jax.process_index() == 0
    self.log = RunLog(out_dir, self.is_primary, self.say)
    self.tensorboard = self.log.tensorboard
    # XLA's CPU collectives can deadlock with two multi-device steps in flight on a small host
    # (seen on 2 cores: "Termination timeout for all reduce"); accelerators pipeline steps.
    self._one_step_in_flight = jax.default_backend() == "cpu" and jax.device_count() > 1
    self.checkpoints = (
      CheckpointStore(os.path.join(out_dir, "checkpoints"), keep_checkpoints) if out_dir else None
    )
    if resume and self.checkpoints is not None and self.checkpoints.latest_step() is not None:
      self._check_resumable()  # before the state is built: a mismatch is named in seconds
    self.state = self.program.init(self.seed, sample)
    check_plan_matches_model(task, self.program.plan, self.program.variables_of(self.state), sample)
    self.data_position = 0
    self._step_flops: dict[int, float | None] = {}  # id(program) -> FLOPs per device, once it ran
    self._batches = None
    self._eval_fn = None
    self.last_eval: tuple[int, dict[str, float]] | None = None  # (step, held-out metrics)
    if step_timeout_s is None and jax.process_count() > 1:
      step_timeout_s = 120.0
    self.step_timeout_s = step_timeout_s
    self.run_settings: dict[str, Any] = {}  # what checkpoints record of how the run was asked for
    self._resumed_settings: dict[str, Any] | None = None
    if resume and not self.resume():
      raise CheckpointError(
        f"resume: out_dir {out_dir!r} holds no checkpoint. Fix: start without resume, or pass the run's directory."
      )
    self._lock = lock_run_dir("out_dir", out_dir) if out_dir and self.is_primary else None
    if self._lock is not None and self._lock.note:
      self.say(self._lock.note)
      self._lock.note = None

  # -- properties -------------------------------------------------------------------------
  @property
  def global_batch(self) -> int:
    return self.program.global_batch

  @property
  def step(self) -> int:
    return int(self.program.step_count(self.state))

  @property
  def sample(self):
    """One global batch of the task (host arrays), the first: what re-planning's probes run on."""
    return self._sample

  @property
  def peak_tflops(self) -> tuple[str, float] | None:
    """``(device type, dense 16-bit peak TFLOP/s)`` of the run's devices (MFU's denominator)."""
    return peak_tflops(list(self.program.mesh.devices.flat))

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
  def _meta(self, with_params: bool = True) -> dict[str, Any]:
    """What a checkpoint must match to be resumed (``with_params=False``: before the state exists)."""
    return {
      "task": self.task.name,
      **({"params": signature(jax.eval_shape(self.program.params_of, self.state))} if with_params else {}),
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
      replan_decided=self.replanner.decided_step,
      run_settings=self.run_settings,
    )
    self.checkpoints.save(self.step, self.program.full_state(self.state), self.params, meta)

  def _check_resumable(self) -> None:
    """``CheckpointError`` where the latest checkpoint has another task, plan, cluster, seed or
    sync than this trainer (``resume`` checks the rest, once the state exists; the plan and the
    cluster's batches of a re-planned run once it has rebuilt that plan's step)."""
    step, saved = self.checkpoints.read_meta()
    expected = self._meta(with_params=False)
    if saved.get("replans") and hasattr(self, "_build"):
      # resume first rebuilds the step of the plan the run re-planned to (its batches), then checks these
      del expected["plan_fingerprint"], expected["cluster"]
    check_meta(f"checkpoint {step} in {self.checkpoints.directory}", saved, expected)

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
    self.replanner.restore(saved.get("replans", []), saved.get("replan_decided"))
    state, meta = self.checkpoints.restore(like, self._meta(), step)
    self._resumed_settings = meta.get("run_settings")
    state = self.program.from_full_state(state)
    self.state, self.data_position, self._batches = state, int(meta["data_position"]), None
    self.log.drop_after(self.step)
    return True

  # -- training -----------------------------------------------------------------------------
  def train_step(self) -> dict[str, float]:
    """One step; returns its metrics (host floats)."""
    self.state, metrics = self.program(self.state, self._next_batch())
    return {k: float(v) for k, v in metrics.items()}

  def run(
    self,
    steps: int,
    callback: Callable[[int, dict[str, float]], None] | None = None,
    *,
    eval_every: int = 0,
  ) -> dict[str, float]:
    """Trains until ``steps`` steps in total have run (a resumed run continues); returns the
    last metrics. Logs every ``log_every`` steps, evaluates every ``eval_every`` steps
    (``evaluate_and_log``; 0: never), checkpoints every ``checkpoint_every`` steps and at the end.

    Ctrl-C (SIGINT, in the main thread) stops the run between two steps: it logs and, in a
    one-process run with ``out_dir``, checkpoints the last finished step, then raises
    ``Interrupted`` naming that step. A second Ctrl-C stops at once (``KeyboardInterrupt``).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < self.step:
      now = f"at step {self.step} already (a resumed run)" if self.step else "at step 0"
      raise QsyncError(
        f"run(steps={steps!r}): steps is the total number of steps to train until, and this trainer is {now}. "
        f"Fix: pass an int of at least {self.step}, e.g. run({self.step + 100}) for 100 more steps."
      )
    run = RunState(steps, self.step, self.step, callback)
    stop = StopOnSigint()
    if eval_every and self.task.eval_batches is None:
      raise QsyncError(
        f"eval_every={eval_every}: task {self.task.name!r} has no held-out set (eval_batches). Fix: pass "
        "eval_every=0, or give the task eval_batches."
      )
    log, watchdog = LogHook(self), WatchdogHook(self, self.step_timeout_s)
    hooks = (
      FiniteLossHook(),
      log,
      EvalHook(self, log, eval_every),
      CheckpointHook(self, log, stop),
      watchdog,
    )
    if self.replanner.mode != "off" and len(self.program.cluster.groups) > 1:
      hooks = (hooks[0], ReplanHook(self, log), *hooks[1:])
    elif self.replanner.mode != "off" and run.step < steps:
      self.say(f"replan={self.replanner.mode}: one device group, nothing to balance: nothing is measured")
    if run.step < steps:
      self.say(
        f"compiling the step ({_count(self.program.cluster.num_devices, 'device')}, global batch "
        f"{self.global_batch})…"
      )
    try:
      with stop:
        while run.step < steps and not stop.requested and run.diverged is None:
          program, batch = self.program, self._next_batch()
          run.throughput.batch_ready()
          self.state, run.metrics = program(self.state, batch)
          compiled = id(program) not in self._step_flops or run.step == run.start_step
          if self._one_step_in_flight or compiled:
            jax.block_until_ready(run.metrics)
          run.step += 1
          if compiled:  # the step compiled (or is a run's first): the rate counts from here
            if id(program) not in self._step_flops:
              self._step_flops[id(program)] = step_flops(program, self.state, batch)
            run.throughput.restart(run.step)
          run.flops = self._step_flops[id(program)]
          for hook in hooks:
            hook.after_step(run)
            if run.diverged is not None:
              break
        for hook in hooks:
          hook.finish(run)
    finally:
      watchdog.close()
    if run.diverged is not None:
      raise NonFiniteLossError(self._diverged_message(*run.diverged))
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
    return run.last

  def _diverged_message(self, step: int, what: str) -> str:
    saved = self.checkpoints.latest_step() if self.checkpoints is not None else None
    if saved is not None:
      kept = f"the last checkpoint, all finite, is step {saved} in {self.checkpoints.directory}"
    else:
      kept = "no checkpoint was written" if self.checkpoints is not None else "nothing is saved (no out_dir)"
    return (
      f"training diverged at step {step}: {what}. The run stopped; {kept}. Fix: lower the learning rate "
      "(--lr) or check the model and data at that step, then start again (or --resume from that checkpoint)."
    )

  def state_is_finite(self) -> bool:
    """Whether every floating-point number of the training state (parameters, optimizer state…) is
    finite."""
    return bool(_all_finite(self.state))

  def set_run_settings(self, settings: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Records ``settings`` (JSON values: how the run was asked for, e.g. the command line's
    optimizer flags) in the checkpoints from now on; returns ``{name: (checkpoint's value, new
    value)}`` for those that differ from the resumed checkpoint's (none for a new run)."""
    self.run_settings = json.loads(json.dumps(dict(settings)))
    before = self._resumed_settings or {}
    return {k: (before[k], v) for k, v in self.run_settings.items() if k in before and before[k] != v}

  def apply_replan(self, event: ReplanEvent) -> None:
    """Logs a re-planning ``event`` (its line, its record in ``metrics.jsonl`` and as ``replan/``
    scalars) and, when it says so, switches to its split from the next step."""
    self.say(event.line)
    self.log.write({"step": event.step, event.key: event.record}, event.record, prefix="replan/")
    if event.switch_to is not None:
      self._switch_to(*event.switch_to)

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

  def _program_for(self, plan: Plan):
    """The hybrid step of ``plan`` (the batch split and policies of a plan run before: its step
    again)."""
    key = _step_key(plan.apply_to(self._given_cluster), plan)
    if key not in self._programs:
      self._programs[key] = self._build(plan)
    return self._programs[key]

  def say(self, msg: str) -> None:
    """Prints ``msg`` to the progress stream (process 0; nothing when ``progress`` is None)."""
    if self.progress is not None and self.is_primary:
      try:
        print(msg, file=self.progress, flush=True)
      except OSError:  # the stream is gone (a terminal closed with SIGHUP): training goes on silently
        self.progress = None

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

  def evaluate_and_log(self, batch_size: int = 256) -> dict[str, float]:
    """``evaluate()`` at the current step (again only if the step moved on since the last), logged:
    a ``{"step", "eval": {...}}`` line in ``metrics.jsonl``, ``eval/`` scalars and a progress line."""
    if self.last_eval is not None and self.last_eval[0] == self.step:
      return self.last_eval[1]
    metrics = self.evaluate(batch_size)
    self.last_eval = (self.step, metrics)
    if metrics:
      self.log.write({"step": self.step, "eval": metrics}, metrics, prefix="eval/")
      self.say(f"eval at step {self.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics

  def close(self) -> None:
    self.log.close()
    if getattr(self, "_lock", None) is not None:
      self._lock.release()
      self._lock = None
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


def _check_run_settings(checkpoint_every, step_timeout_s) -> None:
  """``Trainer``'s numeric settings, checked before any work."""
  if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
    raise QsyncError(
      f"checkpoint_every={checkpoint_every!r} must be 0 (a checkpoint at the end only) or a number of steps. "
      "Fix: pass e.g. checkpoint_every=100 (--checkpoint-every 100)."
    )
  if step_timeout_s is not None and not step_timeout_s >= 0:
    raise QsyncError(
      f"step_timeout_s={step_timeout_s!r} must be a number of seconds (0: no watchdog). Fix: pass e.g. "
      "step_timeout_s=600 (--step-timeout 600), or leave it unset."
    )


def _count(n: int, noun: str) -> str:
  """``"1 device"``, ``"4 devices"``."""
  return f"{n} {noun}{'' if n == 1 else 's'}"


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
  return jax.numpy.all(jax.numpy.asarray([jax.numpy.all(jax.numpy.isfinite(x)) for x in leaves]))


def _step_key(cluster: ClusterSpec, plan: Plan) -> tuple:
  """What tells two hybrid steps of one trainer apart: each group's per-device batch and
  policy."""
  return tuple(
    (g.name, g.batch_per_device, json.dumps(plan.policy_for(g.name).to_json(), sort_keys=True))
    for g in cluster.groups
  )


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
