"""Which precisions an Ω table scores, against the 8-bit precisions a cluster's devices run.

A planner puts an op at a precision only where the table scores it (``planners.allocator``'s
ladders), so a table scored at 16 bits alone (``qsync indicator --precisions fp16 bf16``) plans
no 8-bit op, however fast 8 bits would be: ``unscored_eight_bit`` finds the groups that case
leaves without 8 bits, ``unscored_line`` says it in one line, with the command that scores the
missing precisions, and ``warn_unscored`` warns with that line (``QsyncWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

from planners.indicator.probes import PROBED_PRECISIONS
from qsync_jax.cluster import ClusterSpec
from qsync_jax.devices import supported_precisions
from qsync_jax.errors import QsyncWarning
from qsync_jax.precision import PRECISION_BITS

EIGHT_BIT = tuple(p for p, bits in PRECISION_BITS.items() if bits == 8)


def scored_precisions(omega: Mapping[str, Mapping[str, float]]) -> set[str]:
  """Every precision some op of ``omega`` (``{op: {precision: Ω}}``) has an Ω at."""
  return {p for row in omega.values() for p in row}


def unscored_eight_bit(
  omega: Mapping[str, Mapping[str, float]], cluster: ClusterSpec, groups: Iterable[str]
) -> dict[str, list[str]]:
  """``{group: [8-bit precision, …]}``: those of ``groups`` (names of ``cluster``'s groups) whose
  device type runs 8-bit precisions of which ``omega`` scores none, for no op (so no op of the
  group can be planned at 8 bits), with those precisions; {} when there is none."""
  scored = scored_precisions(omega)
  out: dict[str, list[str]] = {}
  for name in groups:
    runs = [p for p in EIGHT_BIT if p in supported_precisions(cluster.group(name).device_type)]
    if runs and not scored.intersection(runs):
      out[name] = runs
  return out


def unscored_line(unscored: Mapping[str, list[str]], omega: Mapping[str, Mapping[str, float]]) -> str:
  """One line: which 8-bit precisions the table lacks, what that means for which groups, and the
  ``qsync indicator`` option that scores them."""
  missing = [p for p in EIGHT_BIT if any(p in runs for runs in unscored.values())]
  scored = sorted(scored_precisions(omega) - {"fp32"})
  wanted = [p for p in PROBED_PRECISIONS if p in {*scored, *missing}]
  return (
    f"the indicator scores no op at {' or '.join(missing)} (it scores {', '.join(scored) or 'none but fp32'}), "
    f"so no op of group(s) {sorted(unscored)} can be planned at 8 bits though their devices run "
    f"{' and '.join(missing)}. Fix: to plan 8-bit ops, score them: `qsync indicator --precisions "
    f"{' '.join(wanted)} ...`."
  )


def warn_unscored(
  omega: Mapping[str, Mapping[str, float]], cluster: ClusterSpec, groups: Iterable[str]
) -> None:
  """A ``QsyncWarning`` with ``unscored_line`` when ``unscored_eight_bit`` finds groups among
  ``groups`` that no op can run at 8 bits (warned here, from one place: a caller that warns
  before planning and the planner say it once)."""
  unscored = unscored_eight_bit(omega, cluster, groups)
  if unscored:
    warnings.warn(unscored_line(unscored, omega), QsyncWarning, stacklevel=1)
