"""Delayed (amax-history) scaling of every Dense against the library's dynamic scaling: the e2e GPT step.

  python -m benchmarks.diagnosis.delayed_scaling [--widths 768,1024,2048,4096]
      [--variants bf16,int8_dynamic,int8_delayed,fp8_dynamic,fp8_delayed]
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
  the dynamic path's (``pallas_kernels.gemm.scaled_dot_general``, through ``qdot.gemm_8bit``).

``delayed_matmul(x, w, history, key, spec)`` for ``x [M, K]``, ``w [K, N]`` is equivalent to::

    s_x = max(history["x"]) / qmax_x              # 1 while the history is all zeros
    y = (Q(x / s_x) · Q_percol(w)) * s_x          # Q: round_to_format, no absmax pass over x
    # backward, dY of the step:
    s_g = max(history["dy"]) / qmax_dy
    dx = (Q(dY / s_g) · Q_perrow(w)ᵀ) * s_g       # w quantized again along N (small)
    dw = (Q(x / s_x)ᵀ · Q(dY / s_g)) * s_x * s_g
    # the cotangent of ``history`` is the new history: each one shifted by one, this step's
    # max|x| / max|dY| first (Flax's fp8_ops carries its amax out of the backward pass so)

X rounds to nearest and dY as the preset rounds gradients (the int8 preset: stochastically,
with the dynamic path's noise stream, ``pallas_kernels.quantize.noise``); every quantization
of X and dY is plain jnp, which XLA may fuse into the tensor's producer, and this step's amax
is a reduction beside it. The training step differentiates the loss by the histories too and
keeps the cotangents as the next step's histories. With an empty history a scale is 1: a
delayed variant's first call calibrates its histories with a step whose update it discards
(``build_cell``).

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
import dataclasses
import functools
import gc
import os
import sys
import time
import traceback
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
from pallas_kernels.quantize.noise import uniform_noise
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
VARIANTS = ("bf16", "int8_dynamic", "int8_delayed", "fp8_dynamic", "fp8_delayed")
E2E_POLICY = {"bf16": "plain_cudnn_attn", "int8": "int8_dense_fused_attn", "fp8": "fp8_dense_fused_attn"}
"""The ``benchmarks.e2e`` policy of the baseline and of each dynamic variant."""
ATTENTION_POLICY = e2e.kinds_policy("bf16", e2e.ATTENTION_KINDS)
"""The delayed variants' attention: bf16, fused (cuDNN), as in ``plain_cudnn_attn``."""
ESTIMATE_S = {"bf16": 25, "int8_dynamic": 40, "int8_delayed": 45, "fp8_dynamic": 50, "fp8_delayed": 55}
"""Seconds a variant is assumed to take on a GPU (build, timing, numerics) before one was measured."""


# -- delayed scaling ----------------------------------------------------------------------------


class DelayedSpec(NamedTuple):
  """How ``delayed_matmul`` quantizes: ``precision`` ``int8`` or ``fp8`` (e4m3 X and W, e5m2 dY),
  X's and W's rounding, dY's rounding."""

  precision: str
  rounding: str
  grad_rounding: str

  @property
  def needs_rng(self) -> bool:
    return "stochastic" in (self.rounding, self.grad_rounding)


def delayed_spec(precision: str) -> DelayedSpec:
  """The spec of the ``precision`` preset's formats and roundings (``OpPolicy.preset``)."""
  preset = OpPolicy.preset(precision)
  return DelayedSpec(precision, preset.rounding, preset.grad_rounding)


def empty_history() -> dict[str, jax.Array]:
  """One Dense's histories before its first step: ``{"x": zeros, "dy": zeros}`` of ``HISTORY``."""
  return {"x": jnp.zeros((HISTORY,), jnp.float32), "dy": jnp.zeros((HISTORY,), jnp.float32)}


def history_scale(history: jax.Array, fmt: str) -> jax.Array:
  """``max(history) / qmax`` of ``fmt`` as a ``[1, 1]`` float32 scale (1 where the history is 0)."""
  return scale_from_absmax(jnp.max(history), QFORMATS[fmt][1]).reshape(1, 1)


def push_amax(history: jax.Array, x: jax.Array) -> jax.Array:
  """``history`` shifted by one, ``max|x|`` first (float32)."""
  return jnp.roll(history, 1).at[0].set(jnp.max(jnp.abs(x)).astype(jnp.float32))


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
    return delayed_matmul(x, w, self.history, self.key, self.spec, out_dtype).reshape(out_shape)


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


def initial_histories(task, variables, batch) -> dict[str, dict[str, jax.Array]]:
  """``{Dense module path: empty_history()}`` for every Dense the task's model calls."""
  recorder = DelayedDense(None, None)

  def apply(variables):
    with nn.intercept_methods(recorder):
      return task.model.apply(variables, *task.inputs(batch), **task.train_kwargs)

  jax.eval_shape(apply, variables)
  return {path: empty_history() for path in dict.fromkeys(recorder.paths)}


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
  precision: str, tokens: int, width: int, steps: int = NUMERIC_STEPS, seed: int = 0
) -> dict:
  """One Dense ``[tokens, width] · [width, 4·width]`` (bf16, random normal X and W/√width, dY
  normal × 1e-3, fresh each step) run ``steps`` steps with delayed scaling, carrying its history:
  at the last step, the relative error of y, dX and dW against the float product
  (``delayed_*``, ``dynamic_*``: the ``precision`` preset's op) and of delayed against dynamic
  (``delayed_vs_dynamic_*``); ``history_changed``: steps whose new history differs from the
  old (``steps`` when the amax updates every step); the final ``x_history`` / ``dy_history``."""
  spec, policy = delayed_spec(precision), OpPolicy.preset(precision)
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
    delayed = jax.vjp(lambda x, w, h: delayed_matmul(x, w, h, kr, spec, jnp.bfloat16), x, w, history)
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

  history, changed, errs = empty_history(), 0, {}
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
  ``calibrate_s``: their calibration's seconds (``build_cell``)."""

  run: object
  seconds: dict
  stats: dict
  histories: object = None
  calibrate_s: float = 0.0


