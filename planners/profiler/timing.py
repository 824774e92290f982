"""Timing programs on the local device: clocks, the single-device training step, traces.

``single_device_step(task, policy, optimizer)`` is a jitted single-device step
``(variables, opt_state, batch, key) -> (variables, opt_state, loss)``: the task's loss under
``policy`` (``qsync_jax.train.task_step.task_loss``), its gradient and the optax update (variables and
optimizer state donated). ``timed_ms`` times a program on a clock; ``time_round_robin`` several,
round-robin; ``profiler_events`` reads a ``jax.profiler`` trace (GPU kernels, XLA:CPU's
per-instruction events), which ``instruction_times`` charges to a step's HLO instructions.
"""

from __future__ import annotations

import glob
import gzip
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from planners.profiler.hlo import entry_instructions
from qsync_jax.errors import PlanError
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train.task import Task
from qsync_jax.train.task_step import task_loss
from qsync_jax.train.train_step import init_variables


def default_optimizer() -> optax.GradientTransformation:
  return optax.adam(1e-3)


def tree_bytes(tree) -> int:
  """Bytes of every array leaf of ``tree``."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))


def device_batch(task: Task, batch_size: int, seed: int = 1):
  """The first training batch of ``task`` at ``batch_size`` (drawn with ``seed``), as device arrays."""
  return jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(batch_size, seed)))


def apply_optimizer(optimizer: optax.GradientTransformation, params, grads, opt_state):
  """``(new params, new opt_state)``, traced under standard dtype promotion (optax mixes Python
  floats with int32 step counts, which strict promotion rejects)."""
  with jax.numpy_dtype_promotion("standard"):
    deltas, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, deltas), opt_state


def single_device_step(task: Task, policy: PrecisionPolicy, optimizer: optax.GradientTransformation):
  """A jitted single-device training step of ``task`` under ``policy``; see the module docstring."""
  loss_fn = task_loss(task, policy)

  def step(variables, opt_state, batch, key):
    params = variables["params"]
    others = {k: v for k, v in variables.items() if k != "params"}

    def loss(p):
      value, _, updated = loss_fn({"params": p, **others}, batch, key)
      return value, updated

    (value, updated), grads = jax.value_and_grad(loss, has_aux=True)(params)
    new_params, opt_state = apply_optimizer(optimizer, params, grads, opt_state)
    return {**others, **dict(updated), "params": new_params}, opt_state, value

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


def staged_compile(jitted, *args, compiler_options=None):
  """``(traced, lowered, compiled, seconds)``: ``jitted.trace(*args).lower().compile()`` and each
  stage's seconds (``trace_s``: to a jaxpr; ``lower_s``: to StableHLO; ``compile_s``: XLA's)."""
  times = [time.perf_counter()]
  traced = jitted.trace(*args)
  times.append(time.perf_counter())
  lowered = traced.lower()
  times.append(time.perf_counter())
  compiled = lowered.compile(compiler_options=compiler_options)
  times.append(time.perf_counter())
  return traced, lowered, compiled, dict(zip(("trace_s", "lower_s", "compile_s"), np.diff(times).tolist()))


class BuiltStep(NamedTuple):
  """A compiled training step: ``run()`` takes one step and returns its loss, fed its own outputs
  (donated buffers) as in training; ``traced`` and ``lowered`` are JAX's earlier stages of the
  same program, ``seconds`` ``staged_compile``'s."""

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
  """The training step on ``batch`` compiled with XLA ``compiler_options`` (None: the defaults),
  from ``variables`` (default ``qsync_jax.train.train_step.init_variables(task, seed, batch)[0]``). ``batch`` and ``variables``
  may be ``jax.ShapeDtypeStruct`` trees: then only ``compiled`` (not ``run``) is of use."""
  optimizer = optimizer or default_optimizer()
  variables = init_variables(task, seed, batch)[0] if variables is None else variables
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(variables)):
    opt_state = jax.eval_shape(optimizer.init, variables["params"])
  else:
    opt_state = optimizer.init(variables["params"])
  key = jax.random.key(seed)
  step = single_device_step(task, policy, optimizer)
  traced, lowered, compiled, seconds = staged_compile(
    step, variables, opt_state, batch, key, compiler_options=compiler_options
  )
  state = [variables, opt_state]

  def run():
    state[0], state[1], loss = compiled(state[0], state[1], batch, key)
    return loss

  return BuiltStep(compiled, run, traced, lowered, seconds)


