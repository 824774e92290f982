"""The single-device training step the profiler and the predictor benchmark measure.

``make_train_step(task, policy, optimizer)`` returns a jitted
``step(variables, opt_state, batch, key) -> (variables, opt_state, loss)`` that runs the
task's model under ``policy`` (``qsync_jax.quantize``), takes ``jax.value_and_grad`` of the
task's loss with respect to ``variables["params"]`` and applies the optax update. The
variables and optimizer state are donated, so XLA updates them in place.

``xla_peak_bytes(compiled)`` is the peak XLA reports for a compiled program:
arguments + outputs − aliased (donated) bytes + temporaries.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsync_jax.flax_quant import RNG_COLLECTION, quantize
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.task import Task


def default_optimizer() -> optax.GradientTransformation:
  return optax.adam(1e-3)


def tree_bytes(tree) -> int:
  """Bytes of every array leaf of ``tree``."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))


def device_batch(task: Task, batch_size: int, seed: int = 1):
  """The first training batch of ``task`` at ``batch_size`` (drawn with ``seed``), as device
  arrays: what a step is compiled and timed on."""
  return jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(batch_size, seed)))


def init_variables(task: Task, batch, seed: int = 0):
  """The task's model variables, initialised on ``batch``."""
  return task.model.init(jax.random.key(seed), *task.inputs(batch), **task.train_kwargs)


def apply_optimizer(optimizer: optax.GradientTransformation, params, grads, opt_state):
  """``(new params, new opt_state)``. Traced under standard dtype promotion: optax mixes
  Python floats with int32 step counts, which strict promotion (the tests' setting) rejects."""
  with jax.numpy_dtype_promotion("standard"):
    deltas, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, deltas), opt_state


def make_train_step(task: Task, policy: PrecisionPolicy, optimizer: optax.GradientTransformation):
  """A jitted single-device training step of ``task`` under ``policy``; see the module doc."""
  qmodel = quantize(task.model, policy)

  def loss_fn(params, others, batch, key):
    keys = jax.random.split(key, 1 + len(task.rng_streams))
    rngs = {RNG_COLLECTION: keys[0], **dict(zip(task.rng_streams, keys[1:]))}
    variables = {"params": params, **others}
    if task.mutable:
      outputs, updates = qmodel.apply(
        variables, *task.inputs(batch), **task.train_kwargs, mutable=list(task.mutable), rngs=rngs
      )
    else:
      outputs, updates = qmodel.apply(variables, *task.inputs(batch), **task.train_kwargs, rngs=rngs), {}
    loss, _ = task.loss(outputs, batch)
    return loss, updates

  def step(variables, opt_state, batch, key):
    params = variables["params"]
    others = {k: v for k, v in variables.items() if k != "params"}
    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, others, batch, key)
    new_params, opt_state = apply_optimizer(optimizer, params, grads, opt_state)
    new_variables = {**others, **dict(updates), "params": new_params}
    return new_variables, opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def xla_peak_bytes(compiled) -> int | None:
  """Peak bytes of a compiled program per ``memory_analysis()`` (None if unavailable)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return int(
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed time (default). ``cpu``: CPU time of this process, all threads — on a
CPU host shared with other work it counts only the time this program runs, so it is far less
noisy than wall time. A third clock, ``device`` (``DEVICE_CLOCK``), is not read per call: it
is the accelerator's kernel time from a ``jax.profiler`` trace (``planners.steptrace``)."""
PIPELINED_CLOCK = "pipelined"
"""Wall time per call of ``repeats`` calls dispatched back to back and waited for once, as a
training loop runs its steps (``qsync_jax.trainer`` keeps one step in flight): the host
dispatches a call while the device runs the one before. The ``wall`` clock waits for every
call, so it also counts the device's idle time between a call's end and the next one's first
kernel — about 2 ms per step of a 4-layer LM on an H100, where the step's kernels take 2.7 ms."""
PIPELINE_WINDOW = 10
"""Calls per sample on ``PIPELINED_CLOCK``. A step whose host dispatch takes nearly as long as
its kernels (an H100 launches ``vgg_wide``'s bf16 step's kernels in about 1.0-1.4 ms; they run
1.42 ms) turns host-bound while the host stalls: one window of 20 such steps took 2.4-3.0 ms
per step where its neighbours took 1.45. The median over windows leaves such stalls out; one
window per round let them through (``docs/results.md``, fourteenth session)."""
DEVICE_CLOCK = "device"
"""The GPU kernel time of a program: what a standalone op costs inside a step whose kernels
run back to back. Wall time of a standalone call adds its dispatch, launch and wait (~50 µs
on an H100), more than many ops' kernels take: timed so, the ops of a 4-layer LM step summed
to 4 ms more than the whole fp32 step."""


