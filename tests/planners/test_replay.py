"""Replay predictor on hand-built graphs with a known longest path and overlap."""

import dataclasses
import json

import numpy as np
import pytest

from planners.catalog import allreduce_ms
from planners.graph import Comm, GroupCost, buckets, build_graph, longest_path, quantized_in_step_factors
from planners.profiler import Profile
from planners.replay import (
  calibrate,
  fit_presets,
  predict,
  refit_16bit_remainder,
  refit_profile,
  refit_quantized_leg_scale,
  refit_remainder,
  sync_step_ms,
)
from planners.trace import chrome_trace, save_png
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from tests.planners.fakes import fake_profile

# 156250 fp32 weights = 625000 bytes; 2 devices over 1 Gbit/s: 2·(1/2)·625000·8/1e9 s = 5 ms.
ELEMS = 156250


def _fp32(prof):
  return {n: OpPolicy.uniform("fp32") for n in prof.op_names}


def test_allreduce_formula():
  assert allreduce_ms(625000, 2, 1.0, latency_us=0.0) == pytest.approx(5.0)
  assert allreduce_ms(1e9, 1, 1.0) == 0.0
  # 2(n-1)/n grows towards 2 with n
  assert allreduce_ms(1e6, 8, 8.0, 0.0) == pytest.approx(1e3 * 2 * 7 / 8 * 1e6 / 1e9)


def test_known_longest_path_and_overlap():
  # ops A (first: no dlhs) and B, each fwd 1, dlhs 2, drhs 3 ms; one bucket per op.
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=1.0)
  group = GroupCost("g", prof, _fp32(prof), prof.batch_per_device)
  comm = Comm(n_devices=2, link_gbps=1.0, bucket_bytes=1, latency_us=0.0)
  nodes = build_graph([group], comm)
  times = dict(zip((n.name for n in nodes), longest_path(nodes)))
  # forward A [0,1], B [1,2]; backward B dlhs [2,4], B drhs [4,7]; A drhs [7,10]
  assert times["Dense_1:dense drhs"] == (4.0, 7.0)
  assert times["Dense_0:dense drhs"] == (7.0, 10.0)
  assert "Dense_0:dense dlhs" not in times
  comm_times = [t for name, t in times.items() if name.startswith("all-reduce")]
  # bucket 0 (B's gradient) overlaps A's drhs: [7, 12]; bucket 1 waits for the end: [12, 17]
  assert comm_times == [(7.0, 12.0), (12.0, 17.0)]
  # the optimizer, split by bucket bytes (equal here), updates each bucket after its all-reduce
  assert times["optimizer (bucket 0)"] == (12.0, 12.5)
  assert times["optimizer (bucket 1)"] == (17.0, 17.5)
  assert sync_step_ms([group], comm) == 17.5  # without overlap it would be 10 + 5 + 5 + 1 = 21


def test_sync_step_is_slowest_group_plus_shared_tail():
  fast = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS)
  slow = fake_profile([(2, 4, 6), (2, 4, 6)], rhs_elems=ELEMS)
  comm = Comm(2, 1.0, bucket_bytes=1, latency_us=0.0)
  g1, g2 = GroupCost("fast", fast, _fp32(fast), 8), GroupCost("slow", slow, _fp32(slow), 8)
  # slow alone: backward ends at 20 (B drhs ends 14), buckets [14,19], [20,25]
  assert sync_step_ms([g2], comm) == 25.0
  assert sync_step_ms([g1, g2], comm) == 25.0
  # batch scaling: the fast group at double batch takes as long as the slow one
  assert sync_step_ms([GroupCost("fast", fast, _fp32(fast), 16)], comm) == 25.0


