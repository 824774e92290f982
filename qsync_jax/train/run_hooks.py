"""What ``Trainer.run`` does between two steps, one hook per concern: the finite-loss check,
re-planning, logging, evaluation, checkpoints, the watchdog. ``Trainer.run`` dispatches a step,
then calls each hook's ``after_step(run)`` in that order (none after one that found the run
diverged); at the end of the run, each hook's ``finish(run)``.

``RunState`` is what the hooks share: the step just dispatched and its (device) metrics, the last
logged metrics, the run's ``Throughput`` and ``beat`` (the watchdog's). A hook that pauses
training (measures, saves, evaluates) first has the log write the metrics it holds back
(``LogHook.flush``), so ``metrics.jsonl`` stays in step order, then works inside
``RunState.paused()``: the pause is left out of the rate and the watchdog beats before and after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from qsync_jax.errors import CheckpointError
from qsync_jax.train.checkpoint import CheckpointWriteError
from qsync_jax.train.distributed import Watchdog
from qsync_jax.train.progress import Throughput, legend, progress_line, rates
from qsync_jax.train.replan import StepTimer


@dataclasses.dataclass
class RunState:
  """One ``Trainer.run``: the target ``steps``, the step it started from, the ``step`` just
  dispatched and its ``metrics`` (device arrays), the ``last`` metrics logged (host floats), the
  user's ``callback(step, metrics)``, ``flops``: the running step's FLOPs per device (None: unknown),
  ``diverged``: ``(step, what is not finite)`` once the run diverged (it stops)."""

  steps: int
  start_step: int
  step: int
  callback: Callable[[int, dict[str, float]], None] | None = None
  metrics: Any = None
  last: dict[str, float] = dataclasses.field(default_factory=dict)
  beat: Callable[[], None] = lambda: None
  throughput: Throughput = dataclasses.field(default_factory=Throughput)
  flops: float | None = None
  diverged: tuple[int, str] | None = None

  @contextlib.contextmanager
  def paused(self):
    """Training pauses within: the step in flight finishes first, and nothing from here until
    the next step's batch is ready counts toward the rate; the watchdog beats around it."""
    if self.metrics is not None:
      jax.block_until_ready(self.metrics)
    self.throughput.stop()
    self.beat()
    try:
      yield
    finally:
      self.beat()
      self.throughput.restart(self.step)


class FiniteLossHook:
  """Stops the run at the first step whose loss is not finite, unless dynamic loss scaling skipped
  that step (its ``skipped`` metric; the state stayed as it was). Reads each step's loss one step
  late, while the next step runs (as the log does at ``log_every=1``)."""

  def __init__(self):
    self.previous = None  # (step, device metrics) of the step before the one just dispatched

  def after_step(self, run: RunState) -> None:
    previous, self.previous = self.previous, (run.step, run.metrics)
    if previous is not None:
      self._check(run, *previous)

  def finish(self, run: RunState) -> None:
    if self.previous is not None and run.diverged is None:
      self._check(run, *self.previous)

  @staticmethod
  def _check(run: RunState, step: int, metrics) -> None:
    read = jax.device_get({k: metrics[k] for k in ("loss", "skipped") if k in metrics})
    loss = float(read["loss"])
    if not math.isfinite(loss) and not float(read.get("skipped", 0.0)):
      run.diverged = (step, f"the loss is {loss}")


class ReplanHook:
  """Times the steps the trainer's ``Replanner`` wants timed, hands it each step
  (``Replanner.observe``) and, when it asks, has it measure and decide (``replan_event``); the
  trainer applies every event (``Trainer.apply_replan``: log line, record, switch)."""

  def __init__(self, trainer, log: LogHook):
    self.trainer, self.log = trainer, log
    self.timer = StepTimer()

  def after_step(self, run: RunState) -> None:
    trainer, replanner = self.trainer, self.trainer.replanner
    step_ms = self.timer.after(run.metrics) if replanner.times_steps() else None
    wants, events = replanner.observe(run.step, run.start_step, step_ms)
    for event in events:
      trainer.apply_replan(event)
    if any(event.switch_to is not None for event in events):
      self.timer.reset()  # a re-plan undone: the split before it runs again
    if wants:
      self.log.flush(run)
      with run.paused():
        event = replanner.replan_event(run.step, trainer.program, trainer.state, trainer.sample)
      if event is not None:
        trainer.apply_replan(event)
      self.timer.reset()  # the next interval would hold the measurement (and a compile)

  def finish(self, run: RunState) -> None:
    pass


