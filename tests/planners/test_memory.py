"""Predicted step memory: what XLA keeps for the backward, forward transients, the fp32 timeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.ops import OpShape
from planners.predictor.memory_model import (
  forward_extra_bytes,
  kept_bytes,
  memory_bytes,
  residual_bytes,
  sixteen_bit_share,
  transient_bytes,
)
from planners.profile import GroupCost
from planners.profiler import timing
from planners.profiler.fit import fit_memory
from planners.profiler.hlo import element_bytes, entry_instructions
from planners.profiler.measure import step_memory, task_ops, traced_profile
from planners.profiler.step_hlo import forward_headroom, live_ranges, live_totals
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from tests.planners import tiny


def _conv(rng):
  """A 3×3 conv as its im2col GEMM: ``batch·h·w`` rows, ``9·c_in`` columns, ``c_out`` outputs.

  Sized like a real CNN layer, whose activation outweighs its weight (batch·h·w ≥ 256 rows
  against ≤ 8 channels): the forward-extra formulas pick the activation residual there. (With
  the earlier 8-row minimum, the fp32 weight copy of an fp8 op could exceed it, and the
  forward-extra test failed for such draws.)"""
  n, hw = int(rng.integers(4, 9)), int(rng.integers(8, 17))
  c_in, c_out = (int(x) for x in rng.integers(2, 9, 2))
  m, k = n * hw * hw, 9 * c_in
  return OpShape("c:conv", "conv", 1, m, k, c_out, 1, m * c_in, k * c_out, m * c_out)


def test_fp8_residuals_are_kept_as_fp32_where_the_backend_has_no_fp8():
  rng = np.random.default_rng(11)
  op = _conv(rng)
  fp8 = OpPolicy.preset("fp8")
  patches, scales = op.m * op.k, 4 * (op.m + op.n)
  assert residual_bytes(op, fp8) == patches + op.rhs_elems + scales
  # XLA:CPU: both residuals as fp32 (the weight only when the dlhs leg reads it), none
  # dequantized in the backward
  assert kept_bytes(op, fp8, True, True, True) == 4 * patches + 4 * op.rhs_elems + scales
  assert kept_bytes(op, fp8, True, False, True) == 4 * patches + scales
  assert transient_bytes(op, fp8, True, True) == 0
  # elsewhere: 1-byte residuals, read as they are by fp8 gradient legs
  assert kept_bytes(op, fp8) == residual_bytes(op, fp8)
  assert transient_bytes(op, fp8) == 0
  # an int8 residual stays 1-byte on XLA:CPU too
  int8 = OpPolicy.uniform("int8")
  assert kept_bytes(op, int8, True, True, True) == residual_bytes(op, int8)


def test_a_float_drhs_leg_keeps_the_conv_patches_dequantized():
  rng = np.random.default_rng(12)
  op = _conv(rng)
  int8_fwd = OpPolicy.preset("int8_fwd")
  patches = op.m * op.k
  # the saved activation of an im2col conv is its patch matrix, not its input
  assert kept_bytes(op, int8_fwd, True) == residual_bytes(op, int8_fwd) + 3 * patches
  # already fp32: only the weight is dequantized in the backward
  assert transient_bytes(op, int8_fwd, True) == 4 * op.rhs_elems


def test_native_backends_dequantize_a_residual_to_the_width_of_the_leg_that_reads_it():
  rng = np.random.default_rng(13)
  op = _conv(rng)
  patches = op.m * op.k
  # int8 forward, fp16 gradients (QSync's int8 op): both residuals dequantized to 2 bytes
  assert transient_bytes(op, OpPolicy.preset("int8_fwd")) == 2 * (patches + op.rhs_elems)
  # an fp32 drhs leg reads fp32 patches; an int8 dlhs leg reads the 1-byte weight itself
  mixed = OpPolicy(fwd="int8", dlhs="int8", drhs="fp32")
  assert transient_bytes(op, mixed) == 4 * patches
  assert transient_bytes(op, OpPolicy.uniform("int8")) == 0
  # float forwards keep no 8-bit residual to dequantize
  assert transient_bytes(op, OpPolicy.uniform("bf16")) == 0


def test_forward_extra_of_a_quantized_conv_on_cpu():
  rng = np.random.default_rng(14)
  op = _conv(rng)
  patches, gemm = op.m * op.k, op.m * op.k + op.rhs_elems
  # an int8 drhs leg reads the saved int8 values: the busiest moment stacks the fp32 patches
  # from as many bytes of strided slices (above the GEMM's patches + 8-bit operands)
  assert forward_extra_bytes(op, OpPolicy.uniform("int8"), True) == max(8 * patches, 4 * patches + gemm)
  # a float drhs leg reads the activation dequantized, computed in the forward: fp32 patches
  # + 8-bit GEMM operands + the dequantized activation residual
  mixed = OpPolicy(fwd="int8", dlhs="int8", drhs="bf16")
  assert forward_extra_bytes(op, mixed, True) == 4 * patches + gemm + 4 * patches
  # fp8 GEMM operands are fp32 copies there
  assert forward_extra_bytes(op, OpPolicy.uniform("fp8"), True, True, True) == 8 * patches + 4 * gemm
  # a float op holds only what it keeps beyond the fp32 op
  assert forward_extra_bytes(op, None) == 0
  assert forward_extra_bytes(op, OpPolicy.uniform("bf16"), True) == 0


HLO = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[4]) -> (f32[4]) {
  %p = f32[4]{0} parameter(0)
  %a = f32[100]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/jvp(M)/Dense_0/dot_general"}
  %a2 = f32[10,10]{1,0} bitcast(%a)
  %b = (f32[25], s8[100]) fusion(%a2), kind=kLoop, calls=%g, metadata={op_name="jit(step)/jvp(M)/Dense_1/dot_general"}
  %b0 = f32[25]{0} get-tuple-element(%b), index=0
  %c = f32[4]{0} fusion(%b0, %a), kind=kLoop, calls=%h, metadata={op_name="jit(step)/transpose(jvp(M))/Dense_1/dot_general"}
  ROOT %t = (f32[4]{0}) tuple(%c)
}
"""


