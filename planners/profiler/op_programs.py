"""The standalone programs the profiler times: an op's GEMM legs (``leg_fn``), the op under a
whole op policy (``policy_programs``) and the conversions (``cast_fn``), built as the runtime
runs them (``qsync_jax.ops.qdot`` / ``qsync_jax.ops.qconv`` / ``pallas_kernels.quantize``).
``planners.profiler.measure`` times them into a ``Profile``."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import dequantize, quantize
from planners.ops import ATTENTION_EINSUMS, OpShape
from planners.profile import CAST_TYPES, CastModel, cast_precisions
from planners.profiler.fit import fit_cast_model
from planners.profiler.timing import timed_ms
from qsync_jax.ops.qconv import quantized_conv_general_dilated
from qsync_jax.ops.qdot import (
  FLOAT_DTYPES,
  Operand,
  leg_dot,
  qformat,
  quantized_dot_general,
  quantized_einsum,
)
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy


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


def leg_fn(precision: str, leg: str, batch: int, m: int, k: int, n: int, seed: int = 0):
  """``(jitted f, args)``: one GEMM leg as the runtime runs it (``leg_dot`` on fp32 operands,
  converting them into ``precision`` inside the same program, where XLA fuses the
  conversions with the product)."""
  ls, rs, dims, lgrad, rgrad = leg_operands(leg, batch, m, k, n)
  k1, k2 = jax.random.split(jax.random.key(seed))
  lhs, rhs = jax.random.normal(k1, ls, jnp.float32), jax.random.normal(k2, rs, jnp.float32)

  def f(a, b, key):
    lk, rk = jax.random.split(key)
    return leg_dot(
      precision, "per_channel", a, b, dims, Operand("nearest", lgrad), Operand("nearest", rgrad), lk, rk
    )

  return jax.jit(f), (lhs, rhs, jax.random.key(seed + 1))


def dispatch_overhead_ms(repeats: int = 50, clock: str = "wall") -> float:
  """ms to dispatch and wait for a trivial jitted program (subtracted from standalone timings)."""
  f = jax.jit(lambda x: x + 1)
  x = jnp.zeros((), jnp.float32)
  return timed_ms(lambda: f(x), repeats, clock=clock)[0]


def measure_leg(precision, leg, batch, m, k, n, repeats=10, overhead=0.0, seed=0, clock="wall"):
  """Median ms of one leg on ``clock`` (dispatch overhead removed, floored at 1 µs)."""
  f, args = leg_fn(precision, leg, batch, m, k, n, seed=seed)
  return max(timed_ms(lambda: f(*args), repeats, clock=clock)[0] - overhead, 1e-3)


def real_dims(op: OpShape):
  """The ``dot_general`` dimension numbers of a weight op on its real operand shapes (Dense,
  DenseGeneral, Embed: the input's trailing axes with the weight's leading ones; ``embed_attend``:
  the last axis with the table's second); None for others (timed as their canonical GEMM)."""
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
  forward alone, and forward + both gradients (``policy_programs``, ``precast`` there); bwd =
  their difference. Captures what XLA does across legs (layouts, fusing a dequantized residual
  into the next product), which standalone legs miss."""
  fwd_prog, fwd_bwd_prog = policy_programs(op_policy, batch, m, k, n, seed, op, precast)
  t_fwd = timed_ms(fwd_prog, repeats, clock=clock)[0]
  t_all = timed_ms(fwd_bwd_prog, repeats, clock=clock)[0]
  return {"fwd": max(t_fwd - overhead, 1e-3), "bwd": max(t_all - t_fwd, 1e-3)}


def precast_dtypes(op_policy: OpPolicy) -> tuple[Any, Any]:
  """``(input dtype, output dtype)`` a product under ``op_policy`` gets its activations in
  when the step's neighbouring kernels convert them (``policy_programs(precast=True)``): the
  forward's float dtype for its activation inputs, the backward legs' float dtype (when both
  share one) for its output and so its output gradient; ``None`` where the op takes its
  activations as they come, at its model's dtype — fp32 legs, and quantized legs, whose scaling
  reads them as they are. Uniform bf16 gives (bf16, bf16); QSync's int8 op (int8 forward, fp16
  backward) gives (None, fp16)."""
  float_bwd = op_policy.dlhs if op_policy.dlhs == op_policy.drhs else None
  return FLOAT_DTYPES.get(op_policy.fwd), FLOAT_DTYPES.get(float_bwd)


def policy_programs(op_policy: OpPolicy, batch, m, k, n, seed=0, op=None, precast=False):
  """``(forward, forward + both gradients)``: the two argument-free jitted programs
  ``measure_policy`` times for one op under a whole op policy. The gradients come from ``jax.vjp`` of
  ``quantized_dot_general``. Given ``op`` (an ``OpShape`` with its operand shapes), attention
  products run their real einsum, convolutions their real convolution and weight ops their
  real operand shapes (``real_dims``), else the canonical GEMM. Both operands are drawn at the
  op's model dtype (``op.activation_dtype``, float32 without ``op``): a Flax module converts its
  weight to its dtype before the product, so a bf16 model's op gets bf16 operands and returns
  bf16.

  ``precast``: the activations come in the dtypes the training step converts them to
  (``precast_dtypes``), as if the ops around this one had converted them: in a GPU training
  step those conversions are fused into neighbouring elementwise kernels, while a standalone
  program runs them as kernels of their own. The weight stays fp32 (its conversion is a
  kernel in the step too)."""
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
  dtype = jnp.dtype(op.activation_dtype if op is not None else "float32")
  lhs, rhs = jax.random.normal(k1, ls, dtype), jax.random.normal(k2, rs, dtype)
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
        out_dtype=out_dtype or dtype,
      )
    return quantized_dot_general(a, b, dims, op_policy, key, out_dtype=out_dtype)

  out = jax.eval_shape(fwd, lhs, rhs, key)
  g = jax.random.normal(k3, out.shape).astype(out.dtype)

  def fwd_bwd(a, b, key, g):
    y, vjp = jax.vjp(lambda a, b: fwd(a, b, key), a, b)
    return y, vjp(g)

  return (
    functools.partial(jax.jit(fwd), lhs, rhs, key),
    functools.partial(jax.jit(fwd_bwd), lhs, rhs, key, g),
  )


def cast_fn(cast_type: str):
  """``(f, input dtype)``: the jitted-to-be conversion of a cast type (``planners.profile.CAST_TYPES``)
  as the runtime runs it."""
  src, dst = cast_precisions(cast_type)
  if dst in QUANTIZED_PRECISIONS:  # two passes: absmax, then scale and round
    fmt = qformat(dst, False)
    return lambda x: quantize(x, fmt, tuple(range(x.ndim)), "nearest", None), jnp.float32
  if src in QUANTIZED_PRECISIONS:
    scale = jnp.ones((1,), jnp.float32)
    return lambda x: dequantize(x, scale), jnp.int8 if src == "int8" else jnp.float8_e4m3fn
  return lambda x: x.astype(FLOAT_DTYPES[dst]), jnp.float32


def measure_casts(
  sizes=(2**14, 2**16, 2**18, 2**20), repeats=10, overhead=0.0, clock="wall", precisions=None
) -> dict[str, CastModel]:
  """A fitted ``CastModel`` per cast type (those between ``precisions``, default all), from
  standalone jitted casts of ``sizes`` elements."""
  models = {}
  for cast_type in CAST_TYPES:
    if precisions is not None and not set(cast_precisions(cast_type)) <= {"fp32", *precisions}:
      continue
    fn, dtype = cast_fn(cast_type)
    f = jax.jit(fn)
    times = []
    for size in sizes:
      x = jax.random.normal(jax.random.key(size), (size,), jnp.float32).astype(dtype)
      times.append(max(timed_ms(lambda f=f, x=x: f(x), repeats, clock=clock)[0] - overhead, 1e-4))
    models[cast_type] = fit_cast_model(sizes, times)
  return models
