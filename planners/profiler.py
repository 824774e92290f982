"""Cost profiles: time of every op × leg × precision, the remainder of the step, casts, memory.

A ``Profile`` is plain data (JSON round trip) tagged with the device and software versions:

* ``op_ms[op][leg][precision]`` — ms of one call of the op's GEMM leg (``fwd``, ``dlhs``,
  ``drhs``) at that precision as the runtime runs it (``qsync_jax.qdot.leg_dot``), *including*
  the conversion of its fp32 operands: XLA fuses those conversions with the product, and
  standalone cast timings do not predict the fused cost (measured: an int8 step predicted
  from pure GEMMs + standalone casts came out at half its measured time). Variants:
  ``"<p>:sr"`` — the gradient operand rounds stochastically; ``"<p>:saved"`` — the forward
  ran at ``p`` too and saved the operand so (bf16/fp16: no conversion; int8/fp8: the leg
  reuses the saved values and folds their scale into the gradient operand it quantizes);
  ``"<p>:saved:sr"`` — both.
  ``op_ms[op]["policy:<preset>"] = {"fwd": ms, "bwd": ms}`` — the op under a whole preset
  op policy, timed as one forward program and one forward + backward program
  (``planners.op_programs.measure_policy``); the replay prefers it for ops whose policy is that preset. On XLA:CPU
  it also records ``"refuses_producer"`` (1.0 / 0.0): whether, under that policy, XLA re-runs
  the producer of the op's activation to lay the saved activation out for the gradient legs
  and then ``"relayout_ms"``, the time of those re-running relayouts in the standalone program
  (``planners.op_programs.producer_relayout_ms``). Each also records ``"scratch_bytes"``: the
  largest library scratch buffer (cuDNN, cuBLAS) of its forward + backward program, compiled
  (``planners.memtrace.scratch_bytes``; 0 on XLA:CPU). The memory model adds the plan's largest
  (``planners.replay.scratch_bytes``); ``planners.profile_memory.refit_memory`` records them in
  older profiles.
* ``relayout_ms`` — per op, the step time of those relayouts of its saved activation,
  measured inside the fp32 step from XLA's per-instruction trace (``planners.steptrace``;
  XLA:CPU only). The replay charges it to the op's drhs leg under fp32 and under policies
  that re-run the producer; standalone timings cannot see it (their operands are inputs).
* ``remainder_ms`` — the rest of the step (elementwise ops, norms, loss), the same under every
  plan: the measured all-bf16 step (``SIXTEEN_BIT_FIT_PRESET``) minus its ops (with their
  relayouts) and the optimizer where that step was timed (``refit_to_fit_steps``), else the
  fp32 step's; split 1 : 2 between forward and backward. It is a fitted correction and may be
  negative when standalone op timings exceed their cost inside the fused step.
* ``quantized_leg_scale`` — the factor on every int8/fp8 leg's standalone time inside the
  step (forward or gradient; the op's other legs are unchanged): fitted so that the replay
  of the all-int8 step predicts its measured time (``refit_to_fit_steps``), as the
  remainder is fitted on fp32. Inside the step XLA shares or fuses part of the quantize
  passes the standalone programs run alone (on an H100 the all-int8 step of a BERT-base-wide
  LM ran 12 fewer quantize kernels than its ops' programs, one per input read by several
  ops, and 0.9 ms less elementwise and reduction work beyond them, ``docs/results.md``).
  1.0 when not fitted (no int8 profiled, modeled profiles, older profiles). Where the profile
  has ``quantized_in_step_ms`` for an op, it scales that op's gradient legs only.
* ``quantized_in_step_ms`` — per op, its forward and gradient time inside the all-int8 step,
  from a trace of that step, each instruction charged to its op (``steptrace.op_leg_ms``). An
  op's quantized legs take its ratio to their standalone time (``graph.in_step``): on an H100 a
  VGG's int8 convolutions ran their forward 0.9-1.8x and their backward 0.6-1.3x their
  standalone times, so one scale missed plans with quantized forward legs only by 7-11 %
  (``docs/results.md``, fourteenth session). Traced where the ops are timed on the device
  clock (kernel time, as the trace is); empty elsewhere: on XLA:CPU the per-instruction events
  (wall time, part of the step) against ops on the process's CPU time took a CPU run's error
  from 5.2 to 17.2 %.
* ``fp32_leg_scale`` — the factor on every full-fp32 leg's standalone time inside the step,
  fitted after the all-bf16 remainder so that the replay of the fp32 step predicts its measured
  time (``refit_to_fit_steps``); 1.0 when the remainder came from the fp32 step. Kernel traces
  of a VGG's steps on an H100 (``benchmarks/step_ops.py``, ``docs/results.md``) showed the rest
  of the step at 0.71-1.08 ms whatever the plan, while its fp32 convolutions ran up to 17 %
  longer in the step than alone: one remainder and this scale fit better than a remainder per
  activation precision. Profiles written before this field held a 16-bit remainder instead; they
  load refitted to the fit steps their meta records, that remainder kept in
  ``meta["legacy_remainder_16bit_ms"]``.
* ``optimizer_ms`` — the optax update.
* ``cast`` — per cast type (``"fp32->bf16"``, ``"fp32->int8"``, ``"int8->fp32"``, and
  ``"fp32->int8:sr"`` for stochastic rounding, …) ``ms = a·numel + b`` fitted by least squares
  on standalone jitted casts, with its relative RMS fit error (``planners.casts``). The replay
  adds a cast node for what no leg converts: int8/fp8 residuals dequantized for the backward
  (``planners.graph``), and the conversions of modeled devices.
* ``memory`` — parameter, optimizer-state and batch bytes, and ``other_bytes``: the XLA peak
  of the fp32 step minus what the replay model accounts for (a fitted correction); where the
  all-bf16 step was compiled, ``other_bytes_16bit``, the same correction fitted on its peak
  (``with_16bit_other_bytes``), mixed with ``other_bytes`` by a plan's share of 16-bit
  activations as the remainder is: XLA:GPU keeps other tensors around 16-bit ops (bf16 copies
  beside the fp32 tensors a ReLU's backward reads; BatchNorm's 16-bit inputs). What an
  op keeps for its backward inside the step is ``planners.op_memory.kept_bytes``; what its
  forward holds beyond the fp32 op's, ``planners.op_memory.forward_extra_bytes``.
* ``forward_headroom`` — per op, how many bytes below its peak the fp32 step is while the
  op's forward runs (``planners.memtrace``, from the compiled fp32 step's schedule): the
  replay puts a plan's forward transients on top of it.
* ``forward_own_bytes`` — per op, how many of the bytes live at that moment are the op's own
  forward results and library scratch (an fp32 conv's output and cuDNN workspace): a plan that
  quantizes the op's forward has its patches and GEMM operands there instead.

``measure_profile`` measures all of it on the local device; ``planners.derived_profiles``
derives profiles without timing: ``traced_profile`` (ops and memory) and ``modeled_profile``
(a device not at hand, from the catalog's roofline, labelled ``"modeled"``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax

from planners import catalog, memtrace, step, steptrace
from planners.casts import CastModel, measure_casts
from planners.op_programs import (
  dispatch_overhead_ms,
  leg_variants,
  measure_leg,
  measure_policy,
  precast_dtypes,
)
from planners.ops import OpShape, collect_ops
from planners.profile_checkpoint import load_partial, remove_partial, reused_op_ms, save_partial
from qsync_jax.errors import PlanError
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import LEGS, PRESETS, supported_precisions

FORMAT = "qsync-profile/1"
QUANTIZED_FIT_PRESET = "int8"
"""The uniform preset whose step fits ``Profile.quantized_leg_scale``: every leg at int8."""
SIXTEEN_BIT_FIT_PRESET = "bf16"
"""The uniform preset whose step fits ``Profile.remainder_ms`` (then ``fp32_leg_scale`` on fp32): every leg at bf16."""


@dataclasses.dataclass(frozen=True)
class Profile:
  """Cost of one model's training step on one device type; see the module docstring."""

  model: str
  device_type: str
  source: str
  batch_per_device: int
  ops: tuple[OpShape, ...]
  op_ms: dict[str, dict[str, dict[str, float]]]
  remainder_ms: dict[str, float]
  optimizer_ms: float
  cast: dict[str, CastModel]
  memory: dict[str, int]
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  relayout_ms: dict[str, float] = dataclasses.field(default_factory=dict)
  forward_headroom: dict[str, int] = dataclasses.field(default_factory=dict)
  forward_own_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  quantized_leg_scale: float = 1.0
  fp32_leg_scale: float = 1.0
  quantized_in_step_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

  def leg_ms(self, op: str, leg: str, precision: str, variant: str = "") -> float:
    """ms of one call of ``op``'s ``leg`` at ``precision`` (at the profiled batch); a
    ``variant`` (``"saved"``, ``"sr"``, ``"saved:sr"``; see ``leg_variants``) falls back to
    the plain entry when the profile lacks it (modeled profiles)."""
    table = self.op_ms[op][leg]
    for key in (f"{precision}:{variant}", f"{precision}:{variant.split(':')[-1]}") if variant else ():
      if key in table:
        return table[key]
    if precision in table:
      return table[precision]
    raise PlanError(
      f"profile of {self.model!r} on {self.device_type} has no {leg} time for op {op!r} at "
      f"{precision!r} (it has {sorted(table)}). Fix: profile with --precisions including {precision}."
    )

  def with_remainder(self, rest_ms: float) -> Profile:
    """This profile with the remainder of the step set to ``rest_ms`` (a third in the
    forward, two thirds in the backward, as ``measure_profile`` splits it)."""
    return dataclasses.replace(self, remainder_ms={"fwd": rest_ms / 3, "bwd": 2 * rest_ms / 3})

  @property
  def op_names(self) -> tuple[str, ...]:
    return tuple(o.name for o in self.ops)

  # -- JSON -----------------------------------------------------------------------------
  def to_json(self) -> dict[str, Any]:
    return {
      "format": FORMAT,
      "model": self.model,
      "device_type": self.device_type,
      "source": self.source,
      "batch_per_device": self.batch_per_device,
      "ops": [o.to_json() for o in self.ops],
      "op_ms": self.op_ms,
      "remainder_ms": self.remainder_ms,
      "optimizer_ms": self.optimizer_ms,
      "cast": {k: dataclasses.asdict(v) for k, v in self.cast.items()},
      "memory": self.memory,
      "meta": self.meta,
      "relayout_ms": self.relayout_ms,
      "forward_headroom": self.forward_headroom,
      "forward_own_bytes": self.forward_own_bytes,
      "quantized_leg_scale": self.quantized_leg_scale,
      "fp32_leg_scale": self.fp32_leg_scale,
      "quantized_in_step_ms": self.quantized_in_step_ms,
    }

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=1)
      f.write("\n")

  @classmethod
  def from_json(cls, obj: Any, source: str = "<profile>") -> Profile:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
      raise PlanError(
        f'{source} is not a qsync profile (no "format": "{FORMAT}"). '
        "Fix: pass a file written by `qsync profile`."
      )
    try:
      meta = dict(obj.get("meta", {}))
      if obj.get("remainder_16bit_ms") and "fp32_leg_scale" not in obj:  # written before it
        meta["legacy_remainder_16bit_ms"] = obj["remainder_16bit_ms"]
      prof = cls(
        model=obj["model"],
        device_type=obj["device_type"],
        source=obj["source"],
        batch_per_device=int(obj["batch_per_device"]),
        ops=tuple(OpShape.from_json(o) for o in obj["ops"]),
        op_ms=obj["op_ms"],
        remainder_ms=obj["remainder_ms"],
        optimizer_ms=float(obj["optimizer_ms"]),
        cast={k: CastModel(**v) for k, v in obj["cast"].items()},
        memory=obj["memory"],
        meta=meta,
        relayout_ms={k: float(v) for k, v in obj.get("relayout_ms", {}).items()},
        forward_headroom={k: int(v) for k, v in obj.get("forward_headroom", {}).items()},
        forward_own_bytes={k: int(v) for k, v in obj.get("forward_own_bytes", {}).items()},
        quantized_leg_scale=float(obj.get("quantized_leg_scale", 1.0)),
        fp32_leg_scale=float(obj.get("fp32_leg_scale", 1.0)),
        quantized_in_step_ms={
          op: {leg: float(ms) for leg, ms in legs.items()}
          for op, legs in obj.get("quantized_in_step_ms", {}).items()
        },
      )
    except (KeyError, TypeError, ValueError) as e:
      raise PlanError(f"{source}: malformed profile ({e!r}). Fix: re-run `qsync profile`.") from None
    if "legacy_remainder_16bit_ms" in meta and {"fp32_step_ms", "sixteen_bit_fit_step_ms"} <= set(meta):
      return refit_to_fit_steps(prof)  # the fit steps it records, fitted as profiles are now
    return prof

  @classmethod
  def load(cls, path: str) -> Profile:
    try:
      with open(path) as f:
        obj = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise PlanError(
        f"profile {path!r} cannot be read ({e}). Fix: pass a file from `qsync profile`."
      ) from None
    return cls.from_json(obj, source=path)


