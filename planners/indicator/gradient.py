"""Our indicator: the expected squared loss change of a batch, from the *measured* δY.

For op l at precision p, δY = op_p(X, W) − Y is measured on the fp32 model's own operands
(``probes``), so it is exactly the output error of quantizing that op alone. Write
s_i = ⟨∂ℓ_i/∂Y_i, δY_i⟩ for the first-order change of sample i's loss (i runs over the R rows,
the leading axis, of Y; ∂ℓ_i/∂Y_i = R·∂L/∂Y_i with L the batch-mean loss and ∂L/∂Y from the
probes). To second order, the loss change of a batch of B samples is

  ΔL_B = (1/B)·Σ_i s_i + ½·δYᵀ H δY / B,   E[ΔL_B] = μ = E[s] + ½·E[s²],   Var[ΔL_B] = Var[s]/B

with the Hessian term replaced by the empirical Fisher E[s²] (Fisher ≈ Gauss-Newton ≈ H near
a minimum). The default estimator (``moments``) scores an op by the mean square of that
batch loss change, the sensitivity an allocator needs whatever the sign of the change::

  Ω_l(p) = E[ΔL_B²] = μ² + Var[s]/B

estimated from the N = (batches × R) probed samples: m̂ = mean s, Ŝ = mean s², v̂ = (Ŝ − m̂²)·N/(N−1),
μ̂ = m̂ + ½Ŝ, and Ω = max(μ̂² − v̂/N + v̂/B, 0) (μ̂² overestimates μ² by Var[μ̂] ≈ v̂/N). B is the
batch the loss change is judged on (default: the probed batches' R). Two regimes meet here:

* the mean μ: a network that is still training has ∇L ≠ 0 over the data, so ⟨∇L, δY⟩ — fixed
  by where nearest rounding happens to fall — is a systematic, signed change;
* the spread Var[s]/B: over batches the first-order term fluctuates around μ. Neither
  term alone ranks ops well (E[s²] alone — B = 1, ``sample`` — over-weights the spread).

BatchNorm in training mode couples the samples of a batch (∂L/∂Y is taken through the batch
statistics), so the s_i of one batch are not independent and Var[s]/B is approximate there.
Estimating μ needs many samples where Var[s] is large (its standard error is √(v̂/N)): use
more probed batches rather than larger ones. An op called several times sums its calls' Ω.
Only the forward product's δY is scored (the default probed op policy; see ``probes``).
"""

from __future__ import annotations

from collections.abc import Mapping

from planners.indicator.probes import OpCall, mean_over_batches, sum_calls

ESTIMATORS = ("moments", "sample", "batch", "signed")


def moments_omega(m: float, s2: float, n: int, batch: float) -> float:
  """max(μ² − v/n + v/batch, 0): E[ΔL_batch²] from n samples with mean ``m``, mean square ``s2``.

  μ = m + ½·s2 and v = (s2 − m²)·n/(n−1), the unbiased variance of the per-sample change.
  """
  var = max(s2 - m * m, 0.0) * n / (n - 1) if n > 1 else 0.0
  mu = m + 0.5 * s2
  return max(mu * mu - var / n + var / batch, 0.0)


def gradient_omega(
  calls: list[OpCall],
  per_batch: list[Mapping[str, Mapping[str, float]]],
  precisions,
  estimator: str = "moments",
  loss_batch_size: int | None = None,
) -> dict[str, dict[str, float]]:
  """Ω[op][p], summed over an op's calls.

  ``estimator="moments"`` (default): E[ΔL_B²] of a batch of B = ``loss_batch_size`` samples
  (default: the probed batches' rows R), from the per-sample moments (module docstring).
  ``"sample"``: E[s²], the per-sample mean square (= ``moments`` at B = 1 without the mean
  and bias terms). ``"batch"``: mean over batches of ⟨∂L/∂Y, δY_p⟩², the squared first-order
  change of each probed batch (E[ΔL_R²] from one square per batch: noisier than ``moments``).
  ``"signed"``: μ = E[s] + ½·E[s²], a prediction of the mean loss change itself (negative
  where quantization happens to lower the loss of a model that is still training; it ranks
  the *signed* mean change, not a sensitivity).
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} is not one of {ESTIMATORS}.")
  if loss_batch_size is not None and loss_batch_size < 1:
    raise ValueError(f"loss_batch_size={loss_batch_size} must be at least 1 (or None: the probed batch).")
  mean = mean_over_batches(per_batch)

  def value(call, stats, p):
    if estimator == "sample":
      return stats[f"rows:{p}"]
    if estimator == "batch":
      return stats[f"first2:{p}"]
    if estimator == "signed":
      return stats[f"first:{p}"] + 0.5 * stats[f"rows:{p}"]
    rows = call.out_shape[0] if call.out_shape else 1
    n = rows * len(per_batch)
    batch = rows if loss_batch_size is None else loss_batch_size
    return moments_omega(stats[f"first:{p}"], stats[f"rows:{p}"], n, batch)

  return sum_calls(calls, {c.key: {p: value(c, mean[c.key], p) for p in precisions} for c in calls})
