"""Measuring a profile on the local device (``measure_profile``), or tracing one without timing
anything (``traced_profile``).

``measure_profile`` traces the model's quantizable ops; times every GEMM leg at every profiled
precision and every preset op policy whose precisions are profiled (``planners.profiler.op_programs``;
on a GPU on the device clock with the activations precast, elsewhere on the step clock less the
dispatch overhead), keeping the op tables in a checkpoint file after every op so that an
interrupted profile resumes (``planners.profiler.partial_profile``); times the optimizer, the casts
and, over ``fit_rounds`` rounds, the fit step (``planners.profiler.fit.fit_preset``) at the
profiled batch and at half of it; compiles the fp32
step (XLA's peak, each op's forward headroom) and takes the all-bf16 step's peak; on the device
clock traces the all-int8 step op by op (``Profile.quantized_in_step_ms``); then fits the
remainder, the memory corrections and the fixed share (``planners.profiler.fit.fit_profile``).
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from planners.ops import OpShape, collect_ops
from planners.predictor.graph import QUANTIZED_TRACE_PRESET
from planners.profile import Profile
from planners.profiler import timing
from planners.profiler.fit import SIXTEEN_BIT_PRESET, fit_memory, fit_preset, fit_profile
from planners.profiler.op_programs import dispatch_overhead_ms, measure_casts, measure_leg, measure_policy
from planners.profiler.partial_profile import load_partial, remove_partial, save_partial
from planners.profiler.step_hlo import forward_headroom, per_op_ms
from qsync_jax.devices import device_type_of, supported_precisions
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import LEGS, PRESETS, QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.train.train_step import init_variables


def versions() -> dict[str, str]:
  import jaxlib

  dev = jax.devices()[0]
  return {
    "jax_version": jax.__version__,
    "jaxlib_version": jaxlib.__version__,
    "device_kind": dev.device_kind,
    "platform": dev.platform,
    "python": platform.python_version(),
  }


def _train_ops(task, variables, batch, seed: int) -> tuple[OpShape, ...]:
  """The quantizable ops ``task``'s training-mode ``apply`` calls (``collect_ops``; traced)."""
  kwargs = {**task.train_kwargs, **({"mutable": list(task.mutable)} if task.mutable else {})}
  keys = jax.random.split(jax.random.key(seed), len(task.rng_streams))
  kwargs["rngs"] = dict(zip(task.rng_streams, keys))  # dropout… (their masks do not change shapes)
  return tuple(collect_ops(task.model, variables, *task.inputs(batch), **kwargs))


def task_ops(task, batch_per_device: int, seed: int = 0) -> tuple[Any, Any, tuple[OpShape, ...]]:
  """``(batch, variables, ops)``: a training batch of ``task``, its initial variables and the
  quantizable ops its training-mode ``apply`` calls (``collect_ops``; traced, not run)."""
  batch = timing.device_batch(task, batch_per_device, seed)
  variables = init_variables(task, seed, batch)[0]
  return batch, variables, _train_ops(task, variables, batch, seed)


def task_shapes(task, batch_per_device: int, seed: int = 0) -> tuple[Any, Any, tuple[OpShape, ...]]:
  """``task_ops`` as ``jax.ShapeDtypeStruct`` trees: nothing is computed and nothing of the
  batch's size allocated (the batch's shapes are a one-example batch's, with every leaf's leading,
  example axis at ``batch_per_device``)."""
  one = next(task.train_batches(1, seed))
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((batch_per_device, *np.shape(x)[1:]), np.asarray(x).dtype), one
  )
  ops = []

  def variables_and_ops(batch):
    variables = init_variables(task, seed, batch)[0]
    ops.extend(_train_ops(task, variables, batch, seed))
    return variables

  variables = jax.eval_shape(variables_and_ops, batch)
  return batch, variables, tuple(ops)


def memory_sizes(params, opt_state, batch) -> dict[str, int]:
  """A profile's ``memory``: the sizes measured, ``other_bytes`` not fitted yet."""
  sizes = {
    f"{k}_bytes": timing.tree_bytes(v)
    for k, v in (("param", params), ("opt_state", opt_state), ("batch", batch))
  }
  return {**sizes, "other_bytes": 0}


def policy_key(preset: str, op: OpShape) -> tuple:
  """Cache key of one whole-policy timing: ops of equal kind, shapes and dtype share it."""
  return (preset, op.kind, op.lhs_shape, op.rhs_shape, op.batch, op.m, op.k, op.n, op.activation_dtype)


