"""Cost profiles: time of every op × leg × precision, the remainder of the step, casts, memory.

A ``Profile`` is plain data (JSON round trip) tagged with the device and software versions:

* ``op_ms[op][leg][precision]`` — ms of one call of the op's GEMM leg (``fwd``, ``dlhs``,
  ``drhs``) at that precision as the runtime runs it (``qsync_jax.qdot.leg_dot``), *including*
  the conversion of its fp32 operands: XLA fuses those conversions with the product, and
  standalone cast timings do not predict the fused cost (measured: an int8 step predicted
  from pure GEMMs + standalone casts came out at half its measured time). Variants:
  ``"<p>:sr"`` — the gradient operand rounds stochastically; ``"<p>:saved"`` — the forward
  ran at ``p`` too and saved the operand so (bf16/fp16: no conversion; int8/fp8: the leg
  dequantizes and re-quantizes it in one program); ``"<p>:saved:sr"`` — both.
  ``op_ms[op]["policy:<preset>"] = {"fwd": ms, "bwd": ms}`` — the op under a whole preset
  op policy, timed as one forward program and one forward + backward program
  (``measure_policy``); the replay prefers it for ops whose policy is that preset. On XLA:CPU
  it also records ``"refuses_producer"`` (1.0 / 0.0): whether, under that policy, XLA re-runs
  the producer of the op's activation to lay the saved activation out for the gradient legs
  (``refuses_producer``).
* ``relayout_ms`` — per op, the step time of those relayouts of its saved activation,
  measured inside the fp32 step from XLA's per-instruction trace (``planners.steptrace``;
  XLA:CPU only). The replay charges it to the op's drhs leg under fp32 and under policies
  that re-run the producer; standalone timings cannot see it (their operands are inputs).
* ``remainder_ms`` — the rest of the step at fp32 (elementwise ops, norms, loss): the
  measured fp32 step minus the ops (with their relayouts) and the optimizer; split 1 : 2
  between forward and backward. It is a fitted correction and may be negative when
  standalone op timings exceed their cost inside the fused step.
* ``optimizer_ms`` — the optax update.
* ``cast`` — per cast type (``"fp32->bf16"``, ``"fp32->int8"``, ``"int8->fp32"``, and
  ``"fp32->int8:sr"`` for stochastic rounding, …) ``ms = a·numel + b`` fitted by least squares
  on standalone jitted casts, with its relative RMS fit error (``planners.casts``). The replay
  adds a cast node for what no leg converts: int8/fp8 residuals dequantized for the backward
  (``planners.graph``), and the conversions of modeled devices.
* ``memory`` — parameter, optimizer-state and batch bytes, and ``other_bytes``: the XLA peak
  of the fp32 step minus what the replay model accounts for (a fitted correction). What an
  op keeps for its backward inside the step is ``planners.op_memory.kept_bytes``; what its
  forward holds beyond the fp32 op's, ``planners.op_memory.forward_extra_bytes``.
* ``forward_headroom`` — per op, how many bytes below its peak the fp32 step is while the
  op's forward runs (``planners.memtrace``, from the compiled fp32 step's schedule): the
  replay puts a plan's forward transients on top of it.

``measure_profile`` measures all of it on the local device; ``modeled_profile`` derives a
profile for a device not at hand from the catalog (roofline), labelled ``"modeled"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import dequantize, quantize
from planners import catalog, memtrace, step, steptrace
from planners.casts import CAST_TYPES, CastModel, measure_casts, modeled_cast
from planners.ops import ATTENTION_EINSUMS, OpShape, collect_ops
from qsync_jax.errors import PlanError
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import LEGS, PRESETS, QUANTIZED_PRECISIONS, OpPolicy, supported_precisions
from qsync_jax.qconv import quantized_conv_general_dilated
from qsync_jax.qdot import FLOAT_DTYPES, Operand, leg_dot, qformat, quantized_dot_general, quantized_einsum

FORMAT = "qsync-profile/1"


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
      return cls(
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
        meta=obj.get("meta", {}),
        relayout_ms={k: float(v) for k, v in obj.get("relayout_ms", {}).items()},
        forward_headroom={k: int(v) for k, v in obj.get("forward_headroom", {}).items()},
      )
    except (KeyError, TypeError) as e:
      raise PlanError(f"{source}: malformed profile ({e!r}). Fix: re-run `qsync profile`.") from None

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


def leg_operands(leg: str, batch: int, m: int, k: int, n: int):
  """``(lhs shape, rhs shape, dimension_numbers, lhs is grad, rhs is grad)`` of one GEMM leg."""
  shapes = {
    "fwd": ((m, k), (k, n), (1, 0)),
    "dlhs": ((m, n), (k, n), (1, 1)),
    "drhs": ((m, k), (m, n), (0, 0)),
  }
  (ls, rs, (lc, rc)) = shapes[leg]
  roles = {"fwd": (False, False), "dlhs": (True, False), "drhs": (False, True)}[leg]
  if batch > 1:
    return (batch, *ls), (batch, *rs), (((lc + 1,), (rc + 1,)), ((0,), (0,))), *roles
  return ls, rs, (((lc,), (rc,)), ((), ())), *roles


def leg_fn(
  precision: str, leg: str, batch: int, m: int, k: int, n: int, stochastic=False, saved=False, seed: int = 0
):
  """``(jitted f, args)``: one GEMM leg as the runtime runs it (``leg_dot`` on fp32 operands,
  converting them into ``precision`` inside the same program, where XLA fuses the
  conversions with the product). ``stochastic``: the gradient operand rounds stochastically;
  ``saved``: the saved operand of a gradient leg (dlhs: the weight, drhs: the input) is
  already in ``precision`` (a bf16/fp16 forward saved it so)."""
  ls, rs, dims, lgrad, rgrad = leg_operands(leg, batch, m, k, n)
  k1, k2 = jax.random.split(jax.random.key(seed))
  lhs, rhs = jax.random.normal(k1, ls, jnp.float32), jax.random.normal(k2, rs, jnp.float32)
  saved_is_lhs = leg == "drhs"
  if saved and precision in QUANTIZED_PRECISIONS:
    # the forward saved this operand quantized (per channel over its forward contraction
    # axis); the leg dequantizes it and quantizes it again, in one program
    x = lhs if saved_is_lhs else rhs
    qvalue, scale = quantize(
      x, qformat(precision, False), (x.ndim - 1 if saved_is_lhs else x.ndim - 2,), "nearest"
    )
    x = (qvalue, scale)
  elif saved:
    x = (lhs if saved_is_lhs else rhs).astype(FLOAT_DTYPES[precision])
  if saved:
    lhs, rhs = (x, rhs) if saved_is_lhs else (lhs, x)

  def restore(x):
    return dequantize(*x) if isinstance(x, tuple) else x

  def role(is_grad):
    return Operand("stochastic" if (stochastic and is_grad) else "nearest", is_grad)

  def f(a, b, key):
    lk, rk = jax.random.split(key)
    return leg_dot(precision, "per_channel", restore(a), restore(b), dims, role(lgrad), role(rgrad), lk, rk)

  return jax.jit(f), (lhs, rhs, jax.random.key(seed + 1))


def leg_variants(precision: str, leg: str) -> list[tuple[str, dict]]:
  """``[(table key, leg_fn options)]`` timed for one leg at one precision."""
  out = [(precision, {})]
  if leg == "fwd" or precision not in (*FLOAT_DTYPES, *QUANTIZED_PRECISIONS):
    return out
  out.append((f"{precision}:saved", {"saved": True}))
  if precision in QUANTIZED_PRECISIONS:
    out.append((f"{precision}:sr", {"stochastic": True}))
    out.append((f"{precision}:saved:sr", {"saved": True, "stochastic": True}))
  return out


def dispatch_overhead_ms(repeats: int = 50, clock: str = "wall") -> float:
  """ms to dispatch and wait for a trivial jitted program (subtracted from standalone timings)."""
  f = jax.jit(lambda x: x + 1)
  x = jnp.zeros((), jnp.float32)
  return step.timed_ms(lambda: f(x), repeats, clock=clock)[0]


def measure_leg(precision, leg, batch, m, k, n, repeats=10, overhead=0.0, seed=0, clock="wall", **options):
  """Median ms of one leg on ``clock`` (dispatch overhead removed, floored at 1 µs)."""
  f, args = leg_fn(precision, leg, batch, m, k, n, seed=seed, **options)
  return max(step.timed_ms(lambda: f(*args), repeats, clock=clock)[0] - overhead, 1e-3)


def real_dims(op: OpShape):
  """The ``dot_general`` dimension numbers of a weight op on its real operand shapes: Dense,
  DenseGeneral and Embed contract the trailing axes of the input with the leading axes of the
  weight; ``embed_attend`` contracts the last axis with the table's second. None for others
  (conv, einsum: timed as their canonical GEMM)."""
  lhs, rhs = op.lhs_shape, op.rhs_shape
  if op.kind == "embed_attend":
    return (((len(lhs) - 1,), (1,)), ((), ()))
  if op.kind not in ("dense", "dense_general", "embed"):
    return None
  fits = [
    j for j in range(1, min(len(lhs), len(rhs)) + 1) if lhs[-j:] == rhs[:j] and math.prod(rhs[:j]) == op.k
  ]
  if not fits:
    return None
  c = fits[0]
  return ((tuple(range(len(lhs) - c, len(lhs))), tuple(range(c))), ((), ()))


def conv_geometry(op: OpShape):
  """``(strides, padding)`` of a 2-d NHWC conv inferred from its shapes (Flax's default
  layout): stride = input // output size; ``"SAME"`` if the output is ⌈input / stride⌉, else
  ``"VALID"``. None if the shapes do not fit that picture (then the canonical GEMM is timed)."""
  lhs, rhs = op.lhs_shape, op.rhs_shape
  if len(lhs) != 4 or len(rhs) != 4 or lhs[-1] != rhs[2]:
    return None
  n_out = op.out_elems // (lhs[0] * rhs[3])
  for s_ in (1, 2, 3, 4):
    oh, ow = -(-lhs[1] // s_), -(-lhs[2] // s_)
    if oh * ow == n_out:
      return (s_, s_), "SAME"
    vh, vw = (lhs[1] - rhs[0]) // s_ + 1, (lhs[2] - rhs[1]) // s_ + 1
    if vh * vw == n_out:
      return (s_, s_), "VALID"
  return None


def measure_policy(
  op_policy: OpPolicy, batch, m, k, n, repeats=10, overhead=0.0, seed=0, clock="wall", op=None, precast=False
):
  """``{"fwd": ms, "bwd": ms}`` of one op under a whole op policy, as one program each: the
  forward alone, and forward + both gradients (``policy_programs``, ``precast`` there);
  bwd = their difference. Captures what XLA does across legs (layouts, fusing a dequantized
  residual into the next product), which standalone legs miss."""
  programs, fwd, (lhs, rhs, key, g) = policy_programs(op_policy, batch, m, k, n, seed, op, precast)
  fwd_prog, fwd_bwd_prog = programs
  t_fwd = step.timed_ms(fwd_prog, repeats, clock=clock)[0]
  t_all = step.timed_ms(fwd_bwd_prog, repeats, clock=clock)[0]
  out = {"fwd": max(t_fwd - overhead, 1e-3), "bwd": max(t_all - t_fwd, 1e-3)}
  if jax.devices()[0].platform == "cpu":
    out["refuses_producer"] = float(refuses_producer(fwd, lhs, rhs, key, g))
  return out


def precast_dtypes(op_policy: OpPolicy) -> tuple[Any, Any]:
  """``(input dtype, output dtype)`` a product under ``op_policy`` gets its activations in
  when the step's neighbouring kernels convert them (``policy_programs(precast=True)``): the
  forward's float dtype for its activation inputs, the backward legs' float dtype (when both
  share one) for its output and so its output gradient; ``None`` where the op takes fp32 —
  fp32 legs, and quantized legs, whose scaling reads the fp32 values. Uniform bf16 gives
  (bf16, bf16); QSync's int8 op (int8 forward, fp16 backward) gives (None, fp16)."""
  float_bwd = op_policy.dlhs if op_policy.dlhs == op_policy.drhs else None
  return FLOAT_DTYPES.get(op_policy.fwd), FLOAT_DTYPES.get(float_bwd)


