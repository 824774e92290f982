"""HAWQ-v2-style Hessian indicator: Ω = Tr(H_W)/numel(W) · ‖Q_p(W) − W‖².

Tr(H_W) is the trace of the Hessian of the training loss w.r.t. the op's right operand W
(its weight; K or V for the weightless attention matmuls), estimated with Hutchinson's
method: Tr(H) = E_v[vᵀHv] over Rademacher vectors v. One Hessian-vector product (reverse
over reverse, through the probes of ``probes``) with an independent Rademacher vector on
every op at once estimates all per-op traces: the cross-op terms vᵀ_a H_ab v_b have zero
mean. Q_p is the per-tensor fake quantization of ``probes.fake_quant``.

References:
  Dong et al., HAWQ-V2: Hessian Aware trace-Weighted Quantization (NeurIPS 2020).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from planners.indicator.probes import OpCall, _Tap, sum_calls, training_loss
from qsync_jax.train.task import Task


def hutchinson_traces(
  task: Task, variables, batches: Iterable[Any], calls: list[OpCall], samples: int = 4, seed: int = 0
) -> dict[str, float]:
  """Per call key: the mean over batches and ``samples`` Rademacher draws of vᵀ H_W v."""

  def hvp_terms(variables, batch, key):
    zeros = {c.key: jnp.zeros(c.rhs_shape, c.rhs_dtype) for c in calls}

    def loss(rhs_p):
      return training_loss(task, _Tap(rhs_probes=rhs_p), variables, batch, key)

    grad = jax.grad(loss)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(calls))
    v = {
      c.key: jax.random.rademacher(k, c.rhs_shape, jnp.float32).astype(c.rhs_dtype)
      for c, k in zip(calls, keys)
    }
    hv = jax.grad(lambda p: sum(jnp.vdot(g, v[k]) for k, g in grad(p).items()))(zeros)
    return {k: jnp.vdot(hv[k], v[k]).astype(jnp.float32) for k in v}

  fn = jax.jit(hvp_terms)
  key = jax.random.key(seed)
  totals = {c.key: 0.0 for c in calls}
  n = 0
  for i, batch in enumerate(batches):
    for s in range(samples):
      terms = jax.device_get(fn(variables, batch, jax.random.fold_in(key, i * 1000 + s)))
      for k, t in terms.items():
        totals[k] += float(t)
      n += 1
  return {k: t / max(n, 1) for k, t in totals.items()}


def hessian_omega(
  calls: list[OpCall], traces: dict[str, float], mean_stats: dict[str, dict[str, float]], precisions
) -> dict[str, dict[str, float]]:
  """Ω[op][p] = |Tr(H_W)|/numel(W) · ‖Q_p(W) − W‖², summed over an op's calls.

  The absolute value: away from a minimum the Hessian is indefinite and a trace estimate
  can be negative; its magnitude still measures curvature.
  """
  per_call = {
    c.key: {
      p: abs(traces[c.key]) / mean_stats[c.key]["numel_w"] * mean_stats[c.key][f"wq_err:{p}"]
      for p in precisions
    }
    for c in calls
  }
  return sum_calls(calls, per_call)
