"""Delayed (amax-history) scaling of every Dense against the library's dynamic scaling: the e2e GPT step.

  python -m benchmarks.diagnosis.delayed_scaling [--widths 768,1024,2048,4096]
      [--variants bf16,int8_dynamic,int8_delayed,int8_delayed_fused,fp8_dynamic,fp8_delayed,fp8_delayed_fused]
      [--rounds 8] [--repeats 5] [--budget-s S] [--cpu] [--out-jsonl PATH]

The model, batch and optimizer are ``benchmarks.e2e``'s GPT cells (``benchmarks.common.zoo.e2e_gpt``:
8192 tokens a step, AdamW), every attention at bf16 through cuDNN's fused kernel. Variants:

* ``bf16``: e2e's ``plain_cudnn_attn`` cell (the baseline of every ratio);
* ``int8_dynamic`` / ``fp8_dynamic``: e2e's ``int8_dense_fused_attn`` / ``fp8_dense_fused_attn``:
  every Dense at the ``int8`` / ``fp8`` preset (``qsync_jax.ops.qdot``: a quantize pass reads each
  operand for its per-channel absmax, then quantizes it);
* ``int8_delayed`` / ``fp8_delayed``: every Dense through ``delayed_matmul``: the activation X
  and the gradient dY each quantized per tensor with a scale from an amax history of earlier
  steps (``HISTORY`` long, scale = max(history) / format max, as Transformer Engine's delayed
  scaling), the weight per channel at the step's own absmax as the preset does, the GEMMs
  the dynamic path's (``pallas_kernels.gemm.scaled_dot_general``, through ``qdot.gemm_8bit``);
* ``int8_delayed_fused`` / ``fp8_delayed_fused``: every Dense through ``fused_delayed_matmul``:
  X and dY quantized per tensor at history scales by the library's fused kernels, which also
  write the tensor's amax (``pallas_kernels.quantize.delayed``: ``quantize_both_at`` writes X in
  both GEMM layouts, ``quantize_pair_at`` dY for both gradient GEMMs), so no pass reads X or dY
  for its amax; the weight per channel at the step's own absmax, as the library quantizes it
  (``quantize_both``), its scale folded into dY for dX as the library folds it.

``delayed_matmul(x, w, history, key, spec)`` for ``x [M, K]``, ``w [K, N]`` is equivalent to::

    s_x = max(history["x"]) / qmax_x              # 1 while the history is all zeros
    y = (Q(x / s_x) · Q_percol(w)) * s_x          # Q: round_to_format, no absmax pass over x
    # backward, dY of the step:
    s_g = max(history["dy"]) / qmax_dy
    dx = (Q(dY / s_g) · Q_perrow(w)ᵀ) * s_g       # w quantized again along N (small)
    dw = (Q(x / s_x)ᵀ · Q(dY / s_g)) * s_x * s_g
    # the cotangent of ``history`` is the new history: each one shifted by one, this step's
    # max|x| / max|dY| first (Flax's fp8_ops carries its amax out of the backward pass so)

``fused_delayed_matmul(x, w, history, key, spec)`` is equivalent to::

    q_x = Q(x / s_x); q_w, s_w = Q_percol(w)          # s_x as above; s_w [N] (dynamic)
    y = (q_x · q_w) * s_x * s_w
    # backward: dY quantized twice in one pass, each at its own history's scale
    s_g = max(history["dy"]) / qmax_dy;  s_gw = max(history["dy_w"]) / qmax_dy
    dx = (Q((dY ⊙ s_w) / s_gw) · q_wᵀ) * s_gw           # W's scale folded into dY
    dw = (q_xᵀ · Q(dY / s_g)) * s_x * s_g
    # new histories: max|x|, max|dY|, max|dY ⊙ s_w| first, from the kernels' side outputs

X rounds to nearest and dY as the preset rounds gradients (the int8 preset: stochastically,
with the dynamic path's noise stream, ``pallas_kernels.quantize.noise``); every quantization
of X and dY is plain jnp, which XLA may fuse into the tensor's producer, and this step's amax
is a reduction beside it. The training step differentiates the loss by the histories too and
keeps the cotangents as the next step's histories. With an empty history a scale is 1: a
delayed variant's first call calibrates its histories with a step whose update it discards
(``build_cell``).

Each variant's row also counts, in the step's program with the GPU kernels (on a machine without
them, a trace with the kernels forced as on an H100; ``absmax_passes``), the max-reductions XLA
runs outside the kernels over tensors computed from the batch (X, dY, the logits; not the
weights) and the separate absmax kernels (``quantize_pair_absmax``); the table prints them
against bf16's (``max-red``).

Per width the variants are built (compile time: trace + lower + XLA compile + the first
call), then timed round-robin (``planners.profiler.timing.time_round_robin``: ``--rounds``
rounds of ``--repeats`` steps dispatched back to back on a GPU; median and interquartile
range over the rounds), the fp8 variants after every width's int8 ones. Each delayed variant
also reports what its histories hold after the timed steps and ``dense_numerics``: one
Dense (the MLP's up projection at the width, 8192 tokens of random normal inputs, fresh
each step) run for ``NUMERIC_STEPS`` steps carrying its history, its output and both
gradients' relative error against the float product and against the dynamic op, and whether
the history changed every step. Rows (``step_ms``, ``ratio`` = step / bf16's step of the same
width; ``dense_rel_err``) go to ``--out-jsonl`` (default ``benchmarks/results/delayed_scaling.jsonl``)
and, where ``$OUT`` is set, to ``$OUT/delayed_scaling.jsonl``; a table prints last.
``--budget-s`` skips a width's group that would not end in time (estimated from what was
measured, or ``ESTIMATE_S`` on a GPU). ``--cpu`` (or a CPU platform) runs a tiny GPT and
Dense, the kernels' jnp references.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import math
import os
import sys
import time
import traceback
import unittest.mock
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import e2e
from benchmarks.common.e2e_inspect import jaxpr_stats
from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.common.zoo import e2e_gpt
from pallas_kernels.gemm import api as gemm_api
from pallas_kernels.quantize import api as quantize_api
from pallas_kernels.quantize import quantize_both
from pallas_kernels.quantize.delayed import quantize_both_at, quantize_pair_at
from pallas_kernels.quantize.noise import stream_keys, uniform_noise
from pallas_kernels.quantize.reference import QFORMATS, round_to_format, scale_from_absmax
from planners.profiler import timing
from qsync_jax.models.flax_quant import module_path
from qsync_jax.ops.qattention import fused_attention
from qsync_jax.ops.qdot import Operand, gemm_8bit, qformat, quantize_operand, quantized_dot_general
from qsync_jax.ops.quant_ops import RNG_COLLECTION
from qsync_jax.precision import OpPolicy
from qsync_jax.train.task_step import task_loss

RESULTS = results_path("delayed_scaling")
HISTORY = 16
"""Steps of amax history behind each delayed scale."""
CALIBRATION_STEPS = 16
"""Calibration steps of a delayed variant before its training (``build_cell``). An empty history
gives scale 1, at which int8 rounds the gradients to garbage; their amaxes, in every layer below,
would set too coarse a scale for ``HISTORY`` steps. Each calibration step takes its scales from
the newest amaxes of the one before: the head's gradient is exact, and each step sets the scales
right one layer further down."""
NUMERIC_STEPS = 4
NUMERIC_TOKENS, NUMERIC_TOKENS_TINY = 8192, 128
"""Tokens of ``dense_numerics``'s Dense: the e2e GPT's step, and the tiny GPT's."""
VARIANTS = (
  "bf16",
  "int8_dynamic",
  "int8_delayed",
  "int8_delayed_fused",
  "fp8_dynamic",
  "fp8_delayed",
  "fp8_delayed_fused",
)
E2E_POLICY = {"bf16": "plain_cudnn_attn", "int8": "int8_dense_fused_attn", "fp8": "fp8_dense_fused_attn"}
"""The ``benchmarks.e2e`` policy of the baseline and of each dynamic variant."""
ATTENTION_POLICY = e2e.kinds_policy("bf16", e2e.ATTENTION_KINDS)
"""The delayed variants' attention: bf16, fused (cuDNN), as in ``plain_cudnn_attn``."""
ESTIMATE_S = {
  "bf16": 25,
  "int8_dynamic": 40,
  "int8_delayed": 45,
  "int8_delayed_fused": 45,
  "fp8_dynamic": 50,
  "fp8_delayed": 55,
  "fp8_delayed_fused": 55,
}
"""Seconds a variant is assumed to take on a GPU (build, timing, numerics) before one was measured."""