def policy_programs(op_policy: OpPolicy, batch, m, k, n, seed=0, op=None, precast=False):
  """``((forward, forward + both gradients), fwd, (lhs, rhs, key, g))``: the two argument-free
  jitted programs ``measure_policy`` times for one op under a whole op policy, the forward
  function and their operands. The gradients come from ``jax.vjp`` of
  ``quantized_dot_general``. Given ``op`` (an ``OpShape`` with its operand shapes), attention
  products run their real einsum and weight ops their real operand shapes (``real_dims``): on
  XLA:CPU an int8 Dense on a 3-d input ran 10× faster than on the same data flattened to 2-d.

  ``precast``: the activations come in the dtypes the training step converts them to
  (``precast_dtypes``), as if the ops around this one had converted them: in a GPU training
  step those conversions run fused into neighbouring elementwise kernels, while a standalone
  program runs them as kernels of their own (on an H100 the bf16 programs of a BERT-base-wide
  LM summed to 1.8× the step's bf16 products, ``docs/results.md``). The weight stays fp32
  (its conversion is a kernel in the step too)."""
  ls, rs, dims, _, _ = leg_operands("fwd", batch, m, k, n)
  einsum = ATTENTION_EINSUMS.get(op.kind) if op is not None and op.lhs_shape else None
  if einsum:
    ls, rs = op.lhs_shape, op.rhs_shape
  elif op is not None and op.lhs_shape and (real := real_dims(op)) is not None:
    ls, rs, dims = op.lhs_shape, op.rhs_shape, real
  conv = conv_geometry(op) if op is not None and op.kind == "conv" and op.lhs_shape else None
  if conv:
    ls, rs = op.lhs_shape, op.rhs_shape
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  lhs, rhs = jax.random.normal(k1, ls, jnp.float32), jax.random.normal(k2, rs, jnp.float32)
  key = jax.random.key(seed + 1)

  in_dtype, out_dtype = precast_dtypes(op_policy) if precast and not conv else (None, None)
  if in_dtype is not None:
    lhs = lhs.astype(in_dtype)
    rhs = rhs.astype(in_dtype) if einsum else rhs

  def fwd(a, b, key):
    if einsum:
      return quantized_einsum(einsum, a, b, op_policy, key, out_dtype=out_dtype)
    if conv:
      strides, padding = conv
      return quantized_conv_general_dilated(
        a, b, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"), op_policy=op_policy, key=key
      )
    return quantized_dot_general(a, b, dims, op_policy, key, out_dtype=out_dtype)

  out = jax.eval_shape(fwd, lhs, rhs, key)
  g = jax.random.normal(k3, out.shape).astype(out.dtype)

  def fwd_bwd(a, b, key, g):
    y, vjp = jax.vjp(lambda a, b: fwd(a, b, key), a, b)
    return y, vjp(g)

  programs = (
    functools.partial(jax.jit(fwd), lhs, rhs, key),
    functools.partial(jax.jit(fwd_bwd), lhs, rhs, key, g),
  )
  return programs, fwd, (lhs, rhs, key, g)


