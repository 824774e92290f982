"""The ``moments`` gradient estimator: Ω = E[ΔL_B²], the mean square loss change of a batch."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.indicator import collect
from planners.indicator.gradient import gradient_omega, moments_omega
from planners.indicator.probes import OpCall
from qsync_jax.models.flax_quant import quantize
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.train.task import Task


class Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="first")(nn.Dense(6, name="zeroth")(x))


def _linear_loss(c):
  """Linear in the model output: the first-order loss change of quantizing an op is exact."""
  return lambda out, batch: (jnp.mean(out * c[None, :]), {})


def _batches(global_batch, seed):
  rng = np.random.default_rng(seed)
  while True:
    yield {"x": (rng.normal(size=(global_batch, 8)) + rng.normal(size=(1, 8))).astype(np.float32)}


def test_moments_predicts_the_mean_square_loss_change_of_a_batch():
  """Probing a whole population of samples, Ω(B) equals m² + σ²/B of the per-sample loss
  changes measured through ``qsync_jax.quantize``: the mean square of the loss change of a
  batch of B samples drawn from it. The B = 1 and B = 64 answers differ (unless m² ≫ σ²)."""
  rng = np.random.default_rng(101)
  seed = int(rng.integers(1 << 30))
  c = jnp.asarray(rng.normal(size=(4,)).astype(np.float32))
  loss = _linear_loss(c)
  task = Task(name="linear", model=Linear(), inputs=lambda b: (b["x"],), loss=loss, train_batches=_batches)
  stream = task.train_batches(32, seed)
  batches = [next(stream) for _ in range(32)]  # the population: N = 1024 samples
  x = jnp.asarray(np.concatenate([b["x"] for b in batches]))
  variables = task.model.init(jax.random.key(seed), x[:2])
  calls, per_batch = collect(task, variables, batches, ("int8",))
  base = task.model.apply(variables, x)
  for op in ("zeroth:dense", "first:dense"):
    qmodel = quantize(
      task.model, PrecisionPolicy.from_ops({op: OpPolicy(fwd="int8", dlhs="fp32", drhs="fp32")})
    )
    # Per-row activation scales: a sample's quantized output does not depend on its batch.
    change = np.asarray(jnp.mean((qmodel.apply(variables, x) - base) * c[None, :], axis=1), np.float64)
    m, var = change.mean(), change.var()
    assert var > 0
    for batch in (1, 64):
      omega = gradient_omega(calls, per_batch, ("int8",), "moments", batch)[op]["int8"]
      # Ω − (m² + σ²/B) = m·E[s²] + E[s²]²/4 − σ²/N: the Fisher term (the true Hessian is 0
      # here; negligible at int8 errors) and the bias correction, at most B/N = 6 % of σ²/B.
      assert omega == pytest.approx(m * m + var / batch, rel=0.1), (op, batch)


def test_moments_formula_and_default_batch_on_hand_made_stats():
  rng = np.random.default_rng(102)
  rows = int(rng.integers(2, 9))
  s = rng.normal(loc=rng.normal(), size=(3, rows))  # per-sample loss changes of 3 batches
  per_batch = [{"a:dense": {"first:int8": b.mean(), "rows:int8": np.mean(b * b)}} for b in s]
  call = OpCall("a:dense", "a:dense", "dense", 0, (), (), (rows, 5), jnp.float32, jnp.float32)
  n, m, var = s.size, s.mean(), s.var(ddof=1)
  mu = m + 0.5 * np.mean(s * s)
  for batch in (None, 1, 7):
    b = rows if batch is None else batch
    want = max(mu * mu - var / n + var / b, 0.0)
    got = gradient_omega([call], per_batch, ("int8",), "moments", batch)["a:dense"]["int8"]
    assert got == pytest.approx(want, rel=1e-9)
  assert moments_omega(0.0, 0.0, 10, 4) == 0.0  # a dead op: no change, no spread
  assert moments_omega(-1e-3, 1e-6, 1, 4) == pytest.approx((-1e-3 + 5e-7) ** 2)  # one sample: no spread
  with pytest.raises(ValueError, match="loss_batch_size"):
    gradient_omega([call], per_batch, ("int8",), "moments", 0)
