"""Weight-variance baseline (WVAR): Ω = log2(|Σ|Q_p(W)| − Σ|W|| / Σ|W| + 1).

W is the op's right operand (its weight; K or V for attention matmuls, which vary with the
batch, so Ω is averaged over batches); Q_p is the per-tensor fake quantization of
``probes.fake_quant``. An op called several times sums its calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from planners.indicator.probes import OpCall, sum_calls


def wvar(w_abs: float, wq_abs: float) -> float:
  """log2(|Σ|Q(W)| − Σ|W|| / Σ|W| + 1); 0 for an all-zero W."""
  if w_abs == 0:
    return 0.0
  return math.log2(abs(wq_abs - w_abs) / w_abs + 1.0)


def wvar_omega(
  calls: list[OpCall], per_batch: list[Mapping[str, Mapping[str, float]]], precisions
) -> dict[str, dict[str, float]]:
  per_call = {
    c.key: {
      p: sum(wvar(s[c.key]["w_abs"], s[c.key][f"wq_abs:{p}"]) for s in per_batch) / len(per_batch)
      for p in precisions
    }
    for c in calls
  }
  return sum_calls(calls, per_call)