def test_buckets_cover_all_parameters():
  prof = fake_profile([(1, 1, 1)] * 5, rhs_elems=1000, extra_param_bytes=123)  # 4000 B per op
  # parameter-tree order (Dense_0 … Dense_4), as XLA packs them: {0,1} {2,3} {4}; the bucket
  # holding Dense_0 completes last and also carries the 123 B outside the ops
  tree = buckets(prof, bucket_bytes=8000)
  assert tree == [(4, 4000), (2, 8000), (0, 8123)]
  # backward order: {4,3} {2,1} {0}
  assert buckets(prof, bucket_bytes=8000, order="backward") == [(3, 8000), (1, 8000), (0, 4123)]
  for plan in (tree, buckets(prof, 8000, "backward"), buckets(prof, 1)):
    assert sum(b for _, b in plan) == prof.memory["param_bytes"]
  with pytest.raises(ValueError, match="bucket order"):
    buckets(prof, 8000, order="forward")


@pytest.mark.parametrize(
  "preset, casts",
  [
    ("fp32", {}),
    ("bf16", {}),  # conversions into bf16 are inside the legs' profiled times
    # the backward dequantizes the saved int8 input (1000) and weight (1000)
    ("int8_fwd", {"Dense_1:dense cast_bwd": 2.0, "Dense_0:dense cast_bwd": 2.0}),
  ],
)
def test_cast_nodes_where_precisions_change(preset, casts):
  prof = fake_profile([(1, 1, 1), (1, 1, 1)], cast_a=1e-3)  # every cast: 1e-3 ms per element
  policies = {n: OpPolicy.preset(preset) for n in prof.op_names}
  nodes = build_graph([GroupCost("g", prof, policies, 8)], Comm(1, 1.0))
  got = {n.name: n.ms for n in nodes if n.kind == "cast"}
  assert got == pytest.approx(casts)


def _cluster(memory_gb=1.0, n=2, device_type="cpu"):
  return ClusterSpec(
    (
      DeviceGroup("a", device_type, n, memory_gb, 8, 1.0),
      DeviceGroup("b", device_type, n, memory_gb, 8, 1.0),
    )
  )


def _memory(device_type, lhs, preset):
  prof = fake_profile([(1, 1, 1)] * 3, lhs_elems=lhs, device_type=device_type)
  cluster = _cluster(device_type=device_type)
  return predict(cluster, {device_type: prof}, Plan.uniform(cluster, preset)).memory_bytes["a"], prof