def _live(hlo):
  instructions = entry_instructions(hlo)
  return live_totals(live_ranges(instructions), len(instructions))


def test_live_bytes_follow_the_schedule():
  assert element_bytes("(f32[25], s8[100]{0})") == [100, 100]
  assert element_bytes("bf16[3,5]{1,0}") == [30]
  live = _live(HLO)
  # %a (400 B) lives until %c reads it (through its bitcast too); %b's first element (100 B)
  # until %c reads it, its second, never read, only at %b; parameters and the returned %c are
  # not temporaries
  assert live == [0, 400, 400, 600, 500, 500, 0]
  ops = [OpShape("Dense_0:dense", "dense", 1, 1, 1, 1), OpShape("Dense_1:dense", "dense", 1, 1, 1, 1)]
  assert forward_headroom(HLO, ops) == {"Dense_0:dense": 200, "Dense_1:dense": 0}


GPU_HLO = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[4]) -> (f32[4]) {
  %p = f32[4]{0} parameter(0)
  %conv = (f32[100]{0}, u8[1000]{0}) custom-call(%p), custom_call_target="__cudnn$convForward"
  %two = (f32[50]{0}, bf16[100]{0}) fusion(%conv#0), kind=kLoop, calls=%f
  %use = f32[10]{0} fusion(%two#1), kind=kLoop, calls=%g
  %last = f32[4]{0} fusion(%use, %two#0), kind=kLoop, calls=%h
  ROOT %t = (f32[4]{0}) tuple(%last)
}
"""


def test_live_bytes_of_tuple_elements_and_library_scratch():
  assert element_bytes("(f32[25], (s8[100], u8[4]{0}))") == [100, 104]
  live = _live(GPU_HLO)
  # the conv's scratch (1000 B) lives only while it runs, its output (400 B) until %two reads
  # it as %conv#0; %two's elements die at their own last uses: bf16[100] at %use, f32[50] at %last
  assert live == [0, 1400, 400 + 200 + 200, 200 + 200 + 40, 200 + 40, 0]


def test_forward_headroom_of_a_real_step_is_below_its_peak():
  task = tiny.cnn(8, int(np.random.default_rng(15).integers(4, 9)))
  prof = traced_profile(task, 8)
  assert set(prof.forward_headroom) == set(prof.op_names)
  # bytes below the fp32 step's peak of live temporaries: never negative, never the whole step
  assert all(0 <= h < prof.meta["fp32_xla_peak_bytes"] for h in prof.forward_headroom.values())


@pytest.mark.parametrize("preset", ["fp8", "int8_fwd", "int8"])
def test_predicted_memory_of_a_quantized_cnn_matches_xla(preset):
  # The compiled step on XLA:CPU peaks in a quantized conv's forward (fp32 patches beside their
  # strided slices, or beside the GEMM operands and a dequantized residual) and keeps fp8 /
  # upcast residuals as fp32. 15 % allows for other XLA versions' fusion choices.
  task = tiny.cnn(8, 8)
  batch_size = 16
  prof = traced_profile(task, batch_size)
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(batch_size, 1)))
  policy = PrecisionPolicy.uniform(preset)
  compiled, _ = timing.compile_train_step(task, policy, batch)
  xla = timing.xla_peak_bytes(compiled)
  predicted = memory_bytes(GroupCost("g", prof, policy.resolve(prof.op_names), batch_size))
  assert predicted == pytest.approx(xla, rel=0.15)


def test_the_16bit_memory_correction_is_fitted_on_the_all_bf16_step_and_mixed_by_16bit_share():
  task = tiny.cnn(8, 8)
  traced = traced_profile(task, 16)  # other_bytes fitted to the fp32 step's peak
  batch, _, ops = task_ops(task, 16)
  bf16_peak = step_memory(task, batch, ops, preset="bf16")[0]
  out = fit_memory(traced, traced.meta["fp32_xla_peak_bytes"], bf16_peak)

  def peak(p, policy):
    return memory_bytes(GroupCost("g", p, policy.resolve(p.op_names), 16))

  fp32, bf16 = PrecisionPolicy.uniform("fp32"), PrecisionPolicy.uniform("bf16")
  # the fp32 plan predicts the compiled fp32 step's peak, all-bf16 the compiled bf16 step's
  assert peak(out, fp32) == traced.meta["fp32_xla_peak_bytes"] == peak(traced, fp32)
  assert peak(out, bf16) == bf16_peak
  # a plan with half its activations 16-bit sits between (the correction mixed by that share)
  names = traced.op_names
  half = PrecisionPolicy.from_ops({names[0]: OpPolicy.preset("bf16"), names[-1]: OpPolicy.preset("fp32")})
  share = sixteen_bit_share(out, half.resolve(names))
  other = out.memory["other_bytes_16bit"] - out.memory["other_bytes"]
  assert 0 < share < 1 and peak(out, half) - peak(traced, half) == pytest.approx(share * other, abs=1)
