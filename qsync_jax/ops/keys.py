"""Whether an op call needs a PRNG key, and the error naming the fix where it has none.

An op policy that rounds stochastically (``OpPolicy.needs_rng``) needs a key in the legs that
round so: the forward where it quantizes its operands stochastically
(``OpPolicy.forward_needs_rng``), the gradient legs otherwise. So the forward pass of a policy
that rounds only its gradients stochastically (the ``int8`` preset) — evaluation, inference —
runs without a key; differentiating it without one raises ``QsyncError`` when the gradient is
traced.
"""

from __future__ import annotations

from qsync_jax.errors import QsyncError
from qsync_jax.precision import OpPolicy

KEY_FIX = (
  "pass key=jax.random.key(...) (through Flax: apply(..., rngs={'qsync': key}), a fresh key each step; a "
  "quantized nnx module: qsync_jax.quantize(model, policy, rngs=nnx.Rngs(qsync=0)))"
)


def check_forward_key(op_policy: OpPolicy, key) -> None:
  """``QsyncError`` when the forward of ``op_policy`` rounds stochastically and ``key`` is None."""
  if key is None and op_policy.forward_needs_rng:
    raise QsyncError(
      f"op policy {op_policy} rounds its operands stochastically and needs a PRNG key. Fix: {KEY_FIX}."
    )


def check_backward_key(op_policy: OpPolicy, key) -> None:
  """``QsyncError`` when a gradient leg of ``op_policy`` rounds stochastically and ``key`` is None
  (raised as the gradient is traced)."""
  if key is None and op_policy.needs_rng:
    raise QsyncError(
      f"op policy {op_policy} rounds its gradients stochastically, so its gradient needs a PRNG key (its "
      f"forward alone, as in evaluation, needs none). Fix: {KEY_FIX}."
    )