def test_predict_memory_counts_residuals_at_stored_precision():
  # a device whose 16-bit products run natively: residuals are kept as the ops store them
  lhs = int(np.random.default_rng().integers(1000, 5000))
  fp32, prof = _memory("A100", lhs, "fp32")
  params = prof.memory["param_bytes"]
  # fp32 forward saves the fp32 activation (the weight is the parameter itself)
  assert fp32 == 4 * params + 3 * 4 * lhs
  # int8 forward saves 1-byte activations and weights plus per-channel fp32 scales, and one
  # op's residuals are dequantized at a time in the backward, to the fp16 its gradient legs
  # run in
  scales = 3 * 4 * (8 + 100)
  backward = 4 * params + 3 * (lhs + 1000) + scales + 2 * (lhs + 1000)
  # or in the last op's forward: the fp32 step's peak, less what the earlier ops keep below
  # fp32, plus its 1-byte GEMM operands
  below = 4 * lhs - (lhs + 1000 + scales // 3)
  forward = 4 * params + 3 * 4 * lhs - 2 * below + (lhs + 1000)
  assert _memory("A100", lhs, "int8_fwd")[0] == max(backward, forward)
  assert _memory("A100", lhs, "bf16")[0] == 4 * params + 3 * 2 * lhs


def _with_scratch(prof, sizes):
  """``prof`` with whole-policy entries recording ``sizes[preset][op index]`` scratch bytes."""
  op_ms = {
    name: {
      **table,
      **{f"policy:{p}": {"fwd": 1.0, "bwd": 1.0, "scratch_bytes": float(s[i])} for p, s in sizes.items()},
    }
    for i, (name, table) in enumerate(prof.op_ms.items())
  }
  return dataclasses.replace(prof, op_ms=op_ms)


def test_predict_memory_adds_the_largest_scratch_buffer_of_the_plan():
  rng = np.random.default_rng()
  fp32_sizes, bf16_sizes = (rng.integers(0, 10**6, 3) for _ in range(2))
  base = fake_profile([(1, 1, 1)] * 3, device_type="A100")
  prof = _with_scratch(base, {"fp32": fp32_sizes, "bf16": bf16_sizes})
  cluster = _cluster(device_type="A100")

  def extra(policy):
    plan = Plan(policies={"a": policy, "b": policy})
    with_, without = (predict(cluster, {"A100": p}, plan).memory_bytes["a"] for p in (prof, base))
    return with_ - without

  # XLA gives the step one scratch slab, of its largest buffer
  assert extra(PrecisionPolicy.uniform("fp32")) == max(fp32_sizes)
  assert extra(PrecisionPolicy.uniform("bf16")) == max(bf16_sizes)
  names = prof.op_names
  mixed = PrecisionPolicy.from_ops({names[0]: OpPolicy.preset("fp32"), names[1]: OpPolicy.preset("bf16")})
  # the unmodified op runs at tf32 (XLA's default on an A100), which has no program here: the
  # largest it recorded under any policy
  assert extra(mixed) == max(fp32_sizes[0], bf16_sizes[1], fp32_sizes[2], bf16_sizes[2])
  # a policy the op has no program for: the largest it recorded under any
  assert extra(PrecisionPolicy.uniform("int8_fwd")) == max(max(fp32_sizes), max(bf16_sizes))


def test_a_quantized_forward_replaces_the_fp32_ops_own_bytes_where_the_profile_measured_them():
  # the fp32 step's peak carries its largest library scratch S (a backward's, not live in any
  # forward); at each forward the fp32 step holds, of its live bytes, the op's own O_i. An
  # int8 forward replaces O_i by its own GEMM operands, on top of the fp32 step at that moment.
  rng = np.random.default_rng()
  lhs = int(rng.integers(1000, 5000))
  scratch = int(rng.integers(10**5, 10**6))
  base = fake_profile([(1, 1, 1)] * 3, lhs_elems=lhs, device_type="A100")
  names = base.op_names
  base = _with_scratch(base, {"fp32": [scratch, 0, 0], "int8_fwd": [0, 0, 0]})
  headroom = {n: int(h) for n, h in zip(names, rng.integers(0, lhs, 3))}
  own = {n: int(o) for n, o in zip(names, rng.integers(0, lhs, 3))}
  prof = dataclasses.replace(base, forward_headroom=headroom, forward_own_bytes=own)
  cluster = _cluster(device_type="A100")
  got = predict(cluster, {"A100": prof}, Plan.uniform(cluster, "int8_fwd")).memory_bytes["a"]
  params = prof.memory["param_bytes"]
  scales = 4 * (8 + 100)  # per op
  fp32_step = 4 * params + 3 * 4 * lhs + scratch
  delta = lhs + 1000 + scales - 4 * lhs  # what an int8 op keeps beyond the fp32 op
  forward = max(fp32_step - headroom[n] - own[n] + i * delta + (lhs + 1000) for i, n in enumerate(names))
  backward = 4 * params + 3 * (lhs + 1000 + scales) + 2 * (lhs + 1000)
  assert got == max(backward, forward)
  # without the measured own bytes: the former term, on the plan's own (scratch-free) peak
  former = predict(
    cluster, {"A100": dataclasses.replace(prof, forward_own_bytes={})}, Plan.uniform(cluster, "int8_fwd")
  )
  fp32_peak = 4 * params + 3 * 4 * lhs
  old_forward = max(fp32_peak - headroom[n] + i * delta + (lhs + 1000) for i, n in enumerate(names))
  assert former.memory_bytes["a"] == max(backward, old_forward)


def test_predict_memory_on_cpu_keeps_fp32_copies_of_upcast_residuals():
  # XLA:CPU runs 16-bit legs as fp32 products: a bf16 residual is kept as fp32, and an int8
  # activation residual read by an fp16 drhs leg is kept dequantized (4 bytes, not 1)
  lhs = int(np.random.default_rng().integers(1000, 5000))
  fp32, prof = _memory("cpu", lhs, "fp32")
  params = prof.memory["param_bytes"]
  assert _memory("cpu", lhs, "bf16")[0] == fp32 == 4 * params + 3 * 4 * lhs
  scales = 4 * (8 + 100)  # per op
  # where the backward starts: the three residuals, and one op's weight dequantized
  backward = 4 * params + 3 * (4 * lhs + 1000 + scales) + 4 * 1000
  # during the last op's forward: the fp32 step less nothing (no later residuals), the first
  # two ops' excess over fp32, and the last op's 1-byte GEMM operands and dequantized input
  forward = 4 * params + 3 * 4 * lhs + 2 * (1000 + scales) + (lhs + 1000) + 4 * lhs
  assert _memory("cpu", lhs, "int8_fwd")[0] == max(backward, forward)


def test_predict_memory_keeps_no_stochastic_rounding_bits():
  # int8 with stochastic gradient rounding: the noise is a hash of each element's index,
  # computed where the rounding reads it (``pallas_kernels.quantize.noise``), so nothing is
  # kept for it on any backend: the same bytes as with nearest rounding. (Threefry's words,
  # 8 bytes per element of dY per stochastic leg, were kept on XLA:CPU: the LM's int8 step
  # was then predicted at 2.54x XLA's peak.)
  lhs = int(np.random.default_rng().integers(1000, 5000))
  sr = OpPolicy.preset("int8")  # the all-int8 preset: stochastic gradient rounding
  assert sr.grad_rounding == "stochastic"
  nearest = dataclasses.replace(sr, grad_rounding="nearest")
  for device_type in ("cpu", "A100"):
    prof = fake_profile([(1, 1, 1)] * 3, lhs_elems=lhs, device_type=device_type)
    cluster = _cluster(device_type=device_type)
    got = {
      p.grad_rounding: predict(cluster, {device_type: prof}, Plan(policies={"a": PrecisionPolicy(default=p)}))
      for p in (sr, nearest)
    }
    assert got["stochastic"].memory_bytes["a"] == got["nearest"].memory_bytes["a"]
  params = prof.memory["param_bytes"]
  scales = 3 * 4 * (8 + 100)
  residuals = 3 * (lhs + 1000) + scales  # int8 gradient legs read the 1-byte residuals
  # int8 gradient legs read the 1-byte residuals: nothing is dequantized in the backward
  backward = 4 * params + residuals
  below = 4 * lhs - (lhs + 1000 + scales // 3)  # the last op's forward, as for int8_fwd above
  forward = 4 * params + 3 * 4 * lhs - 2 * below + (lhs + 1000)
  assert got["stochastic"].memory_bytes["a"] == max(backward, forward)  # A100


def test_trace_exports(tmp_path):
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=1.0)
  cluster = _cluster()
  pred = predict(cluster, {"cpu": prof}, Plan.uniform(cluster, "fp32"))
  trace = json.loads(json.dumps(chrome_trace(pred)))
  events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert len(events) == len(pred.nodes)
  assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(1e3 * pred.step_ms)
  save_png(pred, str(tmp_path / "t.png"))
  assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_refit_remainder_reproduces_a_step_shorter_than_the_forward():
  # standalone timings inflated (a busy host): the fp32 step measured 4 ms, less than the
  # forward alone (2 ms) plus the backward (8 ms); the remainder of -6 ms moves the backward earlier
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], optimizer_ms=0.0)
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)
  fitted = refit_remainder(one, prof, 4.0)
  fp32 = Plan(policies={"all": PrecisionPolicy.uniform("fp32")})
  assert sum(fitted.remainder_ms.values()) == pytest.approx(-6.0)
  assert predict(one, {"cpu": fitted}, fp32).step_ms == pytest.approx(4.0)