def refuses_producer(fwd, lhs, rhs, key, g) -> bool:
  """Whether XLA, in a training step, re-runs the producer of the op's activation operand to
  lay the saved activation out for the gradient legs (``planners.steptrace``), judged on the
  compiled forward + backward of ``fwd`` whose activation is produced in the program from
  two inputs (``(x + c) · t``, like an activation function of a product and its bias): True
  when a relayout fusion reads the producer's inputs instead of a saved copy. An fp32 op saves
  the producer's output itself, so XLA re-runs the producer; a bf16 copy or an int8 residual
  is materialized and relaid out cheaply."""
  t = jnp.ones_like(lhs)

  def produced(a, b, c, t, key, g):
    y, vjp = jax.vjp(lambda a, b: fwd((a + c) * t, b, key), a, b)
    return y, vjp(g)

  args = (lhs, rhs, jnp.zeros((), lhs.dtype), t, key, g)
  hlo = jax.jit(produced).lower(*args).compile().as_text()
  return any(0 in fusion.operand_params for fusion in steptrace.relayout_fusions(hlo))


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


def _train_kwargs(task) -> dict:
  """Keyword arguments of the task's training-mode ``apply`` (mutable collections included)."""
  return {**task.train_kwargs, **({"mutable": list(task.mutable)} if task.mutable else {})}


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
  step_repeats: int = 20,
  progress: Callable[[str], None] | None = None,
  seed: int = 0,
  cast_sizes: Sequence[int] = (2**14, 2**16, 2**18, 2**20),
  clock: str = "wall",
  op_clock: str | None = None,
) -> Profile:
  """Measures the profile of ``task`` at ``batch_per_device`` on the local device.

  Every timing warms up, then takes the median of its repeats on ``clock`` (``wall``, or
  ``cpu``: process CPU time, steadier on a CPU host shared with other work) — the fp32 step
  always, and the standalone programs (op legs and policies, optimizer, casts) on
  ``op_clock``: by default the device clock on a GPU (``step.DEVICE_CLOCK``: their kernel time,
  no dispatch overhead to subtract), else ``clock``.
  """
  say = progress or (lambda msg: None)
  device_type = local_device_type()
  precisions = tuple(precisions or supported_precisions(device_type))
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(batch_per_device, seed)))
  variables = step.init_variables(task, batch, seed)
  ops = collect_ops(task.model, variables, *task.inputs(batch), **_train_kwargs(task))
  step_clock = clock
  clock, overhead = standalone_clock(op_clock, clock)  # from here on: the standalone programs
  say(
    f"{len(ops)} quantizable ops; standalone programs on the {clock} clock, dispatch overhead {overhead:.3f} ms"
  )

  cache: dict[tuple, Any] = {}
  unrunnable: list[str] = []
  op_ms = {}
  for i, op in enumerate(ops):
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
            cache[key] = measure_policy(pol, op.batch, op.m, op.k, op.n, repeats, overhead, seed, clock, op)
          except jax.errors.JaxRuntimeError as e:  # e.g. XLA:CPU has no batched bf16 dot
            cache[key] = None
            unrunnable.append(f"{op.name} under {name}: {str(e).splitlines()[0][:120]}")
            say(f"  cannot time {op.name} under {name} here; its legs will be used")
        if cache[key] is not None:
          table[f"policy:{name}"] = cache[key]
    op_ms[op.name] = table

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

  say("fp32 training step")
  fp32 = PrecisionPolicy.uniform("fp32")
  step_ms, samples, peak = step.time_train_step(task, fp32, batch, step_repeats, clock=step_clock)
  hlo, instruction_ms = steptrace.step_instruction_ms(task, fp32, batch, max(step_repeats // 2, 3), seed=seed)
  relayout = steptrace.relayout_ms(hlo, instruction_ms, ops)
  headroom = memtrace.forward_headroom(hlo, ops)
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
    forward_headroom=headroom,
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
    "repeats": repeats,
    "clock": step_clock,
    "op_clock": clock,
    "unrunnable": unrunnable,
  }
  return Profile(
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
    forward_headroom=headroom,
  ).with_remainder(rest)


def with_precast_policies(
  prof: Profile, repeats: int = 10, seed: int = 0, op_clock: str | None = None, progress=None
) -> Profile:
  """``prof`` with its whole-policy entries (``policy:<preset>``) whose activations the step
  converts to a float dtype (``precast_dtypes``: bf16, fp16, int8_fwd's fp16 backward) re-timed
  on the local device with those activations already converted (``policy_programs(precast=
  True)``), and ``meta["policy_operands"] = "precast"``; nothing else changes (the remainder
  stays fitted on fp32, whose programs are the same). ``op_clock`` as in ``measure_profile``.
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
  return dataclasses.replace(prof, op_ms=op_ms, meta={**prof.meta, "policy_operands": "precast"})


def fit_remainder(draft: Profile, step_ms: float, peak_bytes: int | None) -> tuple[float, int]:
  """``(remainder ms, other bytes)``: the measured fp32 step (time, XLA peak) minus what the
  replay of ``draft`` (a profile without remainder) predicts for the same fp32 step on one
  device (``replay.refit_remainder``)."""
  from planners.graph import GroupCost
  from planners.replay import memory_bytes, refit_remainder
  from qsync_jax.cluster import ClusterSpec

  one = ClusterSpec.uniform(draft.device_type, 1, draft.batch_per_device, memory_gb=1e3)
  rest = sum(refit_remainder(one, draft, step_ms).remainder_ms.values())
  fp32 = {o.name: OpPolicy.uniform("fp32") for o in draft.ops}
  group = GroupCost("local", draft, fp32, draft.batch_per_device)
  other = 0 if peak_bytes is None else int(peak_bytes - memory_bytes(group))
  return rest, other


def traced_profile(task, batch_per_device: int, seed: int = 0) -> Profile:
  """A profile with the ops and memory of ``task`` but no timings (``source="traced"``):
  the base ``modeled_profile`` costs. Compiles the fp32 step once (nothing is timed)."""
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(batch_per_device, seed)))
  variables = step.init_variables(task, batch, seed)
  ops = tuple(collect_ops(task.model, variables, *task.inputs(batch), **_train_kwargs(task)))
  optimizer = step.default_optimizer()
  opt_state = optimizer.init(variables["params"])
  memory = {
    "param_bytes": step.tree_bytes(variables["params"]),
    "opt_state_bytes": step.tree_bytes(opt_state),
    "batch_bytes": step.tree_bytes(batch),
    "other_bytes": 0,
  }
  train_step = step.make_train_step(task, PrecisionPolicy.uniform("fp32"), optimizer)
  compiled = train_step.lower(variables, opt_state, batch, jax.random.key(seed)).compile()
  peak = step.xla_peak_bytes(compiled)
  headroom = memtrace.forward_headroom(compiled.as_text(), ops)
  skeleton = Profile(
    task.name,
    local_device_type(),
    "traced",
    batch_per_device,
    ops,
    {},
    {},
    0.0,
    {},
    memory,
    forward_headroom=headroom,
  )
  if peak is not None:
    from planners.graph import GroupCost
    from planners.replay import memory_bytes

    fp32 = {o.name: OpPolicy.uniform("fp32") for o in ops}
    memory["other_bytes"] = int(peak - memory_bytes(GroupCost("local", skeleton, fp32, batch_per_device)))
  return dataclasses.replace(skeleton, meta={**versions(), "fp32_xla_peak_bytes": peak})


# -- modeled profiles -------------------------------------------------------------------------

ELEMENTWISE_PASSES = 12
"""Modeled remainder: fp32 passes over every op output per step (≈ 4 forward, 8 backward)."""


def modeled_profile(base: Profile, device_type: str) -> Profile:
  """The profile of ``base``'s model on ``device_type`` from the catalog (roofline)."""
  spec = catalog.device_spec(device_type)
  casts = {c: modeled_cast(spec, c) for c in CAST_TYPES}
  op_ms = {}
  for op in base.ops:
    table = {}
    for leg in LEGS:
      b, m, k, n = (
        op.batch,
        *{"fwd": (op.m, op.k, op.n), "dlhs": (op.m, op.n, op.k), "drhs": (op.k, op.m, op.n)}[leg],
      )
      row = {}
      for p in spec.peak_tflops:
        t = catalog.gemm_roofline_ms(spec, p, m, k, n, b)
        if p not in ("fp32", "tf32"):  # the leg converts its two fp32 operands
          t += casts[f"fp32->{p}"].ms(b * m * k) + casts[f"fp32->{p}"].ms(b * k * n)
        row[p] = t
      table[leg] = row
    op_ms[op.name] = table
  out_bytes = sum(4 * o.out_elems * o.calls for o in base.ops)
  rest = ELEMENTWISE_PASSES * out_bytes / (spec.mem_bw_gbps * 1e9 * spec.derate) * 1e3
  opt_bytes = 7 * base.memory["param_bytes"]  # adam reads p, g, m, v and writes p, m, v
  optimizer_ms = opt_bytes / (spec.mem_bw_gbps * 1e9 * spec.derate) * 1e3 + spec.launch_us * 1e-3
  memory = dict(base.memory)
  return Profile(
    model=base.model,
    device_type=device_type,
    source="modeled",
    batch_per_device=base.batch_per_device,
    ops=base.ops,
    op_ms=op_ms,
    remainder_ms={},
    optimizer_ms=optimizer_ms,
    cast=casts,
    memory=memory,
    meta={"derived_from": base.device_type, "catalog": dataclasses.asdict(spec)},
  ).with_remainder(rest)
