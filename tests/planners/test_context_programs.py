"""In-context op programs (``op_programs.context_programs``) and the profile re-costed with them
(``profiler.with_context_policies``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.op_programs import context_programs
from planners.ops import OpShape
from planners.profiler import measure_profile, with_context_policies
from qsync_jax.errors import PlanError
from qsync_jax.precision import OpPolicy
from tests.planners import tiny
from tests.planners.fakes import fake_profile


def test_context_program_is_the_op_between_a_gelu_producer_and_a_residual_consumer():
  """fp32: the forward and both gradients are those of ``gelu(x + 0.5) @ w + r`` (the program's
  operands are its partial arguments: x, w, r and the output gradient g)."""
  fwd_prog, fwd_bwd_prog = context_programs(OpPolicy.uniform("fp32"), 1, 32, 16, 8)
  x, w, r, g = fwd_bwd_prog.args

  def reference(x, w):
    return jax.nn.gelu(x + 0.5) @ w + r

  want, vjp = jax.vjp(reference, x, w)
  np.testing.assert_allclose(fwd_prog(), want, rtol=1e-5, atol=1e-5)
  y, (dx, dw) = fwd_bwd_prog()
  want_dx, want_dw = vjp(g)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)


def test_context_program_of_an_attention_product_runs_both_activations_through_the_producer():
  op = OpShape("attn/qk", "attention_qk", 4, 8, 16, 8, lhs_shape=(1, 8, 4, 16), rhs_shape=(1, 8, 4, 16))
  fwd_prog, _ = context_programs(OpPolicy.uniform("bf16"), op.batch, op.m, op.k, op.n, op=op)
  q, k, r = fwd_prog.args
  want = jnp.einsum("...qhd,...khd->...hqk", jax.nn.gelu(q + 0.5), jax.nn.gelu(k + 0.5)) + r
  assert fwd_prog().dtype == jnp.float32
  np.testing.assert_allclose(fwd_prog(), want, rtol=0.05, atol=0.05)  # bf16 operands: ~3 significant digits


@pytest.mark.standard_promotion  # optax's Adam in the profiled fp32 step
def test_context_recosts_every_policy_but_fp32_relative_to_fp32():
  prof = measure_profile(tiny.mlp(), 16, ("fp32", "bf16", "int8"), repeats=2, step_repeats=2, clock="cpu")
  out = with_context_policies(prof, repeats=2)
  assert out.meta["policy_operands"] == "context" and "policy_operands" not in prof.meta
  for op in prof.op_names:
    assert out.op_ms[op]["policy:fp32"] == prof.op_ms[op]["policy:fp32"]
    for entry in ("policy:bf16", "policy:int8"):
      assert out.op_ms[op][entry] is not prof.op_ms[op][entry]
      assert set(out.op_ms[op][entry]) == {"fwd", "bwd"} and min(out.op_ms[op][entry].values()) >= 1e-3
    for leg in ("fwd", "dlhs", "drhs"):
      assert out.op_ms[op][leg] == prof.op_ms[op][leg]  # the legs stay as profiled
  assert out.remainder_ms == prof.remainder_ms
  with pytest.raises(PlanError, match="cannot be re-timed on this"):
    with_context_policies(fake_profile([(1, 2, 3)], device_type="H100"))


def test_context_charges_the_fp32_entry_plus_the_in_context_difference(monkeypatch):
  """With the in-context timings stubbed: policy = fp32 entry + (context under it − context
  under fp32), per leg, floored at 1 µs."""
  import planners.profiler as profiler

  timings = {
    "fp32": {"fwd": 1.0, "bwd": 2.0},
    "bf16": {"fwd": 0.25, "bwd": 1.5},
    "int8": {"fwd": 0.1, "bwd": 0.1},
  }
  monkeypatch.setattr(
    profiler,
    "measure_policy",
    lambda pol, *a, **kw: timings[{v: k for k, v in profiler.PRESETS.items()}[pol]],
  )
  monkeypatch.setattr(profiler, "local_device_type", lambda: "cpu")
  monkeypatch.setattr(profiler, "standalone_clock", lambda op_clock, fallback: ("wall", 0.0))
  prof = fake_profile([(4, 8, 8)], device_type="cpu")
  name = prof.op_names[0]
  tables = {**prof.op_ms[name], "policy:fp32": {"fwd": 3.0, "bwd": 6.0}, "policy:bf16": {}, "policy:int8": {}}
  prof = dataclasses.replace(prof, op_ms={name: tables})
  out = with_context_policies(prof).op_ms[name]
  assert out["policy:bf16"] == pytest.approx({"fwd": 2.25, "bwd": 5.5})
  assert out["policy:int8"] == pytest.approx({"fwd": 2.1, "bwd": 4.1})
  assert out["policy:fp32"] == {"fwd": 3.0, "bwd": 6.0}
