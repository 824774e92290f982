"""Our indicator: expected squared first-order loss change from the *measured* δY.

For op l at precision p, δY = op_p(X, W) − Y is measured on the fp32 model's own operands
(``probes``), so it is exactly the output error of quantizing that op alone. To first order
the per-sample loss changes by ⟨∂ℓ_i/∂Y_i, δY_i⟩; the indicator is its mean square::

  Ω_l(p) = E_batches E_i [ (∂ℓ_i/∂Y_i · δY_i)² ] = E_batches [ R · Σ_i ⟨∂L/∂Y_i, δY_i⟩² ]

where i runs over the R rows (leading axis) of Y, L = (1/R)·Σ ℓ_i is the batch-mean loss
(so ∂ℓ_i/∂Y_i = R·∂L/∂Y_i) and ∂L/∂Y comes from the probes. The per-sample square is what
makes the estimator work at a trained model: there the batch-mean gradient is nearly zero
and the loss increase is dominated by the second-order term ½·δYᵀ H δY, which the empirical
Fisher E_i[(∇ℓ_i·δY_i)²] estimates (Fisher ≈ Gauss-Newton ≈ Hessian near a minimum) — so
Ω ≈ 2·E[ΔL]. An op called several times sums its calls. The backward legs are not scored
here (the default probed op policy quantizes only the forward product; see ``probes``).
"""

from __future__ import annotations

from collections.abc import Mapping

from planners.indicator.probes import OpCall, mean_over_batches, sum_calls

ESTIMATORS = ("sample", "batch", "signed")


def gradient_omega(
  calls: list[OpCall],
  per_batch: list[Mapping[str, Mapping[str, float]]],
  precisions,
  estimator: str = "sample",
) -> dict[str, dict[str, float]]:
  """Ω[op][p], summed over an op's calls.

  ``estimator="sample"``: mean over batches of R·Σ_i ⟨∂L/∂Y_i, δY_p,i⟩² (the per-sample
  mean square above). ``"batch"``: mean over batches of ⟨∂L/∂Y, δY_p⟩², the squared
  first-order change of the batch-mean loss (its expected squared loss change, E[ΔL²]).
  ``"signed"``: a prediction of the mean loss change itself, first plus second order,
  E[⟨∂L/∂Y, δY⟩] + ½·E[R·Σ_i ⟨∂L/∂Y_i, δY_i⟩²] (negative where quantization happens to
  lower the loss of a model that is still training; a diagnostic, not a sensitivity).
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} is not one of {ESTIMATORS}.")
  mean = mean_over_batches(per_batch)

  def value(stats, p):
    if estimator == "sample":
      return stats[f"rows:{p}"]
    if estimator == "batch":
      return stats[f"first2:{p}"]
    return stats[f"first:{p}"] + 0.5 * stats[f"rows:{p}"]

  return sum_calls(calls, {c.key: {p: value(mean[c.key], p) for p in precisions} for c in calls})
