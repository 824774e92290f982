"""A compiled step's HLO charged to its ops (name stacks, rounding keys), traced steps, the
device clock."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from planners.ops import OpShape, collect_ops
from planners.profiler import step_hlo, timing
from planners.profiler.hlo import entry_instructions
from planners.profiler.measure import op_leg_ms, task_ops
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train.train_step import init_variables
from tests.planners import tiny
from tests.qsync_jax.train import tiny as trainer_tiny

HLO = """HloModule jit_step

%fused_relayout (param_0: f32[4,8], param_1: f32[4,8]) -> f32[8,4] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[4,8]{1,0} parameter(1)
  %add.1 = f32[4,8]{1,0} add(%param_0, %param_1)
  %transpose.1 = f32[8,4]{0,1} transpose(%add.1), dimensions={1,0}
  ROOT %copy.1 = f32[8,4]{1,0} copy(%transpose.1)
}

%fused_plain (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %negate.1 = f32[4,8]{1,0} negate(%param_0)
}

ENTRY %main (x.1: f32[4,8], t.1: f32[4,8], g.1: f32[4,3]) -> f32[8,3] {
  %x.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}
  %t.1 = f32[4,8]{1,0} parameter(1), metadata={op_name="t"}
  %g.1 = f32[4,3]{1,0} parameter(2), metadata={op_name="g"}
  %relayout = f32[8,4]{1,0} fusion(%x.1, %t.1), kind=kLoop, calls=%fused_relayout, metadata={op_name="jit(step)/jvp(M)/block0/mul"}
  %plain = f32[4,8]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_plain, metadata={op_name="jit(step)/jvp(M)/neg"}
  ROOT %dot.1 = f32[8,3]{1,0} dot(%relayout, %g.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(M))/block0/mlp_out/mlp_out/dot_general"}
}
"""


def _op(name, kind="dense"):
  return OpShape(name, kind, 1, 4, 8, 3)


def test_entry_instructions_read_operands_and_name_stacks():
  instructions = {ins.name: ins for ins in entry_instructions(HLO)}
  assert set(instructions) == {"x.1", "t.1", "g.1", "relayout", "plain", "dot.1"}
  assert instructions["dot.1"].operands == ("relayout", "g.1")
  assert instructions["relayout"].called == ("fused_relayout",)
  assert instructions["dot.1"].op_name.endswith("mlp_out/mlp_out/dot_general")


def test_op_of_follows_flax_name_stacks():
  ops = [
    _op("embed:embed", "embed"),
    _op("pos_embed:embed", "embed"),
    _op("block0/attn/query:dense_general", "dense_general"),
    _op("block0/attn:attention_qk", "attention_qk"),
    _op("block0/attn:attention_pv", "attention_pv"),
  ]
  stack = "jit(step)/transpose(jvp(LM))/"

  def name(s):
    op = step_hlo.op_of(stack + s, ops)
    return op and op.name

  assert name("block0/attn/attn/query/query/dot_general") == "block0/attn/query:dense_general"
  assert name("block0/attn/attn/...qhd,...khd->...hqk/dot_general") == "block0/attn:attention_qk"
  assert name("block0/attn/attn/...hqk,...khd->...qhd/dot_general") == "block0/attn:attention_pv"
  assert name("pos_embed/dot_general") == "pos_embed:embed"
  assert name("embed/dot_general") == "embed:embed"
  assert name("block1/attn/attn/query/query/dot_general") is None


def test_op_of_finds_nnx_paths_that_jax_prints_inside_a_transformation():
  # nnx ops run under jax.named_scope(path) as the first scope under jvp/transpose, which JAX
  # prints around it: jvp(blocks/0/attn/key), not jvp(LM)/blocks/0/attn/key as for linen
  ops = [
    _op("conv1:conv", "conv"),
    _op("blocks/0/attn/key:dense_general", "dense_general"),
    _op("blocks/0/attn:attention_qk", "attention_qk"),
    _op("blocks/0/attn:attention_pv", "attention_pv"),
    _op("blocks/10/up:dense"),
  ]

  def name(s):
    op = step_hlo.op_of(s, ops)
    return op and op.name

  assert name("jit(step)/jvp(conv1)/conv_general_dilated") == "conv1:conv"
  assert name("jit(step)/transpose(jvp(conv1))/conv_general_dilated") == "conv1:conv"
  assert name("jit(step)/jvp(blocks/0/attn/key)/dot_general") == "blocks/0/attn/key:dense_general"
  assert name("jit(step)/transpose(jvp(blocks/0/attn))/...qhd,...khd->...hqk/dot_general") == (
    "blocks/0/attn:attention_qk"
  )
  assert (
    name("jit(step)/jvp(blocks/0/attn)/...hqk,...khd->...qhd/dot_general") == "blocks/0/attn:attention_pv"
  )
  assert name("jit(step)/jvp(blocks/1/up)/dot_general") is None  # "1" is not "10"
  assert name("jit(step)/jvp()/jit(_threefry_split)/slice") is None


@pytest.mark.standard_promotion  # optax's Adam in the traced step
def test_op_leg_ms_charges_an_nnx_models_step_to_its_ops():
  task = trainer_tiny.make_nnx_task(batchnorm=False)
  batch, _, ops = task_ops(task, 8)
  got = op_leg_ms(task, PrecisionPolicy.uniform("bf16"), batch, ops, repeats=2)
  assert set(got) == {"hidden:dense", "out:dense"}
  assert all(legs["fwd"] > 0 for legs in got.values())
  assert got["out:dense"]["bwd"] > 0


def test_a_trace_is_stopped_when_the_traced_program_raises_and_a_busy_profiler_is_named(tmp_path):
  def fails():
    raise ZeroDivisionError

  with pytest.raises(ZeroDivisionError):
    timing.profiler_events(fails, repeats=1)
  f = jax.jit(lambda x: x + 1)
  assert timing.profiler_events(lambda: jax.block_until_ready(f(jnp.ones(4))), repeats=1)  # not busy
  jax.profiler.start_trace(str(tmp_path))
  try:
    with pytest.raises(timing.ProfilerBusyError, match="another jax.profiler trace is running.*Fix"):
      timing.profiler_events(lambda: None, repeats=1)
  finally:
    jax.profiler.stop_trace()


def test_instructions_are_charged_to_the_op_and_leg_their_name_stack_names():
  ops = [OpShape("block0/mlp_out:dense", "dense", 1, 4, 8, 3)]
  got = step_hlo.per_op_ms(HLO, {"relayout": 2.0, "plain": 1.0, "dot.1": 3.0, "unnamed": 0.5}, ops)
  # dot.1 is the op's gradient product (under transpose(...)); the relayout names another
  # module's mul and goes to the rest, as do the negation and an instruction the text lacks
  assert got == {"block0/mlp_out:dense": {"fwd": 0.0, "bwd": 3.0}, "rest": {"fwd": 3.5, "bwd": 0.0}}


KEYS_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main (p: f32[4], k: u32[2]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %k = u32[2]{0} parameter(1)
  %fold = u32[2]{0} fusion(%k), kind=kLoop, calls=%f1, metadata={op_name="jit(step)/jvp(M)/Dense_0/jit(_threefry_fold_in)/threefry2x32"}
  %split = (u32[2]{0}, u32[2]{0}) fusion(%fold), kind=kLoop, calls=%f2, metadata={op_name="jit(step)/jvp(M)/Dense_0/Dense_0/jit(_threefry_split)/threefry2x32"}
  %k0 = u32[2]{0} get-tuple-element(%split), index=0
  %k1 = u32[2]{0} get-tuple-element(%split), index=1
  %fwdkey = u32[2]{0} fusion(%k), kind=kLoop, calls=%f3, metadata={op_name="jit(step)/jvp(M)/Dense_0/jit(_threefry_split)/threefry2x32"}
  %y = f32[4]{0} fusion(%p, %fwdkey), kind=kLoop, calls=%f4, metadata={op_name="jit(step)/jvp(M)/Dense_0/Dense_0/dot_general"}
  %dx = f32[4]{0} fusion(%y, %k0, %k1), kind=kLoop, calls=%f5, metadata={op_name="jit(step)/transpose(jvp(M))/Dense_0/Dense_0/dot_general"}
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%dx, %y)
}
"""