def default_step_clock() -> str:
  """The clock a training step is timed on unless told: ``PIPELINED_CLOCK`` on a GPU (the step
  a training run sees there), ``wall`` elsewhere (where the CPU predictor was validated)."""
  return PIPELINED_CLOCK if jax.devices()[0].platform == "gpu" else "wall"


def default_step_repeats(clock: str) -> int:
  """Timed training steps per measurement unless told: ten windows on ``PIPELINED_CLOCK``, 20
  steps on the per-call clocks."""
  return 10 * PIPELINE_WINDOW if clock == PIPELINED_CLOCK else 20


def timed_ms(
  fn: Callable[[], object], repeats: int, warmup: int = 2, clock: str = "wall"
) -> tuple[float, list[float]]:
  """``(median, all samples)``: time of ``fn()`` in ms on ``clock``, blocking on its result.
  On ``DEVICE_CLOCK`` the one sample is the mean kernel time per call over ``repeats`` calls;
  on ``PIPELINED_CLOCK`` the calls run in windows of ``PIPELINE_WINDOW`` (one window where
  ``repeats`` is smaller; ``repeats`` rounded down to whole windows), and a window's sample is
  its wall time, its calls dispatched back to back and its last call's result waited for,
  divided by its calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  if clock == PIPELINED_CLOCK:
    window = min(repeats, PIPELINE_WINDOW)
    samples = []
    for _ in range(max(repeats // window, 1)):
      t0 = time.perf_counter()
      for _ in range(window - 1):
        fn()
      jax.block_until_ready(fn())
      samples.append(1e3 * (time.perf_counter() - t0) / window)
    return float(np.median(samples)), samples
  if clock == DEVICE_CLOCK:
    from planners.steptrace import device_kernel_ms  # steptrace builds on this module

    ms = device_kernel_ms(lambda: jax.block_until_ready(fn()), repeats)
    return ms, [ms]
  samples = []
  for _ in range(repeats):
    t0 = CLOCKS[clock]()
    jax.block_until_ready(fn())
    samples.append(1e3 * (CLOCKS[clock]() - t0))
  return float(np.median(samples)), samples


def compiled_train_step(task: Task, policy: PrecisionPolicy, batch, optimizer=None, seed: int = 0):
  """``(run, xla peak bytes)``: ``run()`` takes one jitted training step on ``batch`` and
  returns its loss; the step is fed its own outputs (donated buffers), as in training."""
  compiled, run = compile_train_step(task, policy, batch, optimizer, seed)
  return run, xla_peak_bytes(compiled)


def compile_train_step(
  task: Task, policy: PrecisionPolicy, batch, optimizer=None, seed: int = 0, compiler_options=None
):
  """``(compiled, run)``: the training step compiled with XLA ``compiler_options`` (None: the
  defaults; ``compiled.as_text()`` is its module) and ``run`` as in ``compiled_train_step``."""
  built = build_train_step(task, policy, batch, optimizer, seed, compiler_options)
  return built.compiled, built.run


def staged_compile(jitted, *args, compiler_options=None):
  """``(traced, lowered, compiled, seconds)``: ``jitted`` on ``args`` through JAX's three
  stages, ``jitted.trace(...).lower().compile()``, and each stage's seconds (``trace_s``:
  tracing to a jaxpr — the model's Python, the policy's ops; ``lower_s``: lowering to
  StableHLO; ``compile_s``: XLA's compilation — fusion, autotuning, kernel code generation)."""
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile(compiler_options=compiler_options)
  t3 = time.perf_counter()
  return traced, lowered, compiled, {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2}


@dataclasses.dataclass(frozen=True)
class BuiltStep:
  """A compiled training step (``build_train_step``) and how it was built.

  Attributes:
    compiled: the XLA executable; ``run()`` takes one step with it, fed its own outputs.
    traced, lowered: JAX's earlier stages of the same program (its jaxpr, its StableHLO).
    seconds: ``staged_compile``'s seconds per stage.
  """

  compiled: Any
  run: Callable[[], Any]
  traced: Any
  lowered: Any
  seconds: dict[str, float]