def test_refit_remainder_matches_the_fp32_step_and_shifts_every_plan_alike():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, remainder_ms=4.0, optimizer_ms=1.0)
  group = DeviceGroup("gpus", "cpu", 2, 1e3, prof.batch_per_device, link_gbps=1.0)
  cluster = ClusterSpec((group,))
  uniform = {p: Plan(policies={"gpus": PrecisionPolicy.uniform(p)}) for p in ("fp32", "bf16")}
  before = {p: predict(cluster, {"cpu": prof}, plan, latency_us=0.0).step_ms for p, plan in uniform.items()}
  fitted = refit_remainder(cluster, prof, 30.0, latency_us=0.0)
  after = {p: predict(cluster, {"cpu": fitted}, plan, latency_us=0.0).step_ms for p, plan in uniform.items()}
  assert after["fp32"] == pytest.approx(30.0)
  # the remainder sits on the compute chain before the backward, so the whole step moves by
  # the refit's change (bf16's buckets overlap less or more only if the backward shrinks)
  assert after["bf16"] - before["bf16"] == pytest.approx(30.0 - before["fp32"])
  assert fitted.remainder_ms["bwd"] == pytest.approx(2 * fitted.remainder_ms["fwd"])
  assert fitted.op_ms == prof.op_ms  # nothing else changes


