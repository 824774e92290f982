"""Relayouts of saved activations: parsing, attribution to ops, tracing a step, replay cost."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners import steptrace
from planners.graph import GroupCost, op_costs
from planners.ops import OpShape, collect_ops
from planners.profiler import Profile
from planners.step import DEVICE_CLOCK, init_variables, timed_ms
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from tests.planners import tiny
from tests.planners.fakes import fake_profile

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


def test_entry_instructions_and_relayout_fusions():
  instructions = {ins.name: ins for ins in steptrace.entry_instructions(HLO)}
  assert set(instructions) == {"x.1", "t.1", "g.1", "relayout", "plain", "dot.1"}
  assert instructions["relayout"].operand_params == (0, 1)
  assert instructions["dot.1"].operands == ("relayout", "g.1")
  assert instructions["dot.1"].op_name.endswith("mlp_out/mlp_out/dot_general")
  assert [f.name for f in steptrace.relayout_fusions(HLO)] == ["relayout"]


def test_relayout_is_attributed_to_the_op_whose_gradient_product_reads_it():
  ms = float(np.random.default_rng().uniform(0.5, 5.0))
  ops = [_op("block0/mlp_in:dense"), _op("block0/mlp_out:dense"), _op("mlp_out:dense")]
  got = steptrace.relayout_ms(HLO, {"relayout": ms, "plain": 9.0}, ops)
  assert got == {"block0/mlp_out:dense": pytest.approx(ms)}
  # a forward reader does not count
  forward = HLO.replace("transpose(jvp(M))/block0/mlp_out", "jvp(M)/block0/mlp_out")
  assert steptrace.relayout_ms(forward, {"relayout": ms}, ops) == {}


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
    op = steptrace.op_of(stack + s, ops)
    return op and op.name

  assert name("block0/attn/attn/query/query/dot_general") == "block0/attn/query:dense_general"
  assert name("block0/attn/attn/...qhd,...khd->...hqk/dot_general") == "block0/attn:attention_qk"
  assert name("block0/attn/attn/...hqk,...khd->...qhd/dot_general") == "block0/attn:attention_pv"
  assert name("pos_embed/dot_general") == "pos_embed:embed"
  assert name("embed/dot_general") == "embed:embed"
  assert name("block1/attn/attn/query/query/dot_general") is None


def test_instructions_are_charged_to_the_op_and_leg_their_name_stack_names():
  ops = [OpShape("block0/mlp_out:dense", "dense", 1, 4, 8, 3)]
  got = steptrace.per_op_ms(HLO, {"relayout": 2.0, "plain": 1.0, "dot.1": 3.0, "unnamed": 0.5}, ops)
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
  instructions = steptrace.entry_instructions(KEYS_HLO)
  # the fold-in and split feed only the gradient product (through get-tuple-element); the
  # forward's own key feeds its product and stays with the forward
  assert steptrace.rounding_keys_for_backward(instructions) == {"fold", "split"}
  ms = {"fold": 1.0, "split": 2.0, "fwdkey": 4.0, "y": 8.0, "dx": 16.0}
  assert steptrace.per_op_ms(KEYS_HLO, ms, ops) == {"Dense_0:dense": {"fwd": 12.0, "bwd": 19.0}}


@pytest.mark.standard_promotion  # optax's Adam in the traced step
def test_op_leg_ms_charges_the_int8_steps_instructions_to_every_op_and_leg():
  task = tiny.mlp()
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(16, 0)))
  ops = collect_ops(task.model, init_variables(task, batch), *task.inputs(batch))
  got = steptrace.op_leg_ms(task, PrecisionPolicy.uniform("int8"), batch, ops, repeats=3)
  assert set(got) == {op.name for op in ops}
  assert all(legs["fwd"] > 0 and legs["bwd"] > 0 for legs in got.values())
  hlo, instruction_ms, total = steptrace.traced_step(task, PrecisionPolicy.uniform("int8"), batch, 3)
  assert total == pytest.approx(sum(instruction_ms.values())) and total > 0
  charged = steptrace.per_op_ms(hlo, instruction_ms, ops)
  assert sum(sum(legs.values()) for legs in charged.values()) == pytest.approx(total)  # nothing lost


def test_step_instruction_ms_times_the_steps_instructions():
  task = tiny.attn()
  batch = jax.tree_util.tree_map(jnp.asarray, next(task.train_batches(8, 0)))
  hlo, ms = steptrace.step_instruction_ms(task, PrecisionPolicy.uniform("fp32"), batch, repeats=3)
  names = {ins.name for ins in steptrace.entry_instructions(hlo)}
  assert ms and set(ms) <= names
  assert all(v > 0 for v in ms.values())
  variables = init_variables(task, batch)
  ops = collect_ops(task.model, variables, *task.inputs(batch))
  relayout = steptrace.relayout_ms(hlo, ms, ops)
  assert set(relayout) <= {op.name for op in ops}


def test_replay_adds_the_relayout_where_the_policy_reruns_the_producer():
  relayout = float(np.random.default_rng().uniform(1.0, 10.0))
  base = fake_profile([(1.0, 1.0, 1.0)] * 2)
  name = base.ops[1].name
  op_ms = {n: dict(t) for n, t in base.op_ms.items()}
  op_ms[name]["policy:bf16"] = {"fwd": 1.0, "bwd": 2.0, "refuses_producer": 0.0}
  op_ms[name]["policy:fp16"] = {"fwd": 1.0, "bwd": 2.0, "refuses_producer": 1.0}
  prof: Profile = dataclasses.replace(base, op_ms=op_ms, relayout_ms={name: relayout})

  def drhs(preset):
    pol = None if preset is None else OpPolicy.preset(preset)
    return op_costs(GroupCost("g", prof, {name: pol}, prof.batch_per_device), 1)["drhs"][0]

  bare = dataclasses.replace(prof, relayout_ms={})
  assert drhs(None) == pytest.approx(
    op_costs(GroupCost("g", bare, {}, prof.batch_per_device), 1)["drhs"][0] + relayout
  )
  assert drhs("fp16") == pytest.approx(1.0 + relayout)  # bwd 2.0 split evenly over dlhs, drhs
  assert drhs("bf16") == pytest.approx(1.0)
  # where the policy's own programs timed their re-run relayout, that time replaces fp32's
  op_ms[name]["policy:fp16"] = {"fwd": 1.0, "bwd": 2.0, "refuses_producer": 1.0, "relayout_ms": 7.5}
  prof = dataclasses.replace(prof, op_ms=op_ms)
  assert drhs("fp16") == pytest.approx(1.0 + 7.5)
  assert drhs(None) == pytest.approx(
    op_costs(GroupCost("g", bare, {}, prof.batch_per_device), 1)["drhs"][0] + relayout
  )  # fp32 keeps the relayout measured in the fp32 step


def test_refuses_producer_on_this_stack():
  # the behaviour the relayout charge rests on (XLA:CPU): an op whose custom_vjp saves its
  # fp32 produced input itself makes the relayout for its drhs re-run the producer; a bf16
  # op's saved copy is materialized and relaid out instead. An all-fp32 op runs as a plain
  # dot_general differentiated by JAX, and XLA then saves a relaid-out copy too.
  from planners.op_programs import producer_relayout_ms
  from qsync_jax.qdot import quantized_dot_general

  rng = np.random.default_rng()
  batch, tokens = (int(x) for x in rng.integers(2, 5, size=2))
  lhs = jnp.asarray(rng.normal(size=(batch, 8 * tokens, 64)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(batch, 8 * tokens, 16)), jnp.float32)
  dims = (((2,), (0,)), ((), ()))

  def under(policy):
    policy = OpPolicy.preset(policy) if isinstance(policy, str) else policy
    return lambda a, b, key: quantized_dot_general(a, b, dims, policy, key)

  # with the judgement, the time of the re-running relayouts from XLA:CPU's trace
  refuses, ms = producer_relayout_ms(under(OpPolicy(fwd="fp32", dlhs="fp32", drhs="bf16")), lhs, rhs, None, g)
  assert refuses and ms > 0
  assert producer_relayout_ms(under("fp32"), lhs, rhs, None, g) == (False, None)
  assert producer_relayout_ms(under("bf16"), lhs, rhs, None, g) == (False, None)


def test_device_clock_is_the_mean_kernel_time_of_the_first_gpu(monkeypatch):
  events = [
    {"process": "/device:GPU:0 (stream 7)", "name": "nvjet_sm90_tss_128x128", "dur": 30.0},
    {"process": "/device:GPU:0 (stream 7)", "name": "loop_add_fusion_3", "dur": 10.0},
    {"process": "/device:GPU:1 (stream 7)", "name": "nvjet_sm90_tss_128x128", "dur": 500.0},  # another GPU
    {"process": "/host:CPU", "name": "PjitFunction", "dur": 900.0},  # host work
  ]
  monkeypatch.setattr(steptrace, "traced_events", lambda run, repeats: events)
  assert steptrace.device_kernel_ms(lambda: None, repeats=2) == pytest.approx(0.02)  # 40 µs / 2 calls


def test_kernel_summary_splits_matrix_products_from_the_rest():
  gpu = "/device:GPU:0 (stream 7)"
  events = [
    {"process": gpu, "name": "sm80_xmma_gemm_f32f32_tn", "dur": 300.0},
    {"process": gpu, "name": "gemm_fusion_dot_7", "dur": 100.0},
    {"process": gpu, "name": "anonymous_mosaic_gpu_kernel", "dur": 50.0},
    {"process": gpu, "name": "quantize_rows_int8__4", "dur": 40.0},  # a Pallas kernel, not a product
    {"process": gpu, "name": "input_add_reduce_fusion_2", "dur": 10.0},
    {"process": "/device:GPU:0 (stream 21)", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "dur": 80.0},
    {"process": "/device:GPU:1 (stream 7)", "name": "gemm_fusion_dot_7", "dur": 1e6},
  ]
  s = steptrace.summarize_kernels(events, repeats=2)
  assert (s.ms, s.kernels) == (pytest.approx(0.29), 3.0)  # the collective's stream counts too
  assert (s.gemm_ms, s.gemm_kernels) == (pytest.approx(0.225), 1.5)
  assert s.comm_ms == pytest.approx(0.04)
  assert s.top[0] == ("sm80_xmma_gemm_f32f32_tn", pytest.approx(0.15))
  assert (
    steptrace.summarize_kernels([e for e in events if "GPU:0" not in e["process"]], 2, "/device:GPU:0")
    is None
  )
  by_kind = steptrace.kernels_by(events, 2, key=lambda name: "gemm" if "gemm" in name else "other")
  assert by_kind["gemm"] == (pytest.approx(0.2), 1.0)  # GPU 1's kernel is not counted
  assert by_kind["other"] == (pytest.approx(0.09), 2.0) and sum(
    ms for ms, _ in by_kind.values()
  ) == pytest.approx(0.29)


def test_device_clock_without_a_gpu_names_the_fix():
  f = jax.jit(lambda x: x * 2)
  x = jnp.ones((8,))
  if jax.default_backend() == "gpu":
    ms, samples = timed_ms(lambda: f(x), repeats=3, clock=DEVICE_CLOCK)
    assert 0 < ms < 1.0 and samples == [ms]
  else:
    with pytest.raises(RuntimeError, match="device clock needs a GPU.*Fix"):
      timed_ms(lambda: f(x), repeats=3, clock=DEVICE_CLOCK)


def test_policy_relayouts_are_replaced_by_those_traced_in_the_policys_own_step(monkeypatch):
  ops = [_op("block0/mlp_out:dense"), _op("block1/mlp_out:dense"), _op("head:dense")]
  shared = {"fwd": 1.0, "bwd": 2.0, "refuses_producer": 1.0, "relayout_ms": 0.9}  # one shape, one dict
  op_ms = {
    "block0/mlp_out:dense": {"policy:fp16": shared, "policy:fp32": {"fwd": 1.0, "refuses_producer": 1.0}},
    "block1/mlp_out:dense": {"policy:fp16": shared},
    "head:dense": {"policy:fp16": {"fwd": 1.0, "refuses_producer": 0.0, "relayout_ms": 0.1}},
  }
  measured = {"block0/mlp_out:dense": 7.0, "block1/mlp_out:dense": 3.5, "head:dense": 0.2}
  traced_steps = []

  def fake_trace(task, policy, batch, repeats, seed=0):
    traced_steps.append(policy)
    return "hlo", {"relayout": 1.0}

  monkeypatch.setattr(steptrace, "step_instruction_ms", fake_trace)
  monkeypatch.setattr(steptrace, "relayout_ms", lambda hlo, ms, ops: measured)
  out, traced = steptrace.with_policy_step_relayouts(None, None, ops, op_ms)
  assert traced == ["fp16"] and traced_steps == [PrecisionPolicy.uniform("fp16")]  # fp32 is the fp32 step's
  assert out["block0/mlp_out:dense"]["policy:fp16"]["relayout_ms"] == 7.0
  assert out["block1/mlp_out:dense"]["policy:fp16"]["relayout_ms"] == 3.5  # not the other's, though shared
  assert out["head:dense"]["policy:fp16"]["relayout_ms"] == 0.1  # it does not re-run its producer
  assert shared["relayout_ms"] == 0.9 and op_ms["block1/mlp_out:dense"]["policy:fp16"] is shared  # input kept
  # no per-instruction trace (a GPU): nothing changes
  monkeypatch.setattr(steptrace, "step_instruction_ms", lambda *a, **k: ("hlo", {}))
  assert steptrace.with_policy_step_relayouts(None, None, ops, op_ms) == (op_ms, [])