class LogHook:
  """Every ``log_every`` steps (and the last): the step's metrics to ``metrics.jsonl``, TensorBoard,
  the progress stream and the callback — read one step late, so that reading them never waits for
  the step just dispatched."""

  def __init__(self, trainer):
    self.trainer = trainer
    self.pending = None  # (step, device metrics), written after the next step is dispatched
    self.t0 = time.perf_counter()
    self.explained = False  # the legend of the rates is printed once, with the first rate

  def after_step(self, run: RunState) -> None:
    if run.step == run.start_step + 1:
      self.trainer.say(f"compiled and ran the first step in {time.perf_counter() - self.t0:.1f} s")
    self.flush(run)
    if run.step % self.trainer.log_every == 0 or run.step == run.steps:
      self.pending = (run.step, run.metrics)

  def flush(self, run: RunState) -> None:
    """Writes the metrics held back, if any."""
    if self.pending is not None:
      step, metrics = self.pending
      self.pending = None
      run.last = self.write(run, step, metrics)

  def finish(self, run: RunState) -> None:
    self.flush(run)

  def write(self, run: RunState, step: int, metrics) -> dict[str, float]:
    trainer = self.trainer
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # one transfer
    if step < run.step:  # read one step late, as the rate's marks are (not early, before a pause)
      run.throughput.mark(step)
    peak = trainer.peak_tflops
    fields = rates(
      run.throughput.steps_per_s(), trainer.global_batch, trainer.task.tokens_per_example, run.flops, peak
    )
    record = {"step": step, **values, **fields, "time_s": time.perf_counter() - self.t0}
    trainer.log.write(record, prefix="train/")
    if fields["steps_per_s"] and not self.explained:
      trainer.say(legend(run.flops, peak))
      self.explained = True
    trainer.say(progress_line(step, run.steps, values, record))
    if run.callback is not None:
      run.callback(step, values)
    return values


class EvalHook:
  """Every ``every`` steps: the held-out metrics at that step (``Trainer.evaluate_and_log``), a
  pause of training."""

  def __init__(self, trainer, log: LogHook, every: int):
    self.trainer, self.log, self.every = trainer, log, every

  def after_step(self, run: RunState) -> None:
    if self.every and run.step % self.every == 0:
      self.log.flush(run)
      with run.paused():
        self.trainer.evaluate_and_log()

  def finish(self, run: RunState) -> None:
    pass


class WatchdogHook:
  """Multi-process: ends the process when a step (after the first, which compiles) takes longer
  than ``timeout_s`` (``distributed.Watchdog``); off when ``timeout_s`` is None or 0."""

  def __init__(self, trainer, timeout_s: float | None):
    self.trainer, self.timeout_s = trainer, timeout_s
    self.watchdog: Watchdog | None = None

  def after_step(self, run: RunState) -> None:
    if self.watchdog is not None:
      self.watchdog.beat()
    elif self.timeout_s:  # after the first step, which compiles
      jax.block_until_ready(self.trainer.program.step_count(self.trainer.state))
      self.watchdog = Watchdog(self.timeout_s).start()
      run.beat = self.watchdog.beat

  def finish(self, run: RunState) -> None:
    pass

  def close(self) -> None:
    if self.watchdog is not None:
      self.watchdog.stop()


class CheckpointHook:
  """Every ``checkpoint_every`` steps, and at the end of the run (unless a multi-process run was
  interrupted: its peers may not reach the collective save), checkpoints the state — never a state
  whose parameters or optimizer state are not finite (the run stops there as diverged).

  A checkpoint that cannot be written (``CheckpointWriteError``: a full disk…) is one line on the
  progress stream; training goes on with the state in memory and the next interval tries again. A
  failed save at the end raises ``CheckpointError`` naming the last checkpoint written."""

  def __init__(self, trainer, log: LogHook, stop: StopOnSigint):
    self.trainer, self.log, self.stop = trainer, log, stop

  def after_step(self, run: RunState) -> None:
    every = self.trainer.checkpoint_every
    if every and run.step % every == 0:
      self.log.flush(run)
      with run.paused():
        if not self.trainer.state_is_finite():
          run.diverged = (run.step, "the parameters or optimizer state it left are not finite")
          return
        self._save(run)

  def finish(self, run: RunState) -> None:
    trainer = self.trainer
    saves = trainer.checkpoints is not None and (not self.stop.requested or jax.process_count() == 1)
    if not saves or trainer.step == 0 or trainer.checkpoints.latest_step() == trainer.step:
      return
    if run.diverged is not None and not trainer.state_is_finite():
      return  # the last finite state is the last checkpoint
    if not self._save(run):
      last = trainer.checkpoints.latest_step()
      raise CheckpointError(
        f"the run's last checkpoint, at step {trainer.step}, could not be written in "
        f"{trainer.checkpoints.directory}: {self.failure}. The last checkpoint written is "
        + (f"step {last}" if last is not None else "none")
        + f"; the steps after it are lost when this process ends (a Python Trainer still holds step "
        f"{trainer.step}: call save() again). Fix: free space in (or make writable) that directory, then "
        "run again with --resume."
      )

  def _save(self, run: RunState) -> bool:
    """Saves; False, with one line said, when the checkpoint cannot be written."""
    trainer = self.trainer
    try:
      trainer.save()
    except CheckpointWriteError as e:
      self.failure = e.reason
      last = trainer.checkpoints.latest_step()
      every = trainer.checkpoint_every
      again = (
        f"trying again at step {run.step + every}" if every and run.step + every <= run.steps else "not again"
      )
      trainer.say(
        f"checkpoint: step {run.step} could not be written ({e.reason}); training goes on with the state in "
        f"memory, {again}; last checkpoint written: {'step ' + str(last) if last is not None else 'none'}"
      )
      return False
    return True


class StopOnSigint:
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