def test_quantized_leg_scale_is_fitted_on_the_all_int8_step_and_scales_only_int8_legs():
  # ops A (first: no dlhs) and B at fp32: fwd 1, dlhs 2, drhs 3 ms; int8 legs 0.3x, bf16 0.5x.
  # All-int8 step = remainder 4 + optimizer 1 + s * (0.3 + 0.3 + 0.6 + 0.9 + 0.9) = 5 + 3 s.
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)
  assert prof.quantized_leg_scale == 1.0 and fit_presets(prof) == ("fp32",)

  def step(p, policy):
    return predict(one, {"cpu": p}, Plan(policies={"all": policy})).step_ms

  a, b = prof.op_names
  assert step(prof, PrecisionPolicy.uniform("int8")) == pytest.approx(8.0)
  fitted = refit_quantized_leg_scale(one, prof, 6.5)
  assert fitted.quantized_leg_scale == pytest.approx(0.5)
  assert step(fitted, PrecisionPolicy.uniform("int8")) == pytest.approx(6.5)
  assert fit_presets(fitted) == ("fp32", "int8") and fitted.meta["quantized_fit_step_ms"] == 6.5
  for float_plan in ("fp32", "bf16", "fp16"):  # no int8 leg: unchanged
    assert step(fitted, PrecisionPolicy.uniform(float_plan)) == step(
      prof, PrecisionPolicy.uniform(float_plan)
    )
  # A at int8, B at bf16: 0.5·0.3 + 0.5 + 4 + (1.0 + 1.5) + 0.5·0.9 + 1
  mixed = PrecisionPolicy.from_ops({a: OpPolicy.preset("int8"), b: OpPolicy.preset("bf16")})
  assert step(fitted, mixed) == pytest.approx(8.6)
  # int8_fwd: only the forwards are int8; the fp16 gradient legs keep their time
  fwd_only = step(prof, PrecisionPolicy.uniform("int8_fwd")) - step(
    fitted, PrecisionPolicy.uniform("int8_fwd")
  )
  assert fwd_only == pytest.approx(0.5 * 0.6)