def step_memory(task, batch, ops, seed: int = 0, preset: str = "fp32") -> tuple[int | None, dict[str, int]]:
  """``(XLA peak bytes, forward headroom)`` of the training step of ``task`` on ``batch`` (arrays
  or their shapes) under the uniform ``preset``, compiled (not run) on the local device."""
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  variables = jax.eval_shape(lambda b: init_variables(task, seed, b)[0], batch)
  built = timing.build_train_step(
    task, PrecisionPolicy.uniform(preset), batch, seed=seed, variables=variables
  )
  return timing.xla_peak_bytes(built.compiled), forward_headroom(built.compiled.as_text(), ops)


def op_leg_ms(task, policy, batch, ops: Sequence[OpShape], repeats: int) -> dict[str, dict[str, float]]:
  """``{op name: {"fwd": ms, "bwd": ms}}``: the ops' time inside the training step under
  ``policy`` (``timing.instruction_times``, charged by ``step_hlo.per_op_ms``);
  ``timing.ProfilerBusyError`` when a JAX profiler trace is already active (one runs at a time)."""
  hlo, instruction_ms = timing.instruction_times(task, policy, batch, repeats)
  by_op = per_op_ms(hlo, instruction_ms, ops)
  return {op.name: by_op[op.name] for op in ops if op.name in by_op}


def measure_profile(
  task,
  batch_per_device: int,
  precisions: Sequence[str] | None = None,
  repeats: int = 10,
  step_repeats: int | None = None,
  progress: Callable[[str], None] | None = None,
  seed: int = 0,
  cast_sizes: Sequence[int] = (2**14, 2**16, 2**18, 2**20),
  clock: str | None = None,
  checkpoint: str | None = None,
  fit_rounds: int = 3,
) -> Profile:
  """The profile of ``task`` at ``batch_per_device`` on the local device (module docstring):
  ``repeats`` per standalone timing, ``step_repeats`` per round of the fit step on ``clock``
  (default ``timing.default_step_clock()``), the op timings kept in ``checkpoint`` meanwhile.

  In steps: the ops' standalone programs (``_time_ops``), the optimizer update and the casts,
  the fit step at the batch and at half of it (``_time_fit_steps``), the fp32 step's memory, the
  all-int8 step's per-op times (``_in_step_op_ms``); then the fits (``fit_profile``)."""
  say = progress or (lambda msg: None)
  device_type = device_type_of(jax.devices()[0])
  gpu = jax.devices()[0].platform == "gpu"
  precisions = tuple(precisions or supported_precisions(device_type))
  batch, variables, ops = task_ops(task, batch_per_device, seed)
  step_clock = clock or timing.default_step_clock()
  step_repeats = step_repeats or timing.default_step_repeats(step_clock)
  op_clock = timing.DEVICE_CLOCK if gpu else step_clock
  overhead = 0.0 if gpu else dispatch_overhead_ms(clock=op_clock)
  say(
    f"{len(ops)} quantizable ops; standalone programs on the {op_clock} clock, dispatch overhead {overhead:.3f} ms"
  )
  settings = {
    "model": task.name,
    "batch_per_device": batch_per_device,
    "device_kind": jax.devices()[0].device_kind,
    "precisions": list(precisions),
    "repeats": repeats,
    "seed": seed,
    "clock": step_clock,
    "op_clock": op_clock,
    "precast": gpu,
    "ops": [op.name for op in ops],
  }
  op_programs = _OpPrograms(precisions, repeats, overhead, seed, op_clock, gpu)
  op_ms, unrunnable, op_spread = _time_ops(ops, op_programs, checkpoint, settings, say)

  say("optimizer update")
  params, opt_state, optimizer_ms = _time_optimizer(variables["params"], repeats, op_clock, overhead)
  say("cast models")
  cast = measure_casts(cast_sizes, repeats=repeats, overhead=overhead, clock=op_clock, precisions=precisions)

  preset = fit_preset(precisions)
  fit = _time_fit_steps(
    task, batch, batch_per_device, preset, step_repeats, fit_rounds, step_clock, seed, say
  )
  say("memory: the fp32 step compiled")
  fp32_peak, headroom = step_memory(task, batch, ops, seed)
  sixteen_bit_peak = fit["peak"] if preset == SIXTEEN_BIT_PRESET else None
  in_step = _in_step_op_ms(task, batch, ops, precisions, op_clock, step_repeats, say)
  meta = {
    **versions(),
    "precisions": list(precisions),
    "dispatch_overhead_ms": overhead,
    "repeats": repeats,
    "clock": step_clock,
    "op_clock": op_clock,
    "unrunnable": unrunnable,
    "op_round_spread": op_spread,
    **({"policy_operands": "precast"} if gpu else {}),
    "fit_preset": preset,
    "fit_step_ms": fit["ms"],
    "fit_step_round_ms": fit["round_ms"],
    **(
      {"fit_small_batch": fit["small"], "fit_step_small_ms": fit["small_ms"]}
      if fit["small_ms"] is not None
      else {}
    ),
    "fp32_xla_peak_bytes": fp32_peak,
    **({"bf16_xla_peak_bytes": sixteen_bit_peak} if sixteen_bit_peak is not None else {}),
  }
  draft = Profile(
    task.name,
    device_type,
    "measured",
    batch_per_device,
    ops,
    op_ms,
    {"fwd": 0.0, "bwd": 0.0},
    optimizer_ms,
    cast,
    memory_sizes(params, opt_state, batch),
    meta,
    headroom,
    in_step,
  )
  prof = fit_profile(draft)
  remove_partial(checkpoint)  # only now: a run killed after the ops resumes after them
  return prof


