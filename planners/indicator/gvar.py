"""QSync's GVAR indicator, with the public code's defects fixed.

For op l with input X, weight W (for attention matmuls, which have no weight: the right
operand K or V, and its gradient ∂L/∂K, ∂L/∂V), output Y, weight gradient ∇W, depth d_l
and L ops::

  int8:  σ²_fwd = (‖W‖²·Sx²·numel(X) + ‖X‖²·Sw²·numel(W)) / 6       Sx = max|X|/127, Sw = max|W|/127
         σ²_bwd = (‖∇W‖²·Sx²·numel(X) + ‖X‖²·2^(2e_X)·2^(-2k)·numel(Y)) / 6
  float: σ²_fwd = 2^(-2k)·(‖W‖²·numel(X)·2^(2e_X) + ‖X‖²·numel(W)·2^(2e_W)) / 6
         σ²_bwd = 2^(-2k)·(‖∇W‖²·numel(X)·2^(2e_X) + ‖X‖²·numel(Y)·2^(2e_G)) / 6
  Ω_l = γ·(L − d_l)·σ²_fwd + d_l·σ²_bwd,   γ = 4,  fp32: 0

Choices where the paper / public code are ambiguous (each a ``GvarConfig`` field):

* Norms are squared Frobenius norms (the code used them un-squared; a variance sums squares).
* The "typical magnitude" of a tensor is its mean absolute value, e = ⌊log2(mean |T|)⌋.
  The float formulas use 2^(2e) — the variance of rounding a value of binary exponent e to a
  k-bit mantissa is ∝ 2^(2(e−k)), as the int8 backward term already writes — with the
  *signed* e capped above at 5: with the paper's |e| a tiny tensor (e = −10) would count as a
  huge one (2^(+20)) and fp16 would score above int8. ``exponent="linear"`` reproduces the
  public code instead: e_T = |e| capped at 5, used linearly.
* k per format: fp16 k = 9 (the paper's value; 10 mantissa bits − 1), bf16 k = 6 and fp8
  (e4m3) k = 2 by the same rule. fp8 is not in the paper; it uses the float formulas.
* The int8 backward term is written with e_X as in the paper (QSync's int8 op runs its
  backward in fp16, hence the fp16 2^(-2k)).
* Depth d_l = the op's position (0-based) in forward call order; L = number of ops, so the
  first op's forward error is weighted γ·L and the last op's γ·1.
* Ω is computed per batch and averaged over batches; an op called several times sums its calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from planners.indicator.probes import OpCall, sum_calls

MANTISSA_K = {"fp16": 9, "bf16": 6, "fp8": 2}


@dataclasses.dataclass(frozen=True)
class GvarConfig:
  """Constants and the documented choices of GVAR (see the module docstring)."""

  gamma: float = 4.0
  k: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(MANTISSA_K))
  square_norms: bool = True
  exponent: str = "power"  # "power": 2^(2e); "linear": e (the public code)
  exponent_cap: int = 5


def typical_exponent(mean_abs: float, cap: int = 5, signed: bool = False) -> int:
  """Binary exponent ⌊log2(mean |·|)⌋ of a tensor's typical magnitude, capped at ``cap``.

  ``signed=False``: its absolute value, capped (the paper's e_·); ``signed=True``: the exponent
  itself, capped above (an all-zero tensor gives -126, the float32 floor).
  """
  if not mean_abs > 0 or not math.isfinite(mean_abs):
    return -126 if signed else cap
  e = math.floor(math.log2(mean_abs))
  return min(e, cap) if signed else min(abs(e), cap)


def sigmas(
  stats: Mapping[str, float], precision: str, config: GvarConfig = GvarConfig()
) -> tuple[float, float]:
  """``(σ²_fwd, σ²_bwd)`` of one op call on one batch from its probe stats."""
  norm = (lambda sq: sq) if config.square_norms else math.sqrt
  w, x, gw = norm(stats["w2"]), norm(stats["x2"]), norm(stats["gw2"])
  n_x, n_w, n_y = stats["numel_x"], stats["numel_w"], stats["numel_y"]

  def exp_term(mean_abs):
    if config.exponent == "power":
      return 2.0 ** (2 * typical_exponent(mean_abs, config.exponent_cap, signed=True))
    return float(typical_exponent(mean_abs, config.exponent_cap))

  e_x, e_w, e_g = exp_term(stats["mean_x"]), exp_term(stats["mean_w"]), exp_term(stats["mean_g"])
  if precision == "int8":
    sx, sw = stats["max_x"] / 127.0, stats["max_w"] / 127.0
    two_k = 2.0 ** (-2 * config.k["fp16"])
    fwd = (w * sx**2 * n_x + x * sw**2 * n_w) / 6.0
    bwd = (gw * sx**2 * n_x + x * e_x * two_k * n_y) / 6.0
    return fwd, bwd
  if precision in config.k:
    two_k = 2.0 ** (-2 * config.k[precision])
    fwd = two_k * (w * n_x * e_x + x * n_w * e_w) / 6.0
    bwd = two_k * (gw * n_x * e_x + x * n_y * e_g) / 6.0
    return fwd, bwd
  if precision == "fp32":
    return 0.0, 0.0
  raise ValueError(f"GVAR has no formula for precision {precision!r}; it scores int8, fp8, fp16, bf16, fp32.")


def gvar_omega(
  calls: list[OpCall],
  per_batch: list[Mapping[str, Mapping[str, float]]],
  precisions,
  config: GvarConfig = GvarConfig(),
) -> dict[str, dict[str, float]]:
  """Ω[op][p] = mean over batches of γ·(L − d_l)·σ²_fwd + d_l·σ²_bwd (summed over calls)."""
  order = list(dict.fromkeys(c.name for c in calls))
  depth = {name: i for i, name in enumerate(order)}
  n_ops = len(order)
  per_call = {}
  for c in calls:
    d = depth[c.name]
    row = {}
    for p in precisions:
      total = 0.0
      for stats in per_batch:
        fwd, bwd = sigmas(stats[c.key], p, config)
        total += config.gamma * (n_ops - d) * fwd + d * bwd
      row[p] = total / len(per_batch)
    per_call[c.key] = row
  return sum_calls(calls, per_call)
