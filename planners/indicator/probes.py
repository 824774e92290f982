"""Probes on every quantizable op of a training step: ∂L/∂Y, ∂L/∂W and the measured δY.

The model runs unmodified under ``qsync_jax.quantize(model, uniform fp32, tap=...)``. The tap
sees every quantizable op call (Dense, DenseGeneral, Conv, Einsum, Embed, attention QK/PV)
with its operands ``lhs`` (X; Q or P for attention) and ``rhs`` (W; K or V for attention)
and replaces the op's output by

    Y = rerun(None, lhs, rhs + probe_rhs) + probe_out

with two zero probes, so one ``jax.grad`` w.r.t. the probes gives ∂L/∂Y and ∂L/∂rhs (the
weight gradient ∇W for ops with weights) of every op at once, attention matmuls included.
``rerun(None, ...)`` is the plain float op, so second derivatives (Hessian-vector products)
go through ordinary ``lax`` ops. In the same pass the tap recomputes each op's output on the
same operands at every probed precision: δY_p = op_p(X, W) − op_fp32(X, W) (the reference at
``Precision.HIGHEST``, so no tf32 creeps in on GPUs), the *measured* error of that op alone
at precision p (its inputs are those of the fp32 model).

An op called more than once (a shared module) gets one call key per call: its name for the
first call, ``name#k`` for the k-th repeat. Indicators sum over the calls of an op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import dequantize, quantize
from planners.ops import grouped_conv
from qsync_jax.ops.qdot import FLOAT_DTYPES, qformat
from qsync_jax.ops.quant_ops import OpInfo
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy
from qsync_jax.train.task import Task
from qsync_jax.train.task_step import task_loss

PROBED_PRECISIONS = ("int8", "fp8", "fp16", "bf16")
"""Precisions an indicator scores by default (fp32 scores 0)."""


def forward_op_policy(precision: str) -> OpPolicy:
  """Default op policy probed for ``precision``: that precision in the forward product only."""
  return OpPolicy(fwd=precision, dlhs="fp32", drhs="fp32")


@dataclasses.dataclass(frozen=True)
class OpCall:
  """One call of a quantizable op in the forward pass (static shapes, forward order)."""

  key: str
  name: str
  kind: str
  order: int
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  out_dtype: Any
  rhs_dtype: Any


class _Tap:
  """The probing tap: numbers repeated calls, adds probes, measures δY per precision. The op's
  output is recomputed as ``rerun(None, lhs, rhs)`` wherever there are ``rhs_probes`` or ``rerun``
  is set (so that a pass without weight probes computes the same outputs as one with them)."""

  def __init__(self, out_probes=None, rhs_probes=None, measure: Callable | None = None, rerun: bool = False):
    self.out_probes, self.rhs_probes, self.measure, self.rerun = out_probes, rhs_probes, measure, rerun
    self.counts: dict[str, int] = {}
    self.calls: list[tuple[str, OpInfo, jax.Array]] = []
    self.records: dict[str, dict[str, Any]] = {}

  def __call__(self, info: OpInfo, y: jax.Array) -> jax.Array:
    k = self.counts.get(info.name, 0)
    self.counts[info.name] = k + 1
    key = info.name if k == 0 else f"{info.name}#{k}"
    lhs, rhs = info.lhs, info.rhs
    if self.rhs_probes is not None:
      rhs = rhs + self.rhs_probes[key].astype(rhs.dtype)
    if self.rhs_probes is not None or self.rerun:
      y = info.rerun(None, lhs, rhs)
    self.calls.append((key, info, y))
    if self.measure is not None:
      self.records[key] = self.measure(info, lhs, rhs, y)
    if self.out_probes is not None:
      y = y + self.out_probes[key].astype(y.dtype)
    return y


def training_loss(task: Task, tap: Callable, variables, batch, key) -> jax.Array:
  """The task's training loss (``qsync_jax.train.task_step.task_loss``, mutable collections
  discarded) under the uniform fp32 policy, with ``tap``."""
  return task_loss(task, PrecisionPolicy.uniform("fp32"), tap)(variables, batch, key)[0]


def trace_calls(task: Task, variables, batch) -> list[OpCall]:
  """Every quantizable op call of the training step, in forward order (nothing computed)."""
  tap = _Tap()
  jax.eval_shape(lambda v, b: training_loss(task, tap, v, b, jax.random.key(0)), variables, batch)
  return [
    OpCall(
      key,
      info.name,
      info.kind,
      i,
      info.lhs_shape,
      info.rhs_shape,
      tuple(y.shape),
      y.dtype,
      info.rhs.dtype,
    )
    for i, (key, info, y) in enumerate(tap.calls)
  ]


def op_order(calls: Iterable[OpCall]) -> list[str]:
  """Op names in the order of their first call."""
  return list(dict.fromkeys(c.name for c in calls))


def fake_quant(x: jax.Array, precision: str) -> jax.Array:
  """``x`` rounded to ``precision`` and back (int8/fp8: per-tensor absmax scale)."""
  if precision in FLOAT_DTYPES:
    return x.astype(FLOAT_DTYPES[precision]).astype(x.dtype)
  if precision in ("int8", "fp8"):
    qvalue, scale = quantize(x, qformat(precision, False), tuple(range(x.ndim)), "nearest", None)
    return dequantize(qvalue, scale).astype(x.dtype)
  return x


def _sum(x):
  return jnp.sum(x.astype(jnp.float32))


def _row_dots(g, d):
  """Σ over all but the leading axis of g·δY: one first-order loss term per row (sample)."""
  prod = (g.astype(jnp.float32) * d.astype(jnp.float32)).reshape(g.shape[0], -1)
  return jnp.sum(prod, axis=1)


GRADIENT_STATS = ("first", "first2", "rows")
"""The stats the ``gradient`` indicator reads (``gradient.py``), for ``batch_stats(stats=...)``."""


def batch_stats(
  task: Task,
  calls: list[OpCall],
  precisions: tuple[str, ...] = PROBED_PRECISIONS,
  op_policy_for: Callable[[str], OpPolicy] = forward_op_policy,
  stats: Collection[str] | None = None,
) -> Callable:
  """A jitted ``(variables, batch, key) -> {call key: {stat: scalar}}`` for one batch.

  Stats (all float32 scalars): ``numel_x/w/y``; ``x2``, ``w2``, ``gw2`` (squared Frobenius
  norms of X, W, ∇W=∂L/∂rhs); ``max_x``, ``max_w``; ``mean_x``, ``mean_w``, ``mean_g``
  (mean |·| of X, W, ∂L/∂Y); per precision p: ``dy2:p`` = ‖δY_p‖², ``first:p`` = ⟨∂L/∂Y, δY_p⟩ and ``first2:p`` its square,
  ``rows:p`` = R·Σ_i ⟨∂L/∂Y_i, δY_p,i⟩² over the R rows (leading axis) of Y,
  ``wq_abs:p`` = Σ|Q_p(W)|, ``w_abs`` = Σ|W|, ``wq_err:p`` = ‖Q_p(W) − W‖².
  ``stats``: the names to compute (a per-precision stat by its name without ``:p``; e.g.
  ``GRADIENT_STATS``); the others are not traced (no weight probes without ``gw2``, no quantized
  copy of W without ``wq_abs`` or ``wq_err``). None: every stat.
  """
  want = (lambda name: True) if stats is None else (lambda name: name in stats)
  policies = {p: op_policy_for(p) for p in precisions}

  reference = OpPolicy.uniform("fp32")  # Precision.HIGHEST: no tf32 in the reference on GPUs

  def measure(info, lhs, rhs, y):
    del y
    lhs_c, rhs_c = jax.lax.stop_gradient(lhs), jax.lax.stop_gradient(rhs)
    y_ref = info.rerun(reference, lhs_c, rhs_c)
    if grouped_conv(info.kind, info.lhs_shape, info.rhs_shape):  # uniform float policies only
      floats = {p: OpPolicy.uniform(p) for p in policies if p not in QUANTIZED_PRECISIONS}
      deltas = {
        p: info.rerun(floats[p], lhs_c, rhs_c) - y_ref if p in floats else jnp.zeros_like(y_ref)
        for p in policies
      }
    else:
      deltas = {p: info.rerun(pol, lhs_c, rhs_c) - y_ref for p, pol in policies.items()}
    return {"lhs": lhs_c, "rhs": rhs_c, "deltas": deltas}

  def fn(variables, batch, key):
    out_p = {c.key: jnp.zeros(c.out_shape, c.out_dtype) for c in calls}
    rhs_p = {c.key: jnp.zeros(c.rhs_shape, c.rhs_dtype) for c in calls} if want("gw2") else None

    def loss_fn(out_p, rhs_p):
      tap = _Tap(out_p, rhs_p, measure, rerun=True)
      return training_loss(task, tap, variables, batch, key), tap.records

    (g_out, g_rhs), records = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)(out_p, rhs_p)
    return {c.key: _call_stats(records[c.key], g_out[c.key], g_rhs, c.key, precisions, want) for c in calls}

  return jax.jit(fn)


def _call_stats(rec, g, g_rhs, key: str, precisions, want) -> dict[str, jax.Array]:
  """``batch_stats``'s stats of one call that ``want(name)`` asks for (module docstring)."""
  x, w = rec["lhs"], rec["rhs"]
  general = {
    "numel_x": lambda: jnp.float32(x.size),
    "numel_w": lambda: jnp.float32(w.size),
    "numel_y": lambda: jnp.float32(g.size),
    "x2": lambda: _sum(jnp.square(x)),
    "w2": lambda: _sum(jnp.square(w)),
    "gw2": lambda: _sum(jnp.square(g_rhs[key])),
    "max_x": lambda: jnp.max(jnp.abs(x)).astype(jnp.float32),
    "max_w": lambda: jnp.max(jnp.abs(w)).astype(jnp.float32),
    "mean_x": lambda: jnp.mean(jnp.abs(x)).astype(jnp.float32),
    "mean_w": lambda: jnp.mean(jnp.abs(w)).astype(jnp.float32),
    "mean_g": lambda: jnp.mean(jnp.abs(g)).astype(jnp.float32),
    "w_abs": lambda: _sum(jnp.abs(w)),
  }
  s = {name: make() for name, make in general.items() if want(name)}
  for p in precisions:
    s.update(
      {f"{name}:{p}": value for name, value in _precision_stats(rec["deltas"][p], g, w, p, want).items()}
    )
  return s