def test_an_op_traced_in_the_int8_step_takes_its_own_forward_and_backward_factors():
  # as above: A (no dlhs) and B, int8 legs 0.3x fp32's (fwd 1, dlhs 2, drhs 3 ms), so A's
  # standalone int8 costs are fwd 0.3 / bwd 0.9 and B's fwd 0.3 / bwd 1.5. The trace of the
  # all-int8 step charged A 0.6 / 0.45 ms (factors 2 and 0.5); B has no backward time charged
  # (its kernels named after a neighbour), so B keeps the scale on every quantized leg.
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  a, b = prof.op_names
  traced = dataclasses.replace(
    prof, quantized_in_step_ms={a: {"fwd": 0.6, "bwd": 0.45}, b: {"fwd": 0.3, "bwd": 0.0}}
  )
  assert quantized_in_step_factors(traced, 0) == pytest.approx((2.0, 0.5))
  assert quantized_in_step_factors(traced, 1) is None and quantized_in_step_factors(prof, 0) is None
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)

  def step(p, policy):
    return predict(one, {"cpu": p}, Plan(policies={"all": policy})).step_ms

  int8 = PrecisionPolicy.uniform("int8")
  # A: 0.6 + 0.45 s; B: 1.8 s; + 5 ms of remainder and optimizer
  assert step(traced, int8) == pytest.approx(5.0 + 0.6 + 0.45 + 1.8)
  fitted = refit_quantized_leg_scale(one, traced, 5.0 + 0.6 + 0.5 * 2.25)
  assert fitted.quantized_leg_scale == pytest.approx(0.5)  # A's forward stays 0.6, whatever s
  # int8_fwd: the forwards at int8 (A as traced, B scaled), the fp16 gradient legs unchanged
  fwd_only = step(prof, PrecisionPolicy.uniform("int8_fwd")) - step(
    fitted, PrecisionPolicy.uniform("int8_fwd")
  )
  assert fwd_only == pytest.approx((0.3 - 0.6) + (0.3 - 0.5 * 0.3))
  for float_plan in ("fp32", "bf16"):
    assert step(fitted, PrecisionPolicy.uniform(float_plan)) == step(
      prof, PrecisionPolicy.uniform(float_plan)
    )


def test_quantized_leg_scale_below_zero_is_clipped_and_said():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)
  fitted = refit_quantized_leg_scale(one, prof, 4.0)  # shorter than the rest of the step (5 ms)
  assert fitted.quantized_leg_scale == 0.0
  assert fitted.meta["quantized_leg_scale_clipped"] == pytest.approx(5.0)  # the floor: legs free
  assert "quantized_leg_scale_clipped" not in refit_quantized_leg_scale(one, fitted, 6.5).meta


def test_quantized_leg_scale_is_bisected_where_an_all_reduce_ends_the_step():
  # on 2 devices the last all-reduce bucket ends the step while the int8 legs are cheap, and the
  # backward once they are dear: the step is not linear in the scale, and the secant misses
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS)
  cluster = ClusterSpec((DeviceGroup("gpus", "cpu", 2, 1e3, prof.batch_per_device, link_gbps=1.0),))
  options = {"latency_us": 0.0, "bucket_bytes": 1}
  int8 = Plan(policies={"gpus": PrecisionPolicy.uniform("int8")})

  def step(scale):
    scaled = dataclasses.replace(prof, quantized_leg_scale=scale)
    return predict(cluster, {"cpu": scaled}, int8, **options).step_ms

  secant = (30.0 - step(0.0)) / (step(1.0) - step(0.0))
  assert abs(step(secant) - 30.0) > 1.0
  fitted = refit_quantized_leg_scale(cluster, prof, 30.0, **options)
  assert step(fitted.quantized_leg_scale) == pytest.approx(30.0)


def test_refit_profile_fits_the_remainder_then_the_quantized_scale():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)
  fitted = refit_profile(one, prof, 12.0, 7.0)  # fp32: 1 + 1 + 4 + 2 + 3 + 3 + 1 = 15 before
  plan = {p: Plan(policies={"all": PrecisionPolicy.uniform(p)}) for p in ("fp32", "int8")}
  assert predict(one, {"cpu": fitted}, plan["fp32"]).step_ms == pytest.approx(12.0)
  assert predict(one, {"cpu": fitted}, plan["int8"]).step_ms == pytest.approx(7.0)
  assert sum(fitted.remainder_ms.values()) == pytest.approx(1.0)  # 4 - 3
  assert fitted.quantized_leg_scale == pytest.approx((7.0 - 1.0 - 1.0) / 3.0)
  assert refit_profile(one, prof, 12.0).quantized_leg_scale == 1.0  # no int8 step: not fitted