def test_keys_that_only_the_gradient_legs_read_are_charged_to_the_backward():
  ops = [OpShape("Dense_0:dense", "dense", 1, 4, 8, 3)]
  instructions = entry_instructions(KEYS_HLO)
  # the fold-in and split feed only the gradient product (through get-tuple-element); the
  # forward's own key feeds its product and stays with the forward
  assert step_hlo.rounding_keys_for_backward(instructions) == {"fold", "split"}
  ms = {"fold": 1.0, "split": 2.0, "fwdkey": 4.0, "y": 8.0, "dx": 16.0}
  assert step_hlo.per_op_ms(KEYS_HLO, ms, ops) == {"Dense_0:dense": {"fwd": 12.0, "bwd": 19.0}}


@pytest.mark.standard_promotion  # optax's Adam in the traced step
def test_op_leg_ms_charges_the_int8_steps_instructions_to_every_op_and_leg():
  task = tiny.mlp()
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(16, 0)))
  ops = collect_ops(task.model, init_variables(task, 0, batch)[0], *task.inputs(batch))
  got = op_leg_ms(task, PrecisionPolicy.uniform("int8"), batch, ops, repeats=3)
  assert set(got) == {op.name for op in ops}
  assert all(legs["fwd"] > 0 and legs["bwd"] > 0 for legs in got.values())
  hlo, instruction_ms = timing.instruction_times(task, PrecisionPolicy.uniform("int8"), batch, 3)
  total = sum(instruction_ms.values())
  assert total > 0
  charged = step_hlo.per_op_ms(hlo, instruction_ms, ops)
  assert sum(sum(legs.values()) for legs in charged.values()) == pytest.approx(total)  # nothing lost