# -- measuring ------------------------------------------------------------------------------


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


def local_device_type() -> str:
  """The catalog type of the local device (``cpu`` on hosts without accelerators)."""
  kind = jax.devices()[0].device_kind
  if jax.devices()[0].platform == "cpu":
    return "cpu"
  for name in sorted(catalog.CATALOG, key=len, reverse=True):
    if name.replace("-", " ").lower() in kind.lower():
      return name
  return "H100" if "H100" in kind else "cpu"


def task_ops(task, batch_per_device: int, seed: int = 0) -> tuple[Any, Any, tuple[OpShape, ...]]:
  """``(batch, variables, ops)``: a training batch of ``task``, its initial variables and the
  quantizable ops its training-mode ``apply`` calls (``collect_ops``; traced, not run)."""
  batch = step.device_batch(task, batch_per_device, seed)
  variables = step.init_variables(task, batch, seed)
  kwargs = {**task.train_kwargs, **({"mutable": list(task.mutable)} if task.mutable else {})}
  keys = jax.random.split(jax.random.key(seed), len(task.rng_streams))
  kwargs["rngs"] = dict(zip(task.rng_streams, keys))  # dropout… (their masks do not change shapes)
  return batch, variables, tuple(collect_ops(task.model, variables, *task.inputs(batch), **kwargs))