def _time_optimizer(params, repeats: int, clock: str, overhead: float):
  """``(params, opt_state, ms)``: the default optimizer's update of ``params`` timed standalone."""
  optimizer = timing.default_optimizer()
  opt_state = optimizer.init(params)
  update = jax.jit(functools.partial(timing.apply_optimizer, optimizer))
  ms = timing.timed_ms(lambda: update(params, params, opt_state), repeats, clock=clock)[0] - overhead
  return params, opt_state, max(ms, 0.0)


@dataclasses.dataclass
class _OpPrograms:
  """How the ops' standalone programs are timed (``measure_leg``, ``measure_policy``), and the
  timings of the shapes timed so far (``cache``: ops of one shape are timed once)."""

  precisions: tuple[str, ...]
  repeats: int
  overhead: float
  seed: int
  clock: str
  precast: bool
  cache: dict[tuple, Any] = dataclasses.field(default_factory=dict)


def _time_ops(ops, programs: _OpPrograms, checkpoint, settings, say):
  """``(op_ms, unrunnable, op_spread)``: every op's table (resumed from ``checkpoint`` where it
  holds the op under ``settings``, and saved there after each op), in forward order; the op
  policies that cannot run here; per op timed in this call, its timings' largest
  slowest/fastest repeat."""
  op_ms, unrunnable = load_partial(checkpoint, settings)
  if op_ms:
    say(f"resuming from {checkpoint}: {len(op_ms)} of {len(ops)} ops already timed")
  op_spread: dict[str, float] = {}
  for i, op in enumerate(ops):
    if op.name in op_ms:
      continue
    say(f"[{i + 1}/{len(ops)}] {op.name}  ({op.batch}x{op.m}x{op.k}x{op.n})")
    with timing.record_spreads() as spreads:
      op_ms[op.name] = _time_op(op, programs, unrunnable, say)
    if spreads:  # none where every leg and policy was cached from an op of the same shape
      op_spread[op.name] = max(spreads)
    save_partial(checkpoint, settings, op_ms, unrunnable)
  return {op.name: op_ms[op.name] for op in ops}, unrunnable, op_spread


def _time_op(op: OpShape, programs: _OpPrograms, unrunnable: list[str], say) -> dict[str, dict[str, float]]:
  """One op's table: ``{leg: {precision: ms}}`` for every leg at every precision it runs, and
  ``{"policy:<preset>": ms}`` for every preset whose precisions it runs (a preset that cannot run
  here is appended to ``unrunnable``)."""
  pr, cache = programs, programs.cache
  table: dict[str, dict[str, float]] = {}
  runs = [p for p in pr.precisions if op.runs_8bit or p not in QUANTIZED_PRECISIONS]
  for leg in LEGS:
    for p in runs:
      key = (p, leg, op.batch, op.m, op.k, op.n)
      if key not in cache:
        cache[key] = measure_leg(
          p, leg, op.batch, op.m, op.k, op.n, pr.repeats, pr.overhead, pr.seed, pr.clock
        )
      table.setdefault(leg, {})[p] = cache[key]
  for name, pol in PRESETS.items():
    if not all(q in runs for q in pol.precisions):
      continue
    key = policy_key(name, op)
    if key not in cache:
      try:
        cache[key] = measure_policy(
          pol, op.batch, op.m, op.k, op.n, pr.repeats, pr.overhead, pr.seed, pr.clock, op, pr.precast
        )
      except jax.errors.JaxRuntimeError as e:  # e.g. XLA:CPU has no batched bf16 dot
        cache[key] = None
        unrunnable.append(f"{op.name} under {name}: {str(e).splitlines()[0][:120]}")
        say(f"  cannot time {op.name} under {name} here; its legs will be used")
    if cache[key] is not None:
      table[f"policy:{name}"] = cache[key]
  return table


