"""The precision lift: a group's policy with its 8-bit legs at 16 bits (``lifted_policy``), the
alternative a re-planning decision also measures a group at, and its measurements (``Lift``)."""

from __future__ import annotations

import dataclasses

from qsync_jax.policy import PrecisionPolicy, Rule
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy

SIXTEEN_BIT = ("fp16", "bf16")


def lifted_policy(policy: PrecisionPolicy) -> PrecisionPolicy | None:
  """``policy`` with every 8-bit leg (int8, fp8) of every rule and of the default at the 16-bit
  precision the policy's other ops use, the rest as it is; None when nothing is lifted: no
  8-bit leg, or no single such 16-bit precision. That precision is the one (fp16 or bf16) of
  the op policies without an 8-bit leg; where they have none, the one of the 8-bit op
  policies' other legs (``int8_fwd``: fp16). A lift only raises precisions (8 to 16 bits), and
  the plan's fp16 loss scaling stays as it was (the precision is already the policy's)."""
  ops = [r.policy for r in policy.rules] + ([policy.default] if policy.default is not None else [])
  eight = [op for op in ops if any(p in QUANTIZED_PRECISIONS for p in op.precisions)]
  if not eight:
    return None
  others = {p for op in ops if op not in eight for p in op.precisions if p in SIXTEEN_BIT}
  others = others or {p for op in eight for p in op.precisions if p in SIXTEEN_BIT}
  if len(others) != 1:
    return None
  (target,) = others

  def lift(op: OpPolicy | None) -> OpPolicy | None:
    if op is None:
      return None
    return op.replace(
      **{leg: target for leg, p in zip(("fwd", "dlhs", "drhs"), op.precisions) if p in QUANTIZED_PRECISIONS}
    )

  rules = tuple(Rule(r.path, lift(r.policy), r.kind) for r in policy.rules)
  return PrecisionPolicy(rules=rules, default=lift(policy.default))


@dataclasses.dataclass
class Lift:
  """A group's ``lifted`` policy (``lifted_policy`` of its ``running`` one) and its
  ``measured`` ``{batch: ms}`` (added to as the decision measures more batches)."""

  running: PrecisionPolicy
  lifted: PrecisionPolicy
  measured: dict[int, float]