# -- delayed scaling ----------------------------------------------------------------------------


class DelayedSpec(NamedTuple):
  """How ``delayed_matmul`` quantizes: ``precision`` ``int8`` or ``fp8`` (e4m3 X and W, e5m2 dY),
  X's and W's rounding, dY's rounding; ``fused``: through ``fused_delayed_matmul``."""

  precision: str
  rounding: str
  grad_rounding: str
  fused: bool = False

  @property
  def needs_rng(self) -> bool:
    return "stochastic" in (self.rounding, self.grad_rounding)


def delayed_spec(precision: str, fused: bool = False) -> DelayedSpec:
  """The spec of the ``precision`` preset's formats and roundings (``OpPolicy.preset``)."""
  preset = OpPolicy.preset(precision)
  return DelayedSpec(precision, preset.rounding, preset.grad_rounding, fused)


def empty_history(fused: bool = False) -> dict[str, jax.Array]:
  """One Dense's histories before its first step: ``{"x": zeros, "dy": zeros}`` of ``HISTORY``
  (``fused``: also ``"dy_w"``, the amaxes of dY with W's scale folded in)."""
  names = ("x", "dy", "dy_w") if fused else ("x", "dy")
  return {name: jnp.zeros((HISTORY,), jnp.float32) for name in names}


def history_scale(history: jax.Array, fmt: str) -> jax.Array:
  """``max(history) / qmax`` of ``fmt`` as a ``[1, 1]`` float32 scale (1 where the history is 0)."""
  return scale_from_absmax(jnp.max(history), QFORMATS[fmt][1]).reshape(1, 1)


def push_amax(history: jax.Array, x: jax.Array) -> jax.Array:
  """``history`` shifted by one, ``max|x|`` first (float32)."""
  return push(history, jnp.max(jnp.abs(x)))