def _time_fit_steps(task, batch, batch_per_device, preset, step_repeats, fit_rounds, step_clock, seed, say):
  """The all-``preset`` training step over ``fit_rounds`` rounds on ``step_clock``:
  ``{"ms", "round_ms", "peak"}`` at the batch, and ``{"small", "small_ms"}`` at half of it (what
  of its compute does not scale: ``fixed_share``; ``small_ms`` None below a batch of 2)."""
  say(f"fit step: all-{preset}, {fit_rounds} rounds of {step_repeats} steps on the {step_clock} clock")
  fit_ms, round_ms, fit_peak = timing.time_train_steps_interleaved(
    task,
    {preset: PrecisionPolicy.uniform(preset)},
    batch,
    step_repeats,
    fit_rounds,
    clocks=(step_clock,),
    progress=lambda msg: say(f"fit step: {msg}"),
  )[step_clock][preset]
  small = batch_per_device // 2
  small_ms = None
  if small >= 1:
    say(f"fit step at {small} per device (the fixed share)")
    small_ms = timing.time_train_steps_interleaved(
      task,
      {preset: PrecisionPolicy.uniform(preset)},
      timing.device_batch(task, small, seed),
      step_repeats,
      fit_rounds,
      clocks=(step_clock,),
      progress=lambda msg: say(f"fit step at {small}: {msg}"),
    )[step_clock][preset][0]
  return {"ms": fit_ms, "round_ms": round_ms, "peak": fit_peak, "small": small, "small_ms": small_ms}


def _in_step_op_ms(task, batch, ops, precisions, op_clock, step_repeats, say) -> dict[str, dict[str, float]]:
  """On the device clock, where the all-int8 preset's precisions are profiled: each op's legs'
  times inside that step (``op_leg_ms``, ``Profile.quantized_in_step_ms``); else ``{}``."""
  if op_clock != timing.DEVICE_CLOCK or not all(
    q in precisions for q in PRESETS[QUANTIZED_TRACE_PRESET].precisions
  ):
    return {}
  trace_policy = PrecisionPolicy.from_ops(
    {op.name: OpPolicy.preset(QUANTIZED_TRACE_PRESET if op.runs_8bit else "fp32") for op in ops}
  )
  in_step = op_leg_ms(task, trace_policy, batch, ops, max(step_repeats // 2, 3))
  say(f"all-int8 step trace: {sum(sum(t.values()) for t in in_step.values()):.3f} ms charged to ops")
  return in_step


# A profile is noisy when, for more than NOISY_OPS_FRACTION of the ops timed, the slowest repeat of
# one of the op's timings exceeds NOISY_SPREAD × its fastest (``meta["op_round_spread"]``).
NOISY_SPREAD = 1.5
NOISY_OPS_FRACTION = 0.25


def noisy_ops(prof: Profile) -> tuple[list[str], int]:
  """``(ops whose repeats disagree, ops with a recorded spread)`` of a measured profile: the ops of
  ``meta["op_round_spread"]`` whose slowest repeat exceeds ``NOISY_SPREAD`` × the fastest (a
  profile without the record, e.g. an older or a modeled one, gives ``([], 0)``)."""
  spread = prof.meta.get("op_round_spread") or {}
  return [op for op, s in spread.items() if s > NOISY_SPREAD], len(spread)


def noisy_host_warning(prof: Profile) -> str | None:
  """The warning ``qsync profile`` prints when more than ``NOISY_OPS_FRACTION`` of the timed ops
  are noisy (``noisy_ops``), else None."""
  noisy, timed = noisy_ops(prof)
  if not timed or len(noisy) <= NOISY_OPS_FRACTION * timed:
    return None
  return (
    f"warning: the repeats of {len(noisy)} of {timed} ops' timings disagree (slowest > {NOISY_SPREAD}× the "
    f"fastest, e.g. {noisy[0]}): the host is busy and these costs are unreliable. Fix: profile on an idle "
    f"host, or raise --repeats (now {prof.meta.get('repeats')})."
  )


def traced_profile(task, batch_per_device: int, seed: int = 0) -> Profile:
  """A profile with the ops and memory of ``task`` but no timings (``source="traced"``): the
  base ``planners.predictor.modeled.modeled_profile`` costs. Compiles the fp32 step once; runs
  nothing (``task_shapes``)."""
  batch, variables, ops = task_shapes(task, batch_per_device, seed)
  opt_state = jax.eval_shape(timing.default_optimizer().init, variables["params"])
  memory = memory_sizes(variables["params"], opt_state, batch)
  peak, headroom = step_memory(task, batch, ops, seed)
  meta = {**versions(), "fp32_xla_peak_bytes": peak}
  skeleton = Profile(
    task.name,
    device_type_of(jax.devices()[0]),
    "traced",
    batch_per_device,
    ops,
    {},
    {},
    0.0,
    {},
    memory,
    meta,
    headroom,
  )
  return fit_memory(skeleton, peak)
