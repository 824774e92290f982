"""The standalone programs the profiler times for one op: its GEMM legs (``leg_fn``) and the
op under a whole op policy (``policy_programs``), built as the runtime runs them
(``qsync_jax.qdot`` / ``qsync_jax.qconv``), and what XLA does with them (``producer_relayout_ms``).
``planners.profiler`` times them into a ``Profile``."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantize import quantize
from planners import memtrace, step, steptrace
from planners.ops import ATTENTION_EINSUMS, OpShape
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.qconv import quantized_conv_general_dilated
from qsync_jax.qdot import FLOAT_DTYPES, Operand, leg_dot, qformat, quantized_dot_general, quantized_einsum


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
    # axis); the leg reuses its values and folds its scale into the gradient (leg_dot)
    x = lhs if saved_is_lhs else rhs
    qvalue, scale = quantize(
      x, qformat(precision, False), (x.ndim - 1 if saved_is_lhs else x.ndim - 2,), "nearest"
    )
    x = (qvalue, scale)
  elif saved:
    x = (lhs if saved_is_lhs else rhs).astype(FLOAT_DTYPES[precision])
  if saved:
    lhs, rhs = (x, rhs) if saved_is_lhs else (lhs, x)

  def role(is_grad):
    return Operand("stochastic" if (stochastic and is_grad) else "nearest", is_grad)

  def f(a, b, key):
    lk, rk = jax.random.split(key)
    return leg_dot(precision, "per_channel", a, b, dims, role(lgrad), role(rgrad), lk, rk)

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
  """``{"fwd": ms, "bwd": ms, "scratch_bytes": bytes}`` of one op under a whole op policy, as
  one program each: the forward alone, and forward + both gradients (``policy_programs``,
  ``precast`` there); bwd = their difference. Captures what XLA does across legs (layouts,
  fusing a dequantized residual into the next product), which standalone legs miss.
  ``scratch_bytes``: the largest library scratch buffer of the forward + gradients program
  (``program_scratch_bytes``)."""
  programs, fwd, (lhs, rhs, key, g) = policy_programs(op_policy, batch, m, k, n, seed, op, precast)
  fwd_prog, fwd_bwd_prog = programs
  t_fwd = step.timed_ms(fwd_prog, repeats, clock=clock)[0]
  t_all = step.timed_ms(fwd_bwd_prog, repeats, clock=clock)[0]
  out = {
    "fwd": max(t_fwd - overhead, 1e-3),
    "bwd": max(t_all - t_fwd, 1e-3),
    "scratch_bytes": float(program_scratch_bytes(fwd_bwd_prog)),
  }
  if jax.devices()[0].platform == "cpu":
    refuses, relayout = producer_relayout_ms(fwd, lhs, rhs, key, g)
    out["refuses_producer"] = float(refuses)
    if relayout is not None:
      out["relayout_ms"] = relayout
  return out


def program_scratch_bytes(program: functools.partial) -> int:
  """The largest library scratch buffer (``planners.memtrace.scratch_bytes``) of an
  argument-free program of ``policy_programs`` (a ``functools.partial`` of a jitted function):
  compiled, not run."""
  return memtrace.scratch_bytes(program.func.lower(*program.args).compile().as_text())


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
  (its conversion is a kernel in the step too). Convolutions likewise (their BatchNorm and
  ReLU neighbours convert; not yet checked against a GPU step)."""
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

  in_dtype, out_dtype = precast_dtypes(op_policy) if precast else (None, None)
  if in_dtype is not None:
    lhs = lhs.astype(in_dtype)
    rhs = rhs.astype(in_dtype) if einsum else rhs

  def fwd(a, b, key):
    if einsum:
      return quantized_einsum(einsum, a, b, op_policy, key, out_dtype=out_dtype)
    if conv:
      strides, padding = conv
      return quantized_conv_general_dilated(
        a,
        b,
        strides,
        padding,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        op_policy=op_policy,
        key=key,
        out_dtype=out_dtype or jnp.float32,
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


def _produced_program(fwd, lhs, rhs, key, g):
  """``(jitted program, its arguments)``: forward + gradients of ``fwd`` whose activation is
  produced in the program from two inputs (``(x + c) · t``, like an activation function of a
  product and its bias)."""
  t = jnp.ones_like(lhs)

  def produced(a, b, c, t, key, g):
    y, vjp = jax.vjp(lambda a, b: fwd((a + c) * t, b, key), a, b)
    return y, vjp(g)

  return jax.jit(produced), (lhs, rhs, jnp.zeros((), lhs.dtype), t, key, g)


def _rerunning_relayouts(hlo: str) -> list[steptrace.Instruction]:
  """The relayout fusions of ``_produced_program``'s compiled text that read the producer's
  input (ENTRY parameter 0) instead of a saved copy."""
  return [fusion for fusion in steptrace.relayout_fusions(hlo) if 0 in fusion.operand_params]


def producer_relayout_ms(fwd, lhs, rhs, key, g, repeats: int = 5) -> tuple[bool, float | None]:
  """``(refuses_producer, ms)``: whether XLA, in a training step, re-runs the producer of the
  op's activation operand to lay the saved activation out for the gradient legs
  (``planners.steptrace``), judged on ``_produced_program``: True when a relayout fusion reads
  the producer's inputs instead of a saved copy (an fp32 op saves the producer's output
  itself, so XLA re-runs the producer; a bf16 copy or an int8 residual is materialized and
  relaid out cheaply); and those fusions' ms per call from XLA:CPU's per-instruction trace
  (the median event of each, times its events per call; None when there is none or another
  profiler session keeps the trace from running). Under fp16 on XLA:CPU such a fusion
  also rounds the re-run activation through fp16 element by element inside the transposing
  loop: in the LM's fp16 step two of them took 3.7 and 7.5 ms against 0.5–0.8 ms for the
  bf16 step's relayouts of a saved copy (``docs/results.md``)."""
  program, args = _produced_program(fwd, lhs, rhs, key, g)
  compiled = program.lower(*args).compile(compiler_options=steptrace.TRACE_OPTIONS)
  names = {fusion.name for fusion in _rerunning_relayouts(compiled.as_text())}
  if not names:
    return False, None
  compiled(*args)
  try:
    events = steptrace.traced_events(lambda: jax.block_until_ready(compiled(*args)), repeats)
  except RuntimeError:  # another profiler session is running
    return True, None
  durations: dict[str, list[float]] = {n: [] for n in names}
  for event in events:
    if event["name"] in names:
      durations[event["name"]].append(event["dur"] / 1e3)
  return True, sum(float(np.median(d)) * len(d) / repeats for d in durations.values() if d) or None