def test_instruction_times_are_the_steps_instructions_on_this_backend():
  task = tiny.attn()
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(8, 0)))
  hlo, ms = timing.instruction_times(task, PrecisionPolicy.uniform("fp32"), batch, repeats=3)
  assert ms and set(ms) <= {ins.name for ins in entry_instructions(hlo)}
  assert all(v > 0 for v in ms.values())


def test_device_clock_is_the_mean_kernel_time_of_the_first_gpu(monkeypatch):
  events = [
    {"process": "/device:GPU:0 (stream 7)", "name": "nvjet_sm90_tss_128x128", "dur": 30.0},
    {"process": "/device:GPU:0 (stream 7)", "name": "loop_add_fusion_3", "dur": 10.0},
    {"process": "/device:GPU:1 (stream 7)", "name": "nvjet_sm90_tss_128x128", "dur": 500.0},  # another GPU
    {"process": "/host:CPU", "name": "PjitFunction", "dur": 900.0},  # host work
  ]
  monkeypatch.setattr(timing, "profiler_events", lambda run, repeats: events)
  assert timing.device_kernel_ms(lambda: None, repeats=2) == pytest.approx(0.02)  # 40 µs / 2 calls


def test_device_clock_without_a_gpu_names_the_fix():
  f = jax.jit(lambda x: x * 2)
  x = jnp.ones((8,))
  if jax.default_backend() == "gpu":
    ms, samples = timing.timed_ms(lambda: f(x), repeats=3, clock=timing.DEVICE_CLOCK)
    assert 0 < ms < 1.0 and samples == [ms]
  else:
    with pytest.raises(RuntimeError, match="device clock needs a GPU.*Fix"):
      timing.timed_ms(lambda: f(x), repeats=3, clock=timing.DEVICE_CLOCK)