def newest_amax(histories):
  """``histories`` with every history reduced to its newest amax (the rest zeros)."""
  return jax.tree.map(lambda h: jnp.zeros_like(h).at[0].set(h[0]), histories)


def build_cell(variant: str, task, batch) -> Cell:
  """The compiled step of ``variant`` (``VARIANTS``) on ``task``'s ``batch``, its first
  training step taken. A delayed variant first calibrates its histories on a copy of the
  variables and optimizer state, discarded after: ``CALIBRATION_STEPS`` steps from empty
  histories, each step's from the newest amaxes of the one before (``newest_amax``); its
  training then starts from the same variables as the other variants' (``first_call_s``:
  the first calibration step; ``calibrate_s``: all of them)."""
  precision, _, scaling = variant.partition("_")
  if scaling != "delayed":
    built = e2e.build(task, E2E_POLICY[precision], batch)
    cell = Cell(built.run, dict(built.seconds), jaxpr_stats(built.traced.jaxpr))
    t0 = time.perf_counter()
    jax.block_until_ready(cell.run())
    cell.seconds["first_call_s"] = time.perf_counter() - t0
    return cell
  optimizer = e2e.optimizer()
  variables = e2e.init(task, batch)
  state = [variables, initial_histories(task, variables, batch), optimizer.init(variables["params"])]
  key = jax.random.key(0)
  with fused_attention(True):
    traced, _, compiled, seconds = timing.staged_compile(
      delayed_train_step(task, delayed_spec(precision), optimizer), *state, batch, key
    )
  t0 = time.perf_counter()
  calibration = [jax.tree.map(jnp.copy, state[0]), state[1], jax.tree.map(jnp.copy, state[2])]
  for i in range(CALIBRATION_STEPS):
    calibration[0], histories, calibration[2], _ = jax.block_until_ready(compiled(*calibration, batch, key))
    calibration[1] = newest_amax(histories)
    if i == 0:
      seconds["first_call_s"] = time.perf_counter() - t0
  state[1] = calibration[1]
  cell = Cell(None, seconds, jaxpr_stats(traced.jaxpr), state[1], time.perf_counter() - t0)
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
  both = np.concatenate([xs, dys])
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
      cells[v] = build_cell(v, task, batch)
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
    }
    precision, _, scaling = v.partition("_")
    if scaling == "delayed":
      extra.update(history_summary(c.histories), history_len=HISTORY, calibrate_s=c.calibrate_s)
      dynamic = f"{precision}_dynamic"
      if dynamic in medians:
        extra["vs_dynamic"] = ms / float(np.median(medians[dynamic]))
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
    precision, _, scaling = v.partition("_")
    if scaling == "delayed":
      t0 = time.perf_counter()
      try:
        n = dense_numerics(precision, numerics_tokens, width)
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
  """This run's rows as a text table."""
  lines = [
    f"{'case':24s} {'step ms':>8s} {'IQR':>6s} {'/bf16':>6s} {'/dyn':>6s} {'compile s':>9s} {'loss':>7s}  note"
  ]
  for r in rows:
    if r["metric"] == "step_ms":
      ratio = f"{r['ratio']:6.3f}" if r.get("ratio") else f"{'-':>6s}"
      vs = f"{r['vs_dynamic']:6.3f}" if r.get("vs_dynamic") else f"{'-':>6s}"
      note = (
        f"history filled {r['history_filled']:.2f}, varies {r['history_varies']:.2f}"
        if "history_filled" in r
        else ""
      )
      lines.append(
        f"{r['case']:24s} {r['value']:8.2f} {r['iqr_ms']:6.2f} {ratio} {vs} {r['compile_s']:9.1f} "
        f"{r['loss_after']:7.3f}  {note}"
      )
    elif r["metric"] == "dense_rel_err":
      lines.append(
        f"{r['case']:24s} one Dense, step {r['steps']}: rel err y/dx/dw delayed "
        f"{r['delayed_y']:.4f}/{r['delayed_dx']:.4f}/{r['delayed_dw']:.4f}, dynamic "
        f"{r['dynamic_y']:.4f}/{r['dynamic_dx']:.4f}/{r['dynamic_dw']:.4f}, delayed vs dynamic "
        f"{r['delayed_vs_dynamic_y']:.4f}/{r['delayed_vs_dynamic_dx']:.4f}/{r['delayed_vs_dynamic_dw']:.4f}; "
        f"history changed {r['history_changed']}/{r['steps']} steps"
      )
    else:
      lines.append(f"{r['case']:24s} {r['metric']}: {r.get('reason', '')}")
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
