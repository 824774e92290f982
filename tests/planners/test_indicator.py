"""Sensitivity indicators: known answers on toy models, coverage of every op kind, formulas."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.indicator import METHODS, PROBED_PRECISIONS, collect, compute
from planners.indicator.gradient import gradient_omega
from planners.indicator.gvar import GvarConfig, gvar_omega, sigmas, typical_exponent
from planners.indicator.probes import OpCall
from planners.indicator.wvar import wvar
from qsync_jax.models.flax_quant import quantize
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.train.task import Task
from tests.planners import tiny


def _regression_task(model, features=8, outputs=4, name="toy"):
  def batches(global_batch, seed):
    rng = np.random.default_rng(seed)
    while True:
      yield {
        "x": rng.normal(size=(global_batch, features)).astype(np.float32),
        "y": rng.normal(size=(global_batch, outputs)).astype(np.float32),
      }

  def loss(out, batch):
    return jnp.mean(jnp.square(out - batch["y"])), {}

  return Task(name=name, model=model, inputs=lambda b: (b["x"],), loss=loss, train_batches=batches)


class LoudQuietDead(nn.Module):
  """Three parallel Dense ops: one scaled ×10 into the output, one ×1, one ×0 (dead)."""

  @nn.compact
  def __call__(self, x):
    loud = nn.Dense(4, name="loud")(x)
    quiet = nn.Dense(4, name="quiet")(x)
    dead = nn.Dense(4, name="dead")(x)
    return 10.0 * loud + quiet + 0.0 * dead


def _variables(task, seed):
  batch = next(task.train_batches(8, seed))
  return task.model.init(jax.random.key(seed), *task.inputs(batch)), batch


@pytest.mark.parametrize("method", ["gradient", "hessian"])
def test_dead_op_lowest_and_loud_op_highest(method):
  seed = 101
  task = _regression_task(LoudQuietDead())
  variables, _ = _variables(task, seed)
  batches = [next(task.train_batches(16, seed + i)) for i in range(3)]
  table = compute(task, variables, batches, [method], ("int8", "fp16"), seed=seed)[method]
  omega = table["omega"]
  for p in ("int8", "fp16"):
    assert omega["dead:dense"][p] == 0.0  # its output is multiplied by 0: ∂L/∂Y = 0, H = 0
    # ×10 output → ~×100 Ω (median ×137 over 60 seeds), but the two ops' own weights quantize
    # differently: the smallest ratio seen was ×7.5, under the ×10 this asked for (1 seed in 60)
    assert omega["loud:dense"][p] > 3 * omega["quiet:dense"][p] > 0
  assert omega["loud:dense"]["int8"] > omega["loud:dense"]["fp16"]


class Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="first")(nn.Dense(6, name="zeroth")(x))


def test_first_order_term_is_the_measured_loss_change_for_a_linear_loss():
  """For a loss linear in every op's output, ⟨∂L/∂Y, δY⟩ is the exact loss change of
  quantizing that op alone (same policy through ``qsync_jax.quantize``)."""
  rng = np.random.default_rng(102)
  c = jnp.asarray(rng.normal(size=(4,)).astype(np.float32))

  def loss(out, batch):
    return jnp.mean(out * c[None, :]), {}

  task = _regression_task(Linear())
  task = Task("linear", task.model, task.inputs, loss, task.train_batches)
  seed = int(rng.integers(1 << 30))
  variables, _ = _variables(task, seed)
  batch = next(task.train_batches(8, seed + 1))
  _, per_batch = collect(task, variables, [batch], ("int8", "bf16"))
  base = loss(task.model.apply(variables, batch["x"]), batch)[0]
  for op in ("zeroth:dense", "first:dense"):
    for p in ("int8", "bf16"):
      qmodel = quantize(task.model, PrecisionPolicy.from_ops({op: OpPolicy(fwd=p, dlhs="fp32", drhs="fp32")}))
      change = float(loss(qmodel.apply(variables, batch["x"]), batch)[0] - base)
      # fp32 sums of differently ordered products: agreement to float32 rounding of the loss.
      assert per_batch[0][op][f"first:{p}"] == pytest.approx(change, rel=1e-3, abs=1e-7)
      assert abs(change) > 0


def test_every_op_scored_by_every_method_including_attention_matmuls():
  task = tiny.attn(seq=4, dim=8)
  seed = 103
  batch = next(task.train_batches(4, seed))
  variables = task.model.init(jax.random.key(seed), *task.inputs(batch))
  ops = quantize(task.model, PrecisionPolicy.uniform("fp32")).ops(variables, *task.inputs(batch))
  assert {"attn:attention_qk", "attn:attention_pv"} <= set(ops)
  tables = compute(task, variables, [batch], METHODS, seed=seed, hutchinson_samples=1)
  for method, table in tables.items():
    assert table["method"] == method
    assert set(table["omega"]) == set(ops) and table["ops"] == list(dict.fromkeys(table["ops"]))
    for op in ops:
      row = table["omega"][op]
      assert set(row) == {"fp32", *PROBED_PRECISIONS} and row["fp32"] == 0.0
      assert all(math.isfinite(v) and v >= 0 for v in row.values()), (method, op, row)
    if method != "random":  # attention matmuls have no weight and must still be scored
      assert table["omega"]["attn:attention_qk"]["int8"] > 0, method


def _stats(**overrides):
  stats = dict(
    numel_x=6.0,
    numel_w=4.0,
    numel_y=3.0,
    x2=2.0,
    w2=3.0,
    gw2=5.0,
    max_x=1.27,
    max_w=2.54,
    mean_x=0.3,  # log2 0.3 = -1.74 → e = -2
    mean_w=40.0,  # log2 40 = 5.3 → e = 5
    mean_g=1e-4,  # log2 1e-4 = -13.3 → e = -14 (|e| = 14, capped at 5)
  )
  stats.update(overrides)
  return stats


def test_gvar_formulas_on_a_hand_computed_case():
  s = _stats()
  assert [typical_exponent(v) for v in (0.3, 40.0, 1e-4, 0.0)] == [2, 5, 5, 5]
  assert [typical_exponent(v, signed=True) for v in (0.3, 40.0, 1e-4)] == [-2, 5, -14]
  fwd, bwd = sigmas(s, "int8")
  sx, sw = 0.01, 0.02
  assert fwd == pytest.approx((3 * sx**2 * 6 + 2 * sw**2 * 4) / 6)
  assert bwd == pytest.approx((5 * sx**2 * 6 + 2 * 2**-4 * 2**-18 * 3) / 6)
  fwd, bwd = sigmas(s, "fp16")
  assert fwd == pytest.approx(2**-18 * (3 * 6 * 2**-4 + 2 * 4 * 2**10) / 6)
  assert bwd == pytest.approx(2**-18 * (5 * 6 * 2**-4 + 2 * 3 * 2**-28) / 6)
  # The public code's variant: un-squared norms, exponent used linearly.
  fwd, _ = sigmas(s, "fp16", GvarConfig(square_norms=False, exponent="linear"))
  assert fwd == pytest.approx(2**-18 * (math.sqrt(3) * 6 * 2 + math.sqrt(2) * 4 * 5) / 6)
  assert sigmas(s, "fp32") == (0.0, 0.0)
  assert sigmas(s, "bf16")[0] == pytest.approx(sigmas(s, "fp16")[0] * 2**6)


def test_gvar_depth_weighting():
  calls = [
    OpCall(f"op{i}:dense", f"op{i}:dense", "dense", i, (), (), (), jnp.float32, jnp.float32) for i in range(2)
  ]
  s = _stats()
  per_batch = [{c.key: s for c in calls}, {c.key: s for c in calls}]
  omega = gvar_omega(calls, per_batch, ("int8",))
  fwd, bwd = sigmas(s, "int8")
  # L = 2 ops, depths 0 and 1, γ = 4.
  assert omega["op0:dense"]["int8"] == pytest.approx(4 * 2 * fwd)
  assert omega["op1:dense"]["int8"] == pytest.approx(4 * 1 * fwd + 1 * bwd)


def test_gradient_estimators_on_hand_made_stats():
  calls = [OpCall("a:dense", "a:dense", "dense", 0, (), (), (), jnp.float32, jnp.float32)]
  rng = np.random.default_rng(104)
  first, rows = rng.normal(size=2), rng.uniform(size=2)
  per_batch = [
    {"a:dense": {"first:int8": f, "first2:int8": f * f, "rows:int8": r}} for f, r in zip(first, rows)
  ]
  est = {
    e: gradient_omega(calls, per_batch, ("int8",), e)["a:dense"]["int8"]
    for e in ("sample", "batch", "signed")
  }
  assert est["sample"] == pytest.approx(rows.mean())
  assert est["batch"] == pytest.approx(np.mean(first**2))
  assert est["signed"] == pytest.approx(first.mean() + 0.5 * rows.mean())
  with pytest.raises(ValueError, match="estimator"):
    gradient_omega(calls, per_batch, ("int8",), "nope")


def test_wvar_formula():
  assert wvar(4.0, 5.0) == pytest.approx(math.log2(1.25))
  assert wvar(4.0, 3.0) == pytest.approx(math.log2(1.25))
  assert wvar(4.0, 4.0) == 0.0 and wvar(0.0, 0.0) == 0.0


def test_unknown_method_or_precision_is_rejected():
  from qsync_jax.errors import QsyncError

  task = _regression_task(Linear())
  variables, batch = _variables(task, 0)
  with pytest.raises(QsyncError, match="method 'nope'"):
    compute(task, variables, [batch], ["nope"])
  with pytest.raises(QsyncError, match="precision 'fp4'"):
    compute(task, variables, [batch], ["gradient"], ("fp4",))


def test_the_gradient_stats_alone_are_the_same_numbers_without_weight_probes_or_quantized_weights():
  """``compute`` of the gradient indicator alone traces ``GRADIENT_STATS`` only (one smaller
  program: no ∂L/∂W probes, no quantized copies of W); its numbers are those of the full pass."""
  from planners.indicator.probes import GRADIENT_STATS

  task = tiny.mlp(features=8, hidden=16)
  variables, _ = _variables(task, 5)
  stream = task.train_batches(8, 6)
  batches = [next(stream) for _ in range(2)]
  _, every = collect(task, variables, batches, ("int8", "fp8"))
  _, alone = collect(task, variables, batches, ("int8", "fp8"), stats=GRADIENT_STATS)
  for full, part in zip(every, alone):
    for op, stats in part.items():
      assert set(stats) == {f"{s}:{p}" for s in GRADIENT_STATS for p in ("int8", "fp8")}
      # the same operations; XLA may fuse the smaller program differently: float32 rounding apart
      assert stats == pytest.approx({k: full[op][k] for k in stats}, rel=1e-6) and "gw2" in full[op]


def test_ops_whose_output_does_not_reach_the_loss_are_named_with_the_fix():
  """An op scoring Ω = 0 at every precision (its output cut off the loss at the probed parameters,
  as a residual branch behind a zero-initialised norm scale is at initialisation) is listed by
  ``unreached_ops``; the note says to probe after training only where the table was probed at 0 steps."""
  from planners.indicator import unreached_note, unreached_ops

  table = {
    "ops": ["a", "b", "c"],
    "omega": {
      "a": {"fp32": 0.0, "int8": 0.0, "fp16": 0.0},
      "b": {"fp32": 0.0, "int8": 1e-9, "fp16": 0.0},
      "c": {"fp32": 0.0},  # nothing probed: not called unreached
    },
  }
  assert unreached_ops(table) == ["a"]
  note = unreached_note(table, train_steps=0)
  assert note.startswith("1 of 3 ops score Ω = 0 at every precision (a)") and "--train-steps 40" in note
  assert "--train-steps" not in unreached_note(table, train_steps=40)
  table["omega"]["a"]["int8"] = 1e-12
  assert unreached_ops(table) == [] and unreached_note(table, 0) is None