def test_remainder_is_fitted_on_the_all_bf16_step_and_the_fp32_legs_scaled_to_the_fp32_step():
  # ops A (first: no dlhs) and B at fp32: fwd 1, dlhs 2, drhs 3 ms, 10 ms of fp32 legs in all;
  # bf16 legs 0.5x. All-bf16 step = 0.5 · 10 + remainder + optimizer 1 = 6 + remainder.
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)

  def step(p, policy):
    return predict(one, {"cpu": p}, Plan(policies={"all": policy})).step_ms

  assert step(prof, PrecisionPolicy.uniform("fp32")) == pytest.approx(15.0)
  fitted = refit_16bit_remainder(one, prof, 7.0, 17.0)
  assert sum(fitted.remainder_ms.values()) == pytest.approx(1.0)  # 7 - 6
  assert fitted.fp32_leg_scale == pytest.approx(1.5)  # 17 = 1.5 · 10 + 1 + 1
  assert step(fitted, PrecisionPolicy.uniform("bf16")) == pytest.approx(7.0)
  assert step(fitted, PrecisionPolicy.uniform("fp16")) == pytest.approx(7.0)
  assert step(fitted, PrecisionPolicy.uniform("fp32")) == pytest.approx(17.0)
  assert fit_presets(fitted) == ("fp32", "bf16") and fitted.meta["sixteen_bit_fit_step_ms"] == 7.0
  # the one remainder serves every plan: int8 legs keep their cost, the remainder is 3 ms less
  int8 = PrecisionPolicy.uniform("int8")
  assert step(prof, int8) - step(fitted, int8) == pytest.approx(3.0)
  # A at bf16, B at fp32: 0.5 · (1 + 3) + 1.5 · (1 + 2 + 3) + remainder 1 + optimizer 1
  a, b = prof.op_names
  half = PrecisionPolicy.from_ops({a: OpPolicy.preset("bf16"), b: OpPolicy.preset("fp32")})
  assert step(fitted, half) == pytest.approx(2.0 + 9.0 + 1.0 + 1.0)
  # a refit to a cluster's fp32 step moves the remainder and keeps the scale
  shifted = refit_remainder(one, fitted, 19.0)
  assert sum(shifted.remainder_ms.values()) == pytest.approx(3.0) and shifted.fp32_leg_scale == 1.5
  # a fp32 step shorter than the replay with its fp32 legs free: scale 0, said in the meta
  clipped = refit_16bit_remainder(one, prof, 7.0, 1.5)
  assert clipped.fp32_leg_scale == 0.0 and clipped.meta["fp32_leg_scale_clipped"] == pytest.approx(2.0)
  # refit_profile fits all three fit plans, the quantized scale on the bf16 step's remainder
  both = refit_profile(one, prof, 12.0, 7.0, 6.5)
  for plan, ms in (("fp32", 12.0), ("int8", 7.0), ("bf16", 6.5)):
    assert step(both, PrecisionPolicy.uniform(plan)) == pytest.approx(ms)
  assert fit_presets(both) == ("fp32", "int8", "bf16")
  assert sum(both.remainder_ms.values()) == pytest.approx(0.5)


