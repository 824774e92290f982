"""Random baseline: one uniform draw per op, scaled so lower-bit precisions score higher."""

from __future__ import annotations

import numpy as np

from planners.indicator.probes import OpCall
from qsync_jax.precision import PRECISION_BITS


def random_omega(calls: list[OpCall], per_batch, precisions, seed: int = 0) -> dict[str, dict[str, float]]:
  """Ω[op][p] = u_op · 2^(32 − bits(p)), u_op ~ U(0, 1) drawn with ``seed`` (``per_batch`` unused)."""
  del per_batch
  names = list(dict.fromkeys(c.name for c in calls))
  draws = np.random.default_rng(seed).uniform(size=len(names))
  return {
    n: {p: float(u) * 2.0 ** (32 - PRECISION_BITS[p]) for p in precisions} for n, u in zip(names, draws)
  }