def compile_train_step(
  task: Task, policy: PrecisionPolicy, batch, optimizer=None, seed: int = 0, compiler_options=None
):
  """``(compiled, run)`` of ``build_train_step``."""
  built = build_train_step(task, policy, batch, optimizer, seed, compiler_options)
  return built.compiled, built.run


def compiled_train_step(task: Task, policy: PrecisionPolicy, batch, optimizer=None, seed: int = 0):
  """``(run, xla peak bytes)`` of ``compile_train_step``."""
  compiled, run = compile_train_step(task, policy, batch, optimizer, seed)
  return run, xla_peak_bytes(compiled)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed time. ``cpu``: CPU time of this process, all threads."""
PIPELINED_CLOCK = "pipelined"
"""Calls dispatched back to back, as a training loop runs its steps, waited for once per window
of ``PIPELINE_WINDOW`` calls: a sample is the window's wall time per call."""
PIPELINE_WINDOW = 10
DEVICE_CLOCK = "device"
"""The GPU kernel time of a program per call (``device_kernel_ms``)."""


def default_step_clock() -> str:
  """``PIPELINED_CLOCK`` on a GPU, ``wall`` elsewhere."""
  return PIPELINED_CLOCK if jax.devices()[0].platform == "gpu" else "wall"


def default_step_repeats(clock: str) -> int:
  """Timed training steps per measurement: ten windows on ``PIPELINED_CLOCK``, else 20."""
  return 10 * PIPELINE_WINDOW if clock == PIPELINED_CLOCK else 20


# While ``record_spreads`` is active: the spread (slowest / fastest sample) of every ``timed_ms``.
_spreads: list[list[float]] = []


class record_spreads:
  """``with record_spreads() as spreads:`` appends to ``spreads`` the spread of every ``timed_ms``
  call inside it: its slowest sample over its fastest (1.0 with one sample, as on ``DEVICE_CLOCK``).
  A spread well above 1 means the repeats of one measurement disagree: a busy host."""

  def __enter__(self) -> list[float]:
    self.spreads: list[float] = []
    _spreads.append(self.spreads)
    return self.spreads

  def __exit__(self, *exc) -> None:
    _spreads.remove(self.spreads)


def _record(samples: Sequence[float]) -> None:
  if _spreads:
    low = min(samples)
    spread = max(samples) / low if low > 0 else 1.0
    for spreads in _spreads:
      spreads.append(spread)