def standalone_clock(op_clock: str | None, fallback: str) -> tuple[str, float]:
  """``(clock, dispatch overhead ms)`` of the standalone programs: ``op_clock``, else the device
  clock on a GPU (kernel time: no overhead to subtract), else ``fallback``."""
  if op_clock is None:
    op_clock = step.DEVICE_CLOCK if jax.devices()[0].platform == "gpu" else fallback
  return op_clock, 0.0 if op_clock == step.DEVICE_CLOCK else dispatch_overhead_ms(clock=op_clock)


def policy_key(preset: str, op: OpShape) -> tuple:
  """Cache key of one whole-policy timing: ops of equal kind and shapes share it."""
  return (preset, op.kind, op.lhs_shape, op.rhs_shape, op.batch, op.m, op.k, op.n)


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
  op_clock: str | None = None,
  precast: bool | None = None,
  checkpoint: str | None = None,
  fit_quantized: bool = True,
  fit_16bit: bool = True,
  fit_rounds: int = 3,
  ops_from: str | None = None,
) -> Profile:
  """Measures the profile of ``task`` at ``batch_per_device`` on the local device.

  Every timing warms up, then takes the median of its repeats on ``clock`` (``wall``;
  ``cpu``: process CPU time, steadier on a CPU host shared with other work; ``pipelined``:
  steps dispatched back to back, as the trainer runs them; default
  ``step.default_step_clock()``: pipelined on a GPU, else wall) — the fp32 step always, and
  the standalone programs (op legs and policies, optimizer, casts) on ``op_clock``: by
  default the device clock on a GPU (``step.DEVICE_CLOCK``: their kernel time, no dispatch
  overhead to subtract), else ``clock``.

  ``precast``: time the whole-policy programs with their activations in the dtypes the step
  converts them to (``planners.op_programs.policy_programs``; ``meta["policy_operands"] =
  "precast"``); by default on a GPU, where it brought the replay of a BERT-base-wide LM from
  13–26 % to 4–14 % mean error (six step sets on H100s, ``docs/results.md``), and not on a
  CPU, where it moved the mean by about a point.

  ``checkpoint``: a JSON file the op timings are written to after every op and read back
  from at the start (``planners.profile_checkpoint``), so an interrupted profile resumes;
  removed once the profile is complete.

  ``fit_quantized``: also time the all-int8 step (when int8 is profiled) and fit
  ``quantized_leg_scale`` to it; that plan is then, like fp32, a plan the profile is fitted
  to. ``fit_16bit``: likewise the all-bf16 step, which the remainder is fitted to, and
  ``fp32_leg_scale`` then to the fp32 step (``refit_to_fit_steps``). The fit steps (fp32 and these) are timed
  round-robin over ``fit_rounds`` rounds, ``step_repeats`` steps each, median of the round
  medians (``step.time_train_steps_interleaved``, as ``benchmarks/predictor.py`` times its
  plans): one slow round on a fresh GPU (an all-bf16 step at 1.78 ms against 1.51 in the rounds
  after) no longer becomes the fit.

  ``ops_from``: a saved profile (path) of the same model, batch, device kind and ops, measured
  under the same settings (``profile_checkpoint.reused_op_ms``), whose op timings are taken
  instead of timed; the rest is measured (``meta["op_ms_from"]``). Op timings repeat across
  runs (an H100's 96 leg and program times of two VGG ops, re-timed in another session: median
  ratio 1.00), while most of a profile's device time is theirs.
  """
  say = progress or (lambda msg: None)
  device_type = local_device_type()
  if precast is None:
    precast = jax.devices()[0].platform == "gpu"
  precisions = tuple(precisions or supported_precisions(device_type))
  batch, variables, ops = task_ops(task, batch_per_device, seed)
  step_clock = clock or step.default_step_clock()
  step_repeats = step_repeats or step.default_step_repeats(step_clock)
  clock, overhead = standalone_clock(op_clock, step_clock)  # from here on: the standalone programs
  say(
    f"{len(ops)} quantizable ops; standalone programs on the {clock} clock, dispatch overhead {overhead:.3f} ms"
  )

  settings = {
    "model": task.name,
    "batch_per_device": batch_per_device,
    "device_kind": jax.devices()[0].device_kind,
    "precisions": list(precisions),
    "repeats": repeats,
    "seed": seed,
    "clock": step_clock,
    "op_clock": clock,
    "precast": precast,
    "ops": [op.name for op in ops],
  }
  op_ms, unrunnable = load_partial(checkpoint, settings)
  if op_ms:
    say(f"resuming from {checkpoint}: {len(op_ms)} of {len(ops)} ops already timed")
  if ops_from:
    lent, lent_unrunnable = reused_op_ms(Profile.load(ops_from), settings, ops_from)
    op_ms, unrunnable = {**lent, **op_ms}, [*lent_unrunnable, *unrunnable]
    say(f"op timings of {ops_from}")
  cache: dict[tuple, Any] = {}
  for i, op in enumerate(ops):
    if op.name in op_ms:
      continue
    say(f"[{i + 1}/{len(ops)}] {op.name}  ({op.batch}x{op.m}x{op.k}x{op.n})")
    table = {}
    for leg in LEGS:
      row = {}
      for p in precisions:
        for name, options in leg_variants(p, leg):
          key = (name, leg, op.batch, op.m, op.k, op.n)
          if key not in cache:
            cache[key] = measure_leg(
              p, leg, op.batch, op.m, op.k, op.n, repeats, overhead, seed, clock, **options
            )
          row[name] = cache[key]
      table[leg] = row
    for name, pol in PRESETS.items():
      if all(q in precisions for q in pol.precisions):
        key = policy_key(name, op)
        if key not in cache:
          try:
            cache[key] = measure_policy(
              pol, op.batch, op.m, op.k, op.n, repeats, overhead, seed, clock, op, precast=precast
            )
          except jax.errors.JaxRuntimeError as e:  # e.g. XLA:CPU has no batched bf16 dot
            cache[key] = None
            unrunnable.append(f"{op.name} under {name}: {str(e).splitlines()[0][:120]}")
            say(f"  cannot time {op.name} under {name} here; its legs will be used")
        if cache[key] is not None:
          table[f"policy:{name}"] = cache[key]
    op_ms[op.name] = table
    save_partial(checkpoint, settings, op_ms, unrunnable)
  op_ms = {op.name: op_ms[op.name] for op in ops}  # forward order, resumed or not

  say("optimizer update")
  optimizer = step.default_optimizer()
  params = variables["params"]
  opt_state = optimizer.init(params)

  update = jax.jit(functools.partial(step.apply_optimizer, optimizer))
  optimizer_ms = max(
    step.timed_ms(lambda: update(params, params, opt_state), repeats, clock=clock)[0] - overhead, 0.0
  )

  say("cast models")
  cast = measure_casts(cast_sizes, repeats=repeats, overhead=overhead, clock=clock, precisions=precisions)

  fits = {  # preset: (wanted, meta name), in the order they are fitted (``refit_to_fit_steps``)
    SIXTEEN_BIT_FIT_PRESET: (fit_16bit, "sixteen_bit"),
    QUANTIZED_FIT_PRESET: (fit_quantized, "quantized"),
  }
  fit_presets_wanted = [
    preset
    for preset, (wanted, *_) in fits.items()
    if wanted and set(PRESETS[preset].precisions) <= set(precisions)
  ]
  fp32 = PrecisionPolicy.uniform("fp32")
  say(f"fit steps: {', '.join(['fp32', *fit_presets_wanted])}, round-robin over {fit_rounds} rounds")
  fit_steps = step.time_train_steps_interleaved(
    task,
    {"fp32": fp32, **{preset: PrecisionPolicy.uniform(preset) for preset in fit_presets_wanted}},
    batch,
    step_repeats,
    fit_rounds,
    clocks=(step_clock,),
    progress=lambda msg: say(f"fit steps: {msg}"),
    skip=(jax.errors.JaxRuntimeError,),  # a backend that cannot run a preset's step
  )[step_clock]
  step_ms, samples, peak = fit_steps["fp32"]
  say("fp32 step trace")
  trace_repeats = max(step_repeats // 2, 3)
  hlo, instruction_ms = steptrace.step_instruction_ms(task, fp32, batch, trace_repeats, seed=seed)
  relayout = steptrace.relayout_ms(hlo, instruction_ms, ops)
  op_ms, relayout_traced = steptrace.with_policy_step_relayouts(task, batch, ops, op_ms, trace_repeats, seed)
  if relayout_traced:
    say(f"relayouts traced in the {', '.join(relayout_traced)} step")
  forward = memtrace.forward_memory(hlo, ops)
  memory = {
    "param_bytes": step.tree_bytes(params),
    "opt_state_bytes": step.tree_bytes(opt_state),
    "batch_bytes": step.tree_bytes(batch),
    "other_bytes": 0,
  }
  draft = Profile(
    task.name,
    device_type,
    "measured",
    batch_per_device,
    tuple(ops),
    op_ms,
    {"fwd": 0.0, "bwd": 0.0},
    optimizer_ms,
    cast,
    memory,
    relayout_ms=relayout,
    forward_headroom=forward.headroom,
    forward_own_bytes=forward.own,
  )
  rest, other = fit_remainder(draft, step_ms, peak)
  memory["other_bytes"] = other
  meta = {
    **versions(),
    "precisions": list(precisions),
    "dispatch_overhead_ms": overhead,
    "fp32_step_ms": step_ms,
    "fp32_step_ms_samples": samples,
    "fp32_xla_peak_bytes": peak,
    "scratch_bytes": True,  # every whole-policy entry records its program's (measure_policy)
    "repeats": repeats,
    "clock": step_clock,
    "op_clock": clock,
    "unrunnable": unrunnable,
    **({"relayout_traced_presets": relayout_traced} if relayout_traced else {}),
    **({"policy_operands": "precast"} if precast else {}),
    **({"op_ms_from": ops_from} if ops_from else {}),
  }
  prof = Profile(
    model=task.name,
    device_type=device_type,
    source="measured",
    batch_per_device=batch_per_device,
    ops=tuple(ops),
    op_ms=op_ms,
    remainder_ms={},
    optimizer_ms=optimizer_ms,
    cast=cast,
    memory=memory,
    meta=meta,
    relayout_ms=relayout,
    forward_headroom=forward.headroom,
    forward_own_bytes=forward.own,
  ).with_remainder(rest)
  if QUANTIZED_FIT_PRESET in fit_steps and clock == step.DEVICE_CLOCK:  # traced: the ops' clock
    int8 = PrecisionPolicy.uniform(QUANTIZED_FIT_PRESET)
    traced = steptrace.op_leg_ms(task, int8, batch, ops, trace_repeats)
    prof = dataclasses.replace(prof, quantized_in_step_ms=traced)
    say(f"int8 step trace: {sum(sum(t.values()) for t in traced.values()):.3f} ms charged to ops")
  fit_ms = {}
  for preset in fit_presets_wanted:
    _, name = fits[preset]
    if preset not in fit_steps:  # its step could not run here (said by the timing)
      unrunnable = [*prof.meta.get("unrunnable", []), f"{preset} step: cannot run on this backend"]
      prof = dataclasses.replace(prof, meta={**prof.meta, "unrunnable": unrunnable})
      continue
    fit_ms[preset], samples, peak = fit_steps[preset]
    prof = dataclasses.replace(prof, meta={**prof.meta, f"{name}_step_ms_samples": samples})
    if preset == SIXTEEN_BIT_FIT_PRESET:
      prof = with_16bit_other_bytes(prof, peak)
  prof = refit_to_fit_steps(prof, fit_ms.get(QUANTIZED_FIT_PRESET), fit_ms.get(SIXTEEN_BIT_FIT_PRESET))
  remove_partial(checkpoint)  # only now: a run killed in the step fits resumes after the ops
  return prof


def with_precast_policies(
  prof: Profile, repeats: int = 10, seed: int = 0, op_clock: str | None = None, progress=None
) -> Profile:
  """``prof`` with its whole-policy entries (``policy:<preset>``) whose activations the step
  converts to a float dtype (``precast_dtypes``: bf16, fp16, int8_fwd's fp16 backward) re-timed
  on the local device with those activations already converted (``planners.op_programs.policy_programs(precast=
  True)``), and ``meta["policy_operands"] = "precast"``; then refitted to the fit steps it
  was fitted to (``refit_to_fit_steps``): the all-bf16 remainder and the fp32 and quantized
  scales move with the re-timed bf16 programs.
  ``op_clock`` as in ``measure_profile``.
  Refuses a profile of another device type."""
  if prof.device_type != local_device_type():
    raise PlanError(
      f"profile of {prof.device_type} cannot be re-timed on this {local_device_type()}. "
      "Fix: run this where the profile was measured (the same device type)."
    )
  clock, overhead = standalone_clock(op_clock, prof.meta.get("op_clock", "wall"))
  say = progress or (lambda msg: None)
  op_ms = {name: dict(table) for name, table in prof.op_ms.items()}
  cache: dict[tuple, dict] = {}
  for i, op in enumerate(prof.ops):
    for entry in sorted(op_ms[op.name]):
      name = entry.removeprefix("policy:")
      if entry == name or name not in PRESETS or precast_dtypes(PRESETS[name]) == (None, None):
        continue
      say(f"[{i + 1}/{len(prof.ops)}] {op.name} under {name}, activations precast")
      key = policy_key(name, op)
      if key not in cache:
        cache[key] = measure_policy(
          PRESETS[name], op.batch, op.m, op.k, op.n, repeats, overhead, seed, clock, op, precast=True
        )
      op_ms[op.name][entry] = cache[key]
  out = dataclasses.replace(prof, op_ms=op_ms, meta={**prof.meta, "policy_operands": "precast"})
  if "sixteen_bit_fit_step_ms" in prof.meta:  # its bf16 programs changed: refit to the same steps
    out = refit_to_fit_steps(out)
  return out


def step_memory(
  task, batch, variables, ops, seed: int = 0, preset: str = "fp32"
) -> tuple[int | None, memtrace.ForwardMemory]:
  """``(XLA peak bytes, the ops' forward memory)`` of the training step of ``task`` on ``batch``
  under the uniform ``preset``, compiled (not run) on the local device
  (``planners.memtrace.forward_memory``)."""
  optimizer = step.default_optimizer()
  opt_state = optimizer.init(variables["params"])
  train_step = step.make_train_step(task, PrecisionPolicy.uniform(preset), optimizer)
  compiled = train_step.lower(variables, opt_state, batch, jax.random.key(seed)).compile()
  return step.xla_peak_bytes(compiled), memtrace.forward_memory(compiled.as_text(), ops)


def other_bytes(prof: Profile, peak_bytes: int | None, preset: str = "fp32") -> int:
  """The memory correction fitted so that the memory model of ``prof`` predicts ``peak_bytes``
  for the uniform ``preset`` plan on one device at the profile's batch: ``other_bytes`` for
  fp32, ``other_bytes_16bit`` for ``SIXTEEN_BIT_FIT_PRESET`` (whose activations are all
  16-bit, so that correction alone applies). 0 without a peak."""
  from planners.graph import GroupCost
  from planners.replay import memory_bytes

  if peak_bytes is None:
    return 0
  key = "other_bytes" if preset == "fp32" else "other_bytes_16bit"
  draft = dataclasses.replace(prof, memory={**prof.memory, key: 0})
  policies = {o.name: PRESETS[preset] for o in prof.ops}
  return int(peak_bytes - memory_bytes(GroupCost("local", draft, policies, prof.batch_per_device)))


def with_16bit_other_bytes(prof: Profile, peak_bytes: int | None) -> Profile:
  """``prof`` with ``memory["other_bytes_16bit"]`` fitted to ``peak_bytes``, XLA's peak of the
  all-bf16 step (``other_bytes``); unchanged without a peak. The replay mixes it with
  ``other_bytes`` by the plan's share of 16-bit activations (``planners.replay.memory_bytes``)."""
  if peak_bytes is None:
    return prof
  memory = {**prof.memory, "other_bytes_16bit": other_bytes(prof, peak_bytes, SIXTEEN_BIT_FIT_PRESET)}
  return dataclasses.replace(
    prof, memory=memory, meta={**prof.meta, "sixteen_bit_xla_peak_bytes": peak_bytes}
  )


def fit_remainder(draft: Profile, step_ms: float, peak_bytes: int | None) -> tuple[float, int]:
  """``(remainder ms, other bytes)``: the measured fp32 step (time, XLA peak) minus what the
  replay of ``draft`` (a profile without remainder) predicts for the same fp32 step on one
  device (``replay.refit_remainder``)."""
  from planners.replay import refit_remainder

  rest = sum(refit_remainder(_one_device(draft), draft, step_ms).remainder_ms.values())
  return rest, other_bytes(draft, peak_bytes)


def refit_to_fit_steps(
  prof: Profile, quantized_ms: float | None = None, sixteen_bit_ms: float | None = None
) -> Profile:
  """``prof`` refitted on one device (``replay.refit_profile``) to its fp32 step
  (``meta["fp32_step_ms"]``) and to the all-bf16 and all-int8 steps given, else to those its
  meta records (``sixteen_bit_fit_step_ms``, ``quantized_fit_step_ms``): the remainder on
  all-bf16 where timed (else fp32), ``fp32_leg_scale`` on fp32, ``quantized_leg_scale`` on
  all-int8."""
  from planners.replay import refit_profile

  meta = prof.meta
  return refit_profile(
    _one_device(prof),
    prof,
    meta["fp32_step_ms"],
    quantized_ms if quantized_ms is not None else meta.get("quantized_fit_step_ms"),
    sixteen_bit_ms if sixteen_bit_ms is not None else meta.get("sixteen_bit_fit_step_ms"),
  )


def _one_device(prof: Profile):
  """The cluster the profile's own fits replay on: one device of its type at its batch."""
  from qsync_jax.cluster import ClusterSpec

  return ClusterSpec.uniform(prof.device_type, 1, prof.batch_per_device, memory_gb=1e3)