def build_train_step(
  task: Task,
  policy: PrecisionPolicy,
  batch,
  optimizer=None,
  seed: int = 0,
  compiler_options=None,
  variables=None,
) -> BuiltStep:
  """The training step of ``compile_train_step``, with its stages (``BuiltStep``); it starts
  from ``variables`` if given (else ``init_variables(task, batch, seed)``)."""
  optimizer = optimizer or default_optimizer()
  variables = init_variables(task, batch, seed) if variables is None else variables
  opt_state = optimizer.init(variables["params"])
  step = make_train_step(task, policy, optimizer)
  key = jax.random.key(seed)
  traced, lowered, compiled, seconds = staged_compile(
    step, variables, opt_state, batch, key, compiler_options=compiler_options
  )
  state = [variables, opt_state]

  def run():
    state[0], state[1], loss = compiled(state[0], state[1], batch, key)
    return loss

  return BuiltStep(compiled, run, traced, lowered, seconds)


def time_train_step(
  task: Task,
  policy: PrecisionPolicy,
  batch,
  repeats: int,
  optimizer=None,
  seed: int = 0,
  clock: str = "wall",
):
  """``(ms, samples, xla peak bytes)`` of the jitted training step on ``batch`` (median of
  repeats on ``clock``; ``compiled_train_step``)."""
  run, peak = compiled_train_step(task, policy, batch, optimizer, seed)
  med, samples = timed_ms(run, repeats, clock=clock)
  return med, samples, peak


def time_train_steps_interleaved(
  task: Task,
  policies: dict[str, PrecisionPolicy],
  batch,
  repeats: int,
  rounds: int,
  clocks: Sequence[str] = ("wall",),
  progress: Callable[[str], None] | None = None,
  skip: tuple[type[Exception], ...] = (),
) -> dict[str, dict[str, tuple[float, list[float], int | None]]]:
  """``{clock: {name: (ms, round medians, xla peak bytes)}}``: every policy's step compiled
  first, then timed round-robin, ``repeats`` steps of each per round and clock over ``rounds``
  rounds; ``ms`` is the median of the round medians. Slow drift of the host or the GPU (clocks,
  temperature, other work) falls on every policy alike instead of on whichever was timed when
  it happened. A policy whose step raises one of ``skip`` when compiled is left out (and
  reported)."""
  runs = {}
  for name, policy in policies.items():
    try:
      runs[name] = compiled_train_step(task, policy, batch)
    except skip as e:
      if progress:
        progress(f"{name} cannot run on this backend: {str(e).splitlines()[0][:100]}")
      continue
    if progress:
      progress(f"compiled {name}")
  medians = time_round_robin(
    {name: run for name, (run, _) in runs.items()}, repeats, rounds, clocks, progress
  )
  return {
    clock: {name: (float(np.median(m)), m, runs[name][1]) for name, m in by_name.items()}
    for clock, by_name in medians.items()
  }


def time_round_robin(
  runs: dict[str, Callable[[], object]],
  repeats: int,
  rounds: int,
  clocks: Sequence[str] = ("wall",),
  progress: Callable[[str], None] | None = None,
  first_round: int = 1,
  total_rounds: int | None = None,
) -> dict[str, dict[str, list[float]]]:
  """``{clock: {name: [round medians]}}``: each of ``runs`` timed ``repeats`` times
  (``timed_ms``) per round and clock, round-robin over ``rounds`` rounds; ``progress`` gets one
  line per round and clock, numbered from ``first_round`` of ``total_rounds`` (default: these
  rounds alone)."""
  total_rounds = total_rounds or first_round - 1 + rounds
  medians = {clock: {name: [] for name in runs} for clock in clocks}
  for r in range(first_round, first_round + rounds):
    for name, run in runs.items():
      for clock in clocks:
        medians[clock][name].append(timed_ms(run, repeats, clock=clock)[0])
    if progress:
      for clock, by_name in medians.items():
        progress(
          f"round {r}/{total_rounds}, {clock}: " + ", ".join(f"{n} {m[-1]:.2f}" for n, m in by_name.items())
        )
  return medians