def push(history: jax.Array, amax: jax.Array) -> jax.Array:
  """``history`` shifted by one, the scalar ``amax`` first (float32)."""
  return jnp.roll(history, 1).at[0].set(amax.astype(jnp.float32))


def quantize_with(x: jax.Array, scale: jax.Array, fmt: str, rounding: str, key) -> jax.Array:
  """``round(clip(x / scale))`` in ``fmt`` (``round_to_format``; plain jnp, no reduction)."""
  noise = uniform_noise(key, x.shape) if rounding == "stochastic" else None
  return round_to_format(x.astype(jnp.float32) / scale, fmt, rounding, noise=noise)


def _weight_operand(w: jax.Array, spec: DelayedSpec, contract: int):
  """``w [K, N]`` quantized per channel along axis ``contract`` as the preset quantizes a
  weight (``qdot.quantize_operand``, the dynamic path's kernel): ``(qvalue, scale, axes)``."""
  return quantize_operand(w, None, spec.precision, "per_channel", Operand(spec.rounding, False), (contract,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def delayed_matmul(x, w, history, key, spec: DelayedSpec, out_dtype):
  """``x [M, K] · w [K, N]`` with delayed scaling (see the module docstring); ``out_dtype``
  result. ``key``: the noise of stochastic rounding (None where ``spec`` rounds to nearest)."""
  return _delayed_fwd(x, w, history, key, spec, out_dtype)[0]


def _delayed_fwd(x, w, history, key, spec, out_dtype):
  fmt_x = qformat(spec.precision, False)
  s_x = history_scale(history["x"], fmt_x)
  q_x = quantize_with(x, s_x, fmt_x, spec.rounding, None)
  y = gemm_8bit((q_x, s_x, (0, 1)), _weight_operand(w, spec, 0), (((1,), (0,)), ((), ())), out_dtype)
  new_x = push_amax(history["x"], x)
  return y, (q_x, s_x, w, history["dy"], new_x, key, jnp.zeros((), x.dtype))


def _delayed_bwd(spec, out_dtype, residuals, g):
  del out_dtype
  q_x, s_x, w, dy_history, new_x, key, x_proto = residuals
  fmt_g = qformat(spec.precision, True)
  s_g = history_scale(dy_history, fmt_g)
  q_g = quantize_with(g, s_g, fmt_g, spec.grad_rounding, key)
  g_op = (q_g, s_g, (0, 1))
  dx = gemm_8bit(g_op, _weight_operand(w, spec, 1), (((1,), (1,)), ((), ())), x_proto.dtype)
  dw = gemm_8bit((q_x, s_x, (0, 1)), g_op, (((0,), (0,)), ((), ())), w.dtype)
  return dx, dw, {"x": new_x, "dy": push_amax(dy_history, g)}, None


delayed_matmul.defvjp(_delayed_fwd, _delayed_bwd)

_ROWS, _COLS = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))
"""``x [M, K] · w [K, N]``'s dimension numbers; dX's, ``dY [M, N] · w [K, N]`` over N."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused_delayed_matmul(x, w, history, key, spec: DelayedSpec, out_dtype):
  """``delayed_matmul`` with X and dY quantized by the fused kernels at history scales, their
  amaxes from the kernels' side outputs (the module docstring); ``history`` has ``"x"``, ``"dy"``
  and ``"dy_w"`` (``empty_history(fused=True)``)."""
  return _fused_fwd(x, w, history, key, spec, out_dtype)[0]


def _fused_fwd(x, w, history, key, spec, out_dtype):
  k_x, k_w, k_g = stream_keys(key, 3)
  fmt = qformat(spec.precision, False)
  (q_x, s_x), (q_xt, _), amax_x = quantize_both_at(
    x, fmt, history_scale(history["x"], fmt), spec.rounding, k_x, contract_axes=(1,)
  )
  (q_w, s_w), w_res = quantize_both(w, fmt, (0,), spec.rounding, k_w, contract_axes=(0,))
  y = gemm_8bit((q_x, s_x, (0, 1)), (q_w, s_w, (1, 0)), _ROWS, out_dtype)
  protos = (jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))
  return y, ((q_xt, s_x), w_res, history["dy"], history["dy_w"], push(history["x"], amax_x), k_g, protos)


def _fused_bwd(spec, out_dtype, residuals, g):
  del out_dtype
  (q_xt, s_x), (q_wt, s_w), dy_history, dyw_history, new_x, key, (x_proto, w_proto) = residuals
  fmt_g = qformat(spec.precision, True)
  scales = (history_scale(dyw_history, fmt_g), history_scale(dy_history, fmt_g))
  (q_dl, s_dl), (q_dr, s_dr), (amax_dyw, amax_dy) = quantize_pair_at(
    g, fmt_g, 1, scales, spec.grad_rounding, key, in_scales=(s_w, None)
  )
  ones = jnp.ones((1, 1), jnp.float32)  # W's per-column scale is folded into dY's row copy
  dx = gemm_8bit((q_dl, s_dl, (0, 1)), (q_wt, ones, (0, 1)), _COLS, x_proto.dtype)
  dw = gemm_8bit((q_xt, s_x, (1, 0)), (q_dr, s_dr, (1, 0)), (((0,), (0,)), ((), ())), w_proto.dtype)
  new = {"x": new_x, "dy": push(dy_history, amax_dy), "dy_w": push(dyw_history, amax_dyw)}
  return dx, dw, new, None


fused_delayed_matmul.defvjp(_fused_fwd, _fused_bwd)


@dataclasses.dataclass(frozen=True, eq=False)
class DelayedDotGeneral:
  """A Flax ``dot_general=`` hook: ``lax.dot_general(lhs, rhs, dims)`` as ``delayed_matmul`` of
  the 2-D views (lhs contracted on its trailing axes, rhs on its leading ones, no batch axes:
  every ``nn.Dense`` / ``nn.DenseGeneral`` product)."""

  history: dict
  key: jax.Array | None
  spec: DelayedSpec
  path: str

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type
    (lc, rc), (lb, rb) = dimension_numbers
    n = len(lc)
    if lb or rb or tuple(lc) != tuple(range(lhs.ndim - n, lhs.ndim)) or tuple(rc) != tuple(range(n)):
      raise ValueError(
        f"Dense {self.path!r}: dimension_numbers {dimension_numbers} are not a contraction of lhs's "
        "trailing axes with rhs's leading ones. Fix: run delayed scaling on Dense / DenseGeneral "
        "layers whose axis= are the input's last axes."
      )
    k = int(np.prod(rhs.shape[:n]))
    out_shape = lhs.shape[: lhs.ndim - n] + rhs.shape[n:]
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    x, w = lhs.reshape(-1, k), rhs.reshape(k, -1)
    matmul = fused_delayed_matmul if self.spec.fused else delayed_matmul
    return matmul(x, w, self.history, self.key, self.spec, out_dtype).reshape(out_shape)


class DelayedDense:
  """A Flax method interceptor (``nn.intercept_methods``): every ``nn.Dense`` and ``nn.DenseGeneral``
  runs its product through ``DelayedDotGeneral`` with ``histories[its module path]``; with
  ``histories=None`` it only records the paths (``paths``) and runs the float layers."""

  def __init__(self, histories: dict | None, spec: DelayedSpec | None):
    self.histories, self.spec, self.paths = histories, spec, []

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    is_dense = isinstance(module, (nn.Dense, nn.DenseGeneral)) and context.method_name == "__call__"
    if not is_dense or isinstance(module.dot_general, DelayedDotGeneral):
      return next_fun(*args, **kwargs)
    path = module_path(module)
    if self.histories is None:
      self.paths.append(path)
      return next_fun(*args, **kwargs)
    key = module.make_rng(RNG_COLLECTION) if self.spec.needs_rng else None
    op = DelayedDotGeneral(self.histories[path], key, self.spec, path)
    return module.clone(parent=module.scope, dot_general=op, dot_general_cls=None)(*args, **kwargs)


def initial_histories(task, variables, batch, fused: bool = False) -> dict[str, dict[str, jax.Array]]:
  """``{Dense module path: empty_history(fused)}`` for every Dense the task's model calls."""
  recorder = DelayedDense(None, None)

  def apply(variables):
    with nn.intercept_methods(recorder):
      return task.model.apply(variables, *task.inputs(batch), **task.train_kwargs)

  jax.eval_shape(apply, variables)
  return {path: empty_history(fused) for path in dict.fromkeys(recorder.paths)}