def test_a_profile_with_the_former_16bit_remainder_loads_refitted_to_its_recorded_fit_steps():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  obj = prof.to_json()
  del obj["fp32_leg_scale"]
  obj["remainder_16bit_ms"] = {"fwd": 0.5, "bwd": 1.0}  # as written before fp32_leg_scale
  obj["meta"] = {"fp32_step_ms": 17.0, "sixteen_bit_fit_step_ms": 7.0}
  loaded = Profile.from_json(obj)
  assert loaded.meta["legacy_remainder_16bit_ms"] == {"fwd": 0.5, "bwd": 1.0}
  assert sum(loaded.remainder_ms.values()) == pytest.approx(1.0) and loaded.fp32_leg_scale == pytest.approx(
    1.5
  )
  obj["meta"] = {}  # no fit steps recorded: the fp32 remainder as it was
  assert Profile.from_json(obj).remainder_ms == prof.remainder_ms
  with pytest.raises(PlanError, match="malformed profile"):
    Profile.from_json({**obj, "meta": "not a mapping"})


def _two_groups():
  return ClusterSpec(
    (
      DeviceGroup("train", "A100", 2, 1e3, 8, link_gbps=100.0),
      DeviceGroup("infer", "T4", 2, 1e3, 8, link_gbps=100.0),
    )
  )


def test_calibrate_refits_the_named_groups_profile_to_its_fp32_step_alone():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, device_type="A100", remainder_ms=1.0)
  cluster = _two_groups()
  out = calibrate(cluster, {"A100": prof}, {"infer": 40.0, "train": 25.0})
  for name, ms in (("infer", 40.0), ("train", 25.0)):
    group = next(g for g in cluster.groups if g.name == name)
    fp32 = Plan(policies={name: PrecisionPolicy.uniform("fp32")})
    alone = predict(ClusterSpec((group,)), out, fp32)
    assert alone.step_ms == pytest.approx(ms)
  assert out["T4"].source == "modeled"  # no T4 profile was given: the modeled one is refitted
  assert calibrate(cluster, {"A100": prof}, {}) == {"A100": prof}


def test_calibrate_on_one_device_leaves_the_device_count_to_the_replay():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, device_type="A100", remainder_ms=1.0)
  cluster = _two_groups()
  train = cluster.groups[0]
  fp32 = Plan(policies={"train": PrecisionPolicy.uniform("fp32")})
  one = calibrate(cluster, {"A100": prof}, {"train": 25.0}, devices="one")
  on_one = ClusterSpec((dataclasses.replace(train, count=1),))
  assert predict(on_one, one, fp32).step_ms == pytest.approx(25.0)
  # on the group's two devices the replay adds what the all-reduce leaves exposed
  assert predict(ClusterSpec((train,)), one, fp32).step_ms > 25.0
  both = calibrate(cluster, {"A100": prof}, {"train": 25.0})  # devices="group"
  assert predict(ClusterSpec((train,)), both, fp32).step_ms == pytest.approx(25.0)
  with pytest.raises(PlanError, match="calibration devices 'all'.*Fix: 'group'"):
    calibrate(cluster, {"A100": prof}, {"train": 25.0}, devices="all")


@pytest.mark.parametrize(
  ("steps", "message"),
  [
    ({"gpu": 10.0}, "does not have (groups: ['infer', 'train'])"),
    ({"train": -1.0}, "positive number of ms"),
    ({"train": float("nan")}, "positive number of ms"),
    ({"train": True}, "positive number of ms"),
    ({"train": 1e-6}, "less than half the 4.06 ms its ops and optimizer take"),  # shorter than its ops
  ],
)
def test_calibrate_refuses_bad_input_with_a_fix(steps, message):
  prof = fake_profile([(1, 2, 3)], rhs_elems=ELEMS, device_type="A100")
  with pytest.raises(PlanError, match="Fix:") as e:
    calibrate(_two_groups(), {"A100": prof}, steps)
  assert message in str(e.value)


def test_calibrate_refuses_two_groups_sharing_one_profile():
  prof = fake_profile([(1, 2, 3)], rhs_elems=ELEMS, device_type="A100")
  cluster = ClusterSpec((DeviceGroup("a", "A100", 1, 1e3, 8), DeviceGroup("b", "A100", 2, 1e3, 8)))
  with pytest.raises(PlanError, match="both A100 and share its profile"):
    calibrate(cluster, {"A100": prof}, {"a": 10.0, "b": 12.0})