def _precision_stats(d, g, w, precision: str, want) -> dict[str, jax.Array]:
  """The per-precision stats of one call (``batch_stats``) that ``want(name)`` asks for, named
  without their ``:precision``; ``d``: δY at ``precision``, ``g``: ∂L/∂Y, ``w``: the rhs."""
  rows = _row_dots(g, d)
  wq = fake_quant(w, precision) if want("wq_abs") or want("wq_err") else None
  per = {
    "dy2": lambda: _sum(jnp.square(d)),
    "first": lambda: jnp.sum(rows),
    "first2": lambda: jnp.square(jnp.sum(rows)),
    "rows": lambda: jnp.float32(rows.shape[0]) * jnp.sum(jnp.square(rows)),
    "wq_abs": lambda: _sum(jnp.abs(wq)),
    "wq_err": lambda: _sum(jnp.square(wq - w)),
  }
  return {name: make() for name, make in per.items() if want(name)}


def collect(
  task: Task,
  variables,
  batches: Iterable[Any],
  precisions: tuple[str, ...] = PROBED_PRECISIONS,
  op_policy_for: Callable[[str], OpPolicy] = forward_op_policy,
  seed: int = 0,
  progress: Callable[[int, int], None] | None = None,
  stats: Collection[str] | None = None,
) -> tuple[list[OpCall], list[dict[str, dict[str, float]]]]:
  """``(calls, per-batch stats)``: ``batch_stats`` of every batch (the ``stats`` it names; None:
  all), as plain floats: one compiled program for every batch and precision.

  All batches must have the first batch's shapes (the probes are shaped from it).
  ``progress(done, total)`` is called after each batch (e.g. to draw a progress bar).
  """
  batches = list(batches)
  if not batches:
    raise ValueError("collect() needs at least one batch. Fix: pass a non-empty list of batches.")
  calls = trace_calls(task, variables, batches[0])
  fn = batch_stats(task, calls, precisions, op_policy_for, stats)
  key = jax.random.key(seed)
  per_batch = []
  for i, batch in enumerate(batches):
    stats = jax.device_get(fn(variables, batch, jax.random.fold_in(key, i)))
    per_batch.append({k: {s: float(v) for s, v in d.items()} for k, d in stats.items()})
    if progress is not None:
      progress(i + 1, len(batches))
  return calls, per_batch


def sum_calls(
  calls: list[OpCall], per_call: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
  """Per-op table from a per-call table: values of an op's calls are added."""
  out: dict[str, dict[str, float]] = {}
  for c in calls:
    row = out.setdefault(c.name, {})
    for p, v in per_call[c.key].items():
      row[p] = row.get(p, 0.0) + float(v)
  return out


def mean_over_batches(per_batch: list[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
  """Elementwise mean of per-batch ``{key: {field: value}}`` tables."""
  out: dict[str, dict[str, float]] = {}
  for table in per_batch:
    for k, row in table.items():
      acc = out.setdefault(k, {})
      for f, v in row.items():
        acc[f] = acc.get(f, 0.0) + v / len(per_batch)
  return {k: dict(v) for k, v in out.items()}