def timed_ms(
  fn: Callable[[], object], repeats: int, warmup: int = 2, clock: str = "wall"
) -> tuple[float, list[float]]:
  """``(median, samples)``: time of ``fn()`` in ms on ``clock``, blocking on its result. On
  ``DEVICE_CLOCK`` the one sample is the mean kernel time per call over ``repeats`` calls; on
  ``PIPELINED_CLOCK`` ``repeats // window`` windows (one where ``repeats`` is smaller)."""
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
    _record(samples)
    return float(np.median(samples)), samples
  if clock == DEVICE_CLOCK:
    ms = device_kernel_ms(lambda: jax.block_until_ready(fn()), repeats)
    return ms, [ms]
  samples = []
  for _ in range(repeats):
    t0 = CLOCKS[clock]()
    jax.block_until_ready(fn())
    samples.append(1e3 * (CLOCKS[clock]() - t0))
  _record(samples)
  return float(np.median(samples)), samples


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
  (``timed_ms``) per round and clock, round-robin over ``rounds`` rounds (slow drift of the
  host falls on every run alike); ``progress`` gets a line per round, numbered from
  ``first_round`` of ``total_rounds`` (default: these rounds alone)."""
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
  """``{clock: {name: (ms, round medians, xla peak bytes)}}``: every policy's training step
  compiled first, then timed round-robin (``time_round_robin``); ``ms`` is the median of the
  round medians. A policy whose step raises one of ``skip`` when compiled is left out."""
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


# -- profiler events ----------------------------------------------------------------------------


class ProfilerBusyError(PlanError):
  """Another ``jax.profiler`` trace is running in this process (one runs at a time)."""


def profiler_events(run, repeats: int) -> list[dict]:
  """The complete ("X") events of a ``jax.profiler`` trace of ``repeats`` calls of ``run``, each
  with ``process``, its trace process's name (``/device:GPU:0 …``: GPU kernels). The trace is
  stopped however ``run`` ends; ``ProfilerBusyError`` while another trace runs."""
  out = []
  with tempfile.TemporaryDirectory() as log_dir:
    try:
      jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
    except RuntimeError as e:
      if "already" not in str(e):
        raise
      raise ProfilerBusyError(
        "the step cannot be traced: another jax.profiler trace is running in this process (one runs at a "
        "time). Fix: stop it (jax.profiler.stop_trace()) and run again."
      ) from e
    try:
      for _ in range(repeats):
        run()
    finally:
      jax.profiler.stop_trace()
    for path in glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True):
      with gzip.open(path) as f:
        events = json.load(f).get("traceEvents", [])
      process = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
      }
      out += [{**e, "process": process.get(e.get("pid"), "")} for e in events if e.get("ph") == "X"]
  return out


def kernels_by(
  events: list[dict], repeats: int, key=lambda name: name, device: str = "/device:GPU:0"
) -> dict[str, tuple[float, float]]:
  """``{key(kernel name): (ms, launches)}`` per call of the ``profiler_events`` of ``repeats``
  calls, on the trace process ``device`` (the first GPU); empty where it has no kernel."""
  out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
  for e in events:
    if e["process"].startswith(device):
      entry = out[key(e["name"])]
      entry[0] += e["dur"] / 1e3 / repeats
      entry[1] += 1 / repeats
  return {k: (ms, n) for k, (ms, n) in out.items()}


def device_kernel_ms(run, repeats: int) -> float:
  """Mean ms per call of ``run`` of the kernels on the first GPU, from a trace of ``repeats``
  calls. ``RuntimeError`` where the trace has no GPU kernels (e.g. on a CPU)."""
  kernels = kernels_by(profiler_events(run, repeats), repeats)
  if not kernels:
    raise RuntimeError(
      f"no GPU kernel in a trace of {jax.devices()[0].platform} programs: the device clock needs a GPU. "
      "Fix: time with clock='wall' (or 'cpu' on a CPU host)."
    )
  return sum(ms for ms, _ in kernels.values())


CPU_EVENT_OPTIONS = {"xla_cpu_enable_xprof_traceme": True}
"""XLA:CPU compile option: one trace event per executed instruction."""
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
"""XLA:GPU compile option: no CUDA graphs, so that each traced kernel names its instruction."""


def instruction_times(
  task: Task, policy: PrecisionPolicy, batch, repeats: int
) -> tuple[str, dict[str, float]]:
  """``(module text, {instruction: ms per step})`` of the training step of ``task`` under
  ``policy``: on a GPU its kernels (compiled with ``NO_COMMAND_BUFFERS``, each kernel charged
  to its ``hlo_op``), on XLA:CPU its per-instruction events (wall time: the median event of an
  instruction times its events per step)."""
  compiled, run = compile_train_step(task, policy, batch, compiler_options=trace_options())
  return traced_instruction_times(compiled, run, repeats)


def trace_options() -> dict:
  """The compile options ``instruction_times`` traces a step under: ``NO_COMMAND_BUFFERS`` on a
  GPU, ``CPU_EVENT_OPTIONS`` elsewhere."""
  return NO_COMMAND_BUFFERS if jax.devices()[0].platform == "gpu" else CPU_EVENT_OPTIONS


def traced_instruction_times(compiled, run, repeats: int) -> tuple[str, dict[str, float]]:
  """``instruction_times`` of a step already compiled under ``trace_options`` (``compiled``, and
  ``run``: one step)."""
  gpu = jax.devices()[0].platform == "gpu"
  jax.block_until_ready(run())  # warm-up
  events = profiler_events(lambda: jax.block_until_ready(run()), repeats)
  if gpu:
    named = [{**e, "name": e.get("args", {}).get("hlo_op", "")} for e in events]
    return compiled.as_text(), {name: ms for name, (ms, _) in kernels_by(named, repeats).items()}
  hlo, durations = compiled.as_text(), defaultdict(list)
  names = {ins.name for ins in entry_instructions(hlo)}
  for event in events:
    if event["name"] in names:
      durations[event["name"]].append(event["dur"] / 1e3)
  return hlo, {n: float(np.median(d)) * len(d) / repeats for n, d in durations.items()}
