"""One tolerance table for the whole suite, keyed by precision.

Values are relative errors ‖out − ref‖ / ‖ref‖ for a unit-K reduction; ``rel_tol`` scales
them with √K for a K-long reduction (rounding errors of independent terms add in quadrature).
"""

import math

# Against float32 ("loose"): the error the precision itself introduces.
LOOSE = {"fp32": 1e-6, "tf32": 1e-3, "bf16": 1e-2, "fp16": 1e-3, "int8": 2e-2, "fp8": 1e-1}
# Against a fake-quant reference of the same precision ("tight"): only accumulation order
# and float32 rounding differ.
TIGHT = {"fp32": 1e-6, "tf32": 1e-6, "bf16": 1e-6, "fp16": 1e-6, "int8": 1e-6, "fp8": 1e-6}


def rel_tol(table: dict, precision: str, k: int = 1) -> float:
  return table[precision] * max(1.0, math.sqrt(k) / 4)


def rel_err(out, ref) -> float:
  import numpy as np

  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