def delayed_train_step(task, spec: DelayedSpec, optimizer):
  """A jitted step ``(variables, histories, opt_state, batch, key) -> (variables, histories,
  opt_state, loss)``: ``timing.single_device_step``'s with every Dense delayed-scaled and the
  histories replaced by their cotangents (variables, histories and optimizer state donated)."""
  loss_fn = task_loss(task, ATTENTION_POLICY)

  def step(variables, histories, opt_state, batch, key):
    def loss(params, histories):
      with nn.intercept_methods(DelayedDense(histories, spec)):
        return loss_fn({**variables, "params": params}, batch, key)[0]

    value, (grads, new_histories) = jax.value_and_grad(loss, argnums=(0, 1))(variables["params"], histories)
    params, opt_state = timing.apply_optimizer(optimizer, variables["params"], grads, opt_state)
    return {**variables, "params": params}, new_histories, opt_state, value

  return jax.jit(step, donate_argnums=(0, 1, 2))


# -- one Dense's numerics ---------------------------------------------------------------------


def rel_err(a, b) -> jax.Array:
  """``‖a − b‖ / ‖b‖`` in float32."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def dense_numerics(
  precision: str, tokens: int, width: int, steps: int = NUMERIC_STEPS, seed: int = 0, fused: bool = False
) -> dict:
  """One Dense ``[tokens, width] · [width, 4·width]`` (bf16, random normal X and W/√width, dY
  normal × 1e-3, fresh each step) run ``steps`` steps with delayed scaling, carrying its history:
  at the last step, the relative error of y, dX and dW against the float product
  (``delayed_*``, ``dynamic_*``: the ``precision`` preset's op) and of delayed against dynamic
  (``delayed_vs_dynamic_*``); ``history_changed``: steps whose new history differs from the
  old (``steps`` when the amax updates every step); the final ``x_history`` / ``dy_history``.
  ``fused``: through ``fused_delayed_matmul``."""
  spec, policy = delayed_spec(precision, fused), OpPolicy.preset(precision)
  matmul = fused_delayed_matmul if fused else delayed_matmul
  dims = (((1,), (0,)), ((), ()))

  @jax.jit
  def one_step(history, step_key):
    kx, kw, kg, kr = jax.random.split(step_key, 4)
    x = jax.random.normal(kx, (tokens, width), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (width, 4 * width), jnp.float32) * width**-0.5).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, (tokens, 4 * width), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    exact = jax.vjp(
      lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST),
      x,
      w,
    )
    dynamic = jax.vjp(lambda x, w: quantized_dot_general(x, w, dims, policy, kr), x, w)
    delayed = jax.vjp(lambda x, w, h: matmul(x, w, h, kr, spec, jnp.bfloat16), x, w, history)
    outs = {
      name: (y, *vjp(g.astype(y.dtype)))
      for name, (y, vjp) in (("exact", exact), ("dynamic", dynamic), ("delayed", delayed))
    }
    errs = {}
    for i, part in enumerate(("y", "dx", "dw")):
      errs[f"delayed_{part}"] = rel_err(outs["delayed"][i], outs["exact"][i])
      errs[f"dynamic_{part}"] = rel_err(outs["dynamic"][i], outs["exact"][i])
      errs[f"delayed_vs_dynamic_{part}"] = rel_err(outs["delayed"][i], outs["dynamic"][i])
    return outs["delayed"][3], errs

  history, changed, errs = empty_history(fused), 0, {}
  for key in jax.random.split(jax.random.key(seed), steps):
    new, errs = one_step(history, key)
    changed += int(any(bool(jnp.any(new[k] != history[k])) for k in history))
    history = new
  out = {k: float(v) for k, v in errs.items()}
  out.update(history_changed=changed, steps=steps)
  out.update(
    x_history=np.asarray(history["x"])[:steps].tolist(), dy_history=np.asarray(history["dy"])[:steps].tolist()
  )
  return out


# -- building and timing the variants ---------------------------------------------------------


@dataclasses.dataclass
class Cell:
  """A variant's compiled step: ``run()`` takes a step (fed its own outputs) and returns its loss;
  ``seconds``: trace, lower, XLA compile and the first call; ``stats``: ``jaxpr_stats``;
  ``histories``: the delayed variants' current histories (None for the others);
  ``calibrate_s``: their calibration's seconds (``build_cell``); ``absmax``: ``absmax_passes``
  of the step's program with the GPU kernels."""

  run: object
  seconds: dict
  stats: dict
  histories: object = None
  calibrate_s: float = 0.0
  absmax: dict | None = None


def split_variant(variant: str) -> tuple[str, str, bool]:
  """``(precision, scaling, fused)`` of a ``VARIANTS`` name: ``int8_delayed_fused`` is
  ``("int8", "delayed", True)``, ``bf16`` ``("bf16", "", False)``."""
  precision, _, scaling = variant.partition("_")
  return precision, scaling.removesuffix("_fused"), scaling.endswith("_fused")


def absmax_passes(jaxpr, from_batch, min_size: int) -> dict:
  """What a step's program spends on amaxes: ``batch_max_reductions``, the ``reduce_max``
  equations outside Pallas kernels over a tensor of at least ``min_size`` elements computed
  from the batch (X and dY of every Dense, the logits; not a weight), nested jaxprs counted at
  each call site; ``absmax_kernels``, the Pallas kernels whose name says they only take absmaxes
  (``quantize_pair_absmax``). A kernel's own reductions (``with_absmax``) count in neither.
  ``from_batch[i]``: whether the jaxpr's input ``i`` is (a leaf of) the batch; what an equation
  computes from such a value is from the batch too (inside a nested jaxpr whose inputs do not
  line up with the equation's, every input is, where one is)."""
  counts = {"batch_max_reductions": 0, "absmax_kernels": 0}

  def walk(jaxpr, flags):
    tainted = {v for v, f in zip(jaxpr.invars, flags) if f}
    for eqn in jaxpr.eqns:
      ins = [not hasattr(v, "val") and v in tainted for v in eqn.invars]
      if eqn.primitive.name == "pallas_call":
        name = str(eqn.params.get("name_and_src_info", eqn.params.get("name", "")))
        counts["absmax_kernels"] += "absmax" in name
      else:
        if eqn.primitive.name == "reduce_max" and ins[0] and math.prod(eqn.invars[0].aval.shape) >= min_size:
          counts["batch_max_reductions"] += 1
        for value in eqn.params.values():
          for sub in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
              aligned = len(inner.invars) == len(ins)
              walk(inner, ins if aligned else [any(ins)] * len(inner.invars))
      if any(ins):
        tainted.update(eqn.outvars)

  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  if len(from_batch) != len(jaxpr.invars):
    raise ValueError(f"from_batch has {len(from_batch)} flags for a jaxpr of {len(jaxpr.invars)} inputs.")
  walk(jaxpr, list(from_batch))
  return counts


def batch_flags(jaxpr, batch) -> list[bool]:
  """For a step ``(..., batch, key)``'s jaxpr: whether each input is a leaf of ``batch`` (the
  inputs before the last)."""
  n, nb = len(getattr(jaxpr, "jaxpr", jaxpr).invars), len(jax.tree.leaves(batch))
  return [False] * (n - nb - 1) + [True] * nb + [False]


@contextlib.contextmanager
def kernels_forced():
  """Steps traced inside take the quantize and GEMM kernels as on an H100 (sm90), on any machine:
  for tracing only (``benchmarks.common.e2e_inspect.lower_for_cuda`` forces them so)."""
  with contextlib.ExitStack() as stack:
    for api in (quantize_api, gemm_api):
      stack.enter_context(unittest.mock.patch.object(api, "on_gpu", lambda: True))
      if hasattr(api, "gpu_arch"):
        stack.enter_context(unittest.mock.patch.object(api, "gpu_arch", lambda: "sm90"))
    yield


def step_absmax_passes(variant: str, task, batch, width: int, traced_jaxpr, state=None) -> dict:
  """``absmax_passes`` (tensors of at least tokens × ``width`` elements) of ``variant``'s step
  ``(..., batch, key)`` as a GPU runs it: of ``traced_jaxpr`` where the kernels run here, else
  of the step traced again with ``kernels_forced`` (``state``: a delayed variant's ``[variables,
  histories, opt_state]``; the other variants' variables and optimizer state abstract). A
  failure is reported in the result (``error``), not raised: the timing stands without it."""
  min_size = math.prod(task.inputs(batch)[0].shape) * width
  try:
    if quantize_api.kernels_run_here():
      return absmax_passes(traced_jaxpr, batch_flags(traced_jaxpr, batch), min_size)
    precision, scaling, fused = split_variant(variant)
    optimizer, key = e2e.optimizer(), jax.random.key(0)
    with kernels_forced(), fused_attention(True):
      if scaling == "delayed":
        traced = delayed_train_step(task, delayed_spec(precision, fused), optimizer).trace(*state, batch, key)
      else:
        inputs = jax.tree.map(lambda x: x[:1], task.inputs(batch))
        init = lambda k: task.model.init(k, *inputs, **task.train_kwargs)  # noqa: E731
        variables = jax.eval_shape(init, key)
        opt_state = jax.eval_shape(optimizer.init, variables["params"])
        step = timing.single_device_step(task, e2e.POLICIES[E2E_POLICY[precision]], optimizer)
        traced = step.trace(variables, opt_state, batch, key)
    return {**absmax_passes(traced.jaxpr, batch_flags(traced.jaxpr, batch), min_size), "kernels_forced": True}
  except Exception as e:  # noqa: BLE001 - a diagnostic of the row, not its measurement
    return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def newest_amax(histories):
  """``histories`` with every history reduced to its newest amax (the rest zeros)."""
  return jax.tree.map(lambda h: jnp.zeros_like(h).at[0].set(h[0]), histories)


def build_cell(variant: str, task, batch, width: int) -> Cell:
  """The compiled step of ``variant`` (``VARIANTS``) on ``task``'s ``batch``, its first
  training step taken. A delayed variant first calibrates its histories on a copy of the
  variables and optimizer state, discarded after: ``CALIBRATION_STEPS`` steps from empty
  histories, each step's from the newest amaxes of the one before (``newest_amax``); its
  training then starts from the same variables as the other variants' (``first_call_s``:
  the first calibration step; ``calibrate_s``: all of them)."""
  precision, scaling, fused = split_variant(variant)
  if scaling != "delayed":
    built = e2e.build(task, E2E_POLICY[precision], batch)
    cell = Cell(built.run, dict(built.seconds), jaxpr_stats(built.traced.jaxpr))
    cell.absmax = step_absmax_passes(variant, task, batch, width, built.traced.jaxpr)
    t0 = time.perf_counter()
    jax.block_until_ready(cell.run())
    cell.seconds["first_call_s"] = time.perf_counter() - t0
    return cell
  optimizer = e2e.optimizer()
  variables = e2e.init(task, batch)
  state = [variables, initial_histories(task, variables, batch, fused), optimizer.init(variables["params"])]
  key = jax.random.key(0)
  with fused_attention(True):
    traced, _, compiled, seconds = timing.staged_compile(
      delayed_train_step(task, delayed_spec(precision, fused), optimizer), *state, batch, key
    )
  absmax = step_absmax_passes(variant, task, batch, width, traced.jaxpr, state)
  t0 = time.perf_counter()
  calibration = [jax.tree.map(jnp.copy, state[0]), state[1], jax.tree.map(jnp.copy, state[2])]
  for i in range(CALIBRATION_STEPS):
    calibration[0], histories, calibration[2], _ = jax.block_until_ready(compiled(*calibration, batch, key))
    calibration[1] = newest_amax(histories)
    if i == 0:
      seconds["first_call_s"] = time.perf_counter() - t0
  state[1] = calibration[1]
  cell = Cell(None, seconds, jaxpr_stats(traced.jaxpr), state[1], time.perf_counter() - t0, absmax)
  del calibration

  def run():
    state[0], state[1], state[2], loss = compiled(*state, batch, key)
    cell.histories = state[1]
    return loss

  cell.run = run
  jax.block_until_ready(run())  # its first training step (not in its compile time)
  return cell


def history_summary(histories) -> dict:
  """What the histories hold: the fraction of entries written (non-zero), of Dense layers whose
  x and dY histories are not constant (their amax changed over the steps), and one example."""
  xs = np.stack([np.asarray(h["x"]) for h in histories.values()])
  dys = np.stack([np.asarray(h["dy"]) for h in histories.values()])
  both = np.stack([np.asarray(v) for h in histories.values() for v in h.values()])
  first = next(iter(histories))
  return {
    "history_filled": float(np.mean(both > 0)),
    "history_varies": float(np.mean(both.max(1) > both.min(1))),
    "history_example": {"dense": first, "x": xs[0][:4].tolist(), "dy": dys[0][:4].tolist()},
  }


def iqr(samples) -> tuple[float, float]:
  q1, q3 = np.percentile(samples, [25, 75])
  return float(q1), float(q3)


def groups(widths, variants) -> list[tuple[int, tuple[str, ...]]]:
  """``(width, variants)`` groups in run order: bf16 and the int8 variants of every width, then
  the fp8 variants of every width."""
  first = tuple(v for v in variants if not v.startswith("fp8"))
  second = tuple(v for v in variants if v.startswith("fp8"))
  return [(w, g) for g in (first, second) if g for w in widths]


def run_group(width: int, variants, args, bf16_ms: dict, numerics_tokens: int) -> list[dict]:
  """Rows of one width's variants: built, timed round-robin, the delayed ones' numerics."""
  task, batch_size = e2e_gpt(width, args.tiny)
  batch = timing.device_batch(task, batch_size)
  device = jax.devices()[0].device_kind
  cells, losses, rows = {}, {}, []
  for v in variants:
    t0 = time.perf_counter()
    try:
      cells[v] = build_cell(v, task, batch, width)
    except Exception as e:  # noqa: BLE001 - one variant that fails is reported, the others still run
      rows.append(failed_row(width, v, e, args.run_id))
      continue
    print(f"  d{width} {v}: built in {time.perf_counter() - t0:.1f} s", flush=True)

  def recording(name, run):
    def timed():
      losses[name] = run()
      return losses[name]

    return timed

  clock = timing.default_step_clock()
  medians = timing.time_round_robin(
    {v: recording(v, c.run) for v, c in cells.items()},
    args.repeats,
    args.rounds,
    (clock,),
    progress=lambda m: print(f"  d{width} {m}", flush=True),
  )[clock]
  if "bf16" in medians:
    bf16_ms[width] = float(np.median(medians["bf16"]))
  tags = {"run": args.run_id, "width": width, "batch": batch_size, "clock": clock}
  for v, samples in medians.items():
    ms = float(np.median(samples))
    q1, q3 = iqr(samples)
    c = cells[v]
    extra = {
      "iqr_ms": q3 - q1,
      "q1_ms": q1,
      "q3_ms": q3,
      "rounds": samples,
      "steps_timed": args.rounds * args.repeats,
      "compile_s": sum(c.seconds.values()),
      **c.seconds,
      "loss_after": float(losses[v]),
      "program": c.stats,
      "absmax_passes": c.absmax,
    }
    if "bf16" in cells:
      extra["bf16_absmax_passes"] = cells["bf16"].absmax
    precision, scaling, fused = split_variant(v)
    if scaling == "delayed":
      extra.update(history_summary(c.histories), history_len=HISTORY, calibrate_s=c.calibrate_s)
      for name, key in ((f"{precision}_dynamic", "vs_dynamic"), (f"{precision}_delayed", "vs_delayed")):
        if name in medians and name != v:
          extra[key] = ms / float(np.median(medians[name]))
    elif scaling == "dynamic" or v == "bf16":
      extra["e2e_policy"] = E2E_POLICY[precision]
    rows.append(
      result_row(
        "delayed_scaling", f"gpt/d{width}/{v}", "step_ms", ms, bf16_ms.get(width), device, **tags, **extra
      )
    )
  del cells, c
  gc.collect()
  for v in variants:
    precision, scaling, fused = split_variant(v)
    if scaling == "delayed":
      t0 = time.perf_counter()
      try:
        n = dense_numerics(precision, numerics_tokens, width, fused=fused)
      except Exception as e:  # noqa: BLE001 - reported; the timing rows stand
        rows.append(failed_row(width, v, e, args.run_id))
        continue
      n["seconds"] = time.perf_counter() - t0
      value = n["delayed_vs_dynamic_y"]
      rows.append(
        result_row("delayed_scaling", f"gpt/d{width}/{v}", "dense_rel_err", value, None, device, **tags, **n)
      )
  return rows


def failed_row(width: int, variant: str, error: BaseException, run_id: str, metric: str = "failed") -> dict:
  """A row saying ``variant`` at ``width`` failed (or was ``skipped``), with why; the traceback
  of an exception prints."""
  if isinstance(error, Exception):
    traceback.print_exception(error)
    error = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
  return result_row(
    "delayed_scaling", f"gpt/d{width}/{variant}", metric, None, None, "", run=run_id, reason=error
  )


def table(rows: list[dict]) -> str:
  """This run's rows as a text table; ``max-red``: ``absmax_passes``'s max-reductions over
  tensors from the batch beyond bf16's (``+n``), then its absmax kernels."""
  lines = [
    f"{'case':28s} {'step ms':>8s} {'IQR':>6s} {'/bf16':>6s} {'/dyn':>6s} {'/jnp':>6s} {'max-red':>7s} "
    f"{'compile s':>9s} {'loss':>7s}  note"
  ]
  for r in rows:
    if r["metric"] == "step_ms":
      ratios = [f"{r[k]:6.3f}" if r.get(k) else f"{'-':>6s}" for k in ("ratio", "vs_dynamic", "vs_delayed")]
      passes, base = r.get("absmax_passes"), r.get("bf16_absmax_passes")
      reductions = "-"
      if passes and "error" not in passes:
        n = passes["batch_max_reductions"]
        if base and "error" not in base:
          n = f"+{n - base['batch_max_reductions']}"
        reductions = f"{n}/{passes['absmax_kernels']}"
      note = (
        f"history filled {r['history_filled']:.2f}, varies {r['history_varies']:.2f}"
        if "history_filled" in r
        else ""
      )
      lines.append(
        f"{r['case']:28s} {r['value']:8.2f} {r['iqr_ms']:6.2f} {' '.join(ratios)} {reductions:>7s} "
        f"{r['compile_s']:9.1f} {r['loss_after']:7.3f}  {note}"
      )
    elif r["metric"] == "dense_rel_err":
      lines.append(
        f"{r['case']:28s} one Dense, step {r['steps']}: rel err y/dx/dw delayed "
        f"{r['delayed_y']:.4f}/{r['delayed_dx']:.4f}/{r['delayed_dw']:.4f}, dynamic "
        f"{r['dynamic_y']:.4f}/{r['dynamic_dx']:.4f}/{r['dynamic_dw']:.4f}, delayed vs dynamic "
        f"{r['delayed_vs_dynamic_y']:.4f}/{r['delayed_vs_dynamic_dx']:.4f}/{r['delayed_vs_dynamic_dw']:.4f}; "
        f"history changed {r['history_changed']}/{r['steps']} steps"
      )
    else:
      lines.append(f"{r['case']:28s} {r['metric']}: {r.get('reason', '')}")
  return "\n".join(lines)


def parse_list(text: str, kind, name: str, allowed=None) -> list:
  try:
    values = [kind(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise SystemExit(
      f"--{name} {text!r}: not a comma-separated list of {kind.__name__}. Fix: e.g. --{name} 768,1024."
    ) from None
  bad = [v for v in values if allowed is not None and v not in allowed]
  if not values or bad:
    raise SystemExit(
      f"--{name} {text!r}: {bad or 'empty'} not of {list(allowed or [])}. Fix: use those, comma-separated."
    )
  return values


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.delayed_scaling", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--widths", default=None, help="GPT widths, comma-separated (default 768,1024,2048,4096)")
  ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
  ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 8; 2 with --cpu)")
  ap.add_argument(
    "--repeats", type=int, default=None, help="steps per round and variant (default 5; 2 with --cpu)"
  )
  ap.add_argument(
    "--budget-s", type=float, default=float("inf"), help="skip groups that would not end in time"
  )
  ap.add_argument("--cpu", action="store_true", help="CPU smoke test: tiny GPT and Dense on the CPU")
  ap.add_argument("--out-jsonl", default=RESULTS)
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  if args.cpu:
    jax.config.update("jax_platforms", "cpu")
  args.tiny = args.cpu or jax.default_backend() == "cpu"
  widths = parse_list(args.widths or ("32" if args.tiny else "768,1024,2048,4096"), int, "widths")
  variants = parse_list(args.variants, str, "variants", VARIANTS)
  args.rounds = args.rounds or (2 if args.tiny else 8)
  args.repeats = args.repeats or (2 if args.tiny else 5)
  if args.rounds * args.repeats < (1 if args.tiny else 20):
    raise SystemExit(
      f"--rounds {args.rounds} × --repeats {args.repeats} < 20 timed steps. Fix: time at least 20."
    )
  args.run_id = f"delayed-{time.strftime('%Y%m%d-%H%M%S')}"
  numerics_tokens = NUMERIC_TOKENS_TINY if args.tiny else NUMERIC_TOKENS
  outputs = [args.out_jsonl] + (
    [os.path.join(os.environ["OUT"], "delayed_scaling.jsonl")] if os.environ.get("OUT") else []
  )
  print(
    f"run {args.run_id} on {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}",
    flush=True,
  )
  rows, bf16_ms, took = [], {}, {}
  for width, group in groups(widths, variants):
    remaining = args.budget_s - (time.perf_counter() - t_start)
    need = sum(1.3 * max(took[v]) if took.get(v) else (ESTIMATE_S[v] if not args.tiny else 0) for v in group)
    if need > remaining:
      reason = f"budget: needs ~{need:.0f} s, {remaining:.0f} s left"
      new = [failed_row(width, v, reason, args.run_id, "skipped") for v in group]
      print(f"d{width} {'+'.join(group)}: skipped ({reason})", flush=True)
    else:
      t0 = time.perf_counter()
      try:
        new = run_group(width, group, args, bf16_ms, numerics_tokens)
      except Exception as e:  # noqa: BLE001 - one failing group is reported, the rest still run
        new = [failed_row(width, v, e, args.run_id) for v in group]
      for v in group:
        took.setdefault(v, []).append((time.perf_counter() - t0) / len(group))
      print(table(new), flush=True)
    for path in outputs:
      append_rows(path, new)
    rows += new
  print(f"\n{table(rows)}\n[{time.perf_counter() - t_start:.0f} s]", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
