"""Replay predictor on hand-built graphs with a known longest path and overlap; the remainder's fit."""

import dataclasses
import json

import numpy as np
import pytest

from planners.predictor.collectives import allreduce_ms
from planners.predictor.graph import Comm, buckets, build_graph, in_step_factors, longest_path
from planners.predictor.replay import comm_for, group_costs, predict, sync_step_ms
from planners.predictor.timeline import chrome_trace, save_png
from planners.profile import GroupCost
from planners.profiler.fit import fit_remainder, one_device
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.sync.two_level import BUCKET_BYTES as TWO_LEVEL_BUCKET_BYTES
from tests.planners.fakes import fake_profile

# 156250 fp32 weights = 625000 bytes; 2 devices over 1 Gbit/s: 2·(1/2)·625000·8/1e9 s = 5 ms.
ELEMS = 156250
SEED = 2024


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
  lhs = int(np.random.default_rng(SEED).integers(1000, 5000))
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
  # (or, after the backward of this 2-device step, the local and the reduced gradient: 5 P)
  assert _memory("A100", lhs, "bf16")[0] == max(4 * params + 3 * 2 * lhs, 5 * params)


def test_predict_memory_on_cpu_keeps_fp32_copies_of_upcast_residuals():
  # XLA:CPU runs 16-bit legs as fp32 products: a bf16 residual is kept as fp32, and an int8
  # activation residual read by an fp16 drhs leg is kept dequantized (4 bytes, not 1)
  lhs = int(np.random.default_rng(SEED).integers(1000, 5000))
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
  lhs = int(np.random.default_rng(SEED).integers(1000, 5000))
  sr = OpPolicy.preset("int8")  # the all-int8 preset: stochastic gradient rounding
  assert sr.grad_rounding == "stochastic"
  nearest = dataclasses.replace(sr, grad_rounding="nearest")
  for device_type in ("cpu", "A100"):
    prof = fake_profile([(1, 1, 1)] * 3, lhs_elems=lhs, device_type=device_type)
    cluster = _cluster(device_type=device_type)
    got = {
      # both groups at the policy: every device holds every group's branch (``program_memory_bytes``)
      p.grad_rounding: predict(
        cluster,
        {device_type: prof},
        Plan(policies={"a": PrecisionPolicy(default=p), "b": PrecisionPolicy(default=p)}),
      )
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


def test_fit_remainder_reproduces_a_step_shorter_than_the_forward():
  # standalone timings inflated (a busy host): the fp32 step measured 4 ms, less than the
  # forward alone (2 ms) plus the backward (8 ms); the remainder of -6 ms moves the backward earlier
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], optimizer_ms=0.0)
  fitted = fit_remainder(prof, "fp32", 4.0)
  fp32 = Plan(policies={"all": PrecisionPolicy.uniform("fp32")})
  assert sum(fitted.remainder_ms.values()) == pytest.approx(-6.0)
  assert predict(one_device(prof), {"cpu": fitted}, fp32).step_ms == pytest.approx(4.0)


def test_fit_remainder_matches_the_fit_step_and_shifts_every_plan_alike():
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, remainder_ms=4.0, optimizer_ms=1.0)
  group = DeviceGroup("gpus", "cpu", 2, 1e3, prof.batch_per_device, link_gbps=1.0)
  cluster = ClusterSpec((group,))
  uniform = {p: Plan(policies={"gpus": PrecisionPolicy.uniform(p)}) for p in ("fp32", "bf16")}
  before = {p: predict(cluster, {"cpu": prof}, plan, latency_us=0.0).step_ms for p, plan in uniform.items()}
  fitted = fit_remainder(prof, "bf16", 30.0, cluster, latency_us=0.0)
  after = {p: predict(cluster, {"cpu": fitted}, plan, latency_us=0.0).step_ms for p, plan in uniform.items()}
  assert after["bf16"] == pytest.approx(30.0)
  # the remainder sits on the compute chain before the backward, so the whole step moves by
  # the fit's change
  assert after["fp32"] - before["fp32"] == pytest.approx(30.0 - before["bf16"])
  assert fitted.remainder_ms["bwd"] == pytest.approx(2 * fitted.remainder_ms["fwd"])
  assert fitted.op_ms == prof.op_ms  # nothing else changes


def test_an_op_traced_in_the_int8_step_takes_its_own_forward_and_backward_factors():
  # ops A (first: no dlhs) and B, int8 legs 0.3x fp32's (fwd 1, dlhs 2, drhs 3 ms), so A's
  # standalone int8 costs are fwd 0.3 / bwd 0.9 and B's fwd 0.3 / bwd 1.5. The trace of the
  # all-int8 step charged A 0.6 / 0.45 ms (factors 2 and 0.5); B has no backward time charged
  # (its kernels named after a neighbour), so B keeps its standalone costs.
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0)
  a, b = prof.op_names
  traced = dataclasses.replace(
    prof, quantized_in_step_ms={a: {"fwd": 0.6, "bwd": 0.45}, b: {"fwd": 0.3, "bwd": 0.0}}
  )
  assert in_step_factors(traced, 0) == pytest.approx((2.0, 0.5))
  assert in_step_factors(traced, 1) is None and in_step_factors(prof, 0) is None
  one = one_device(prof)

  def step(p, policy):
    return predict(one, {"cpu": p}, Plan(policies={"all": policy})).step_ms

  int8 = PrecisionPolicy.uniform("int8")
  # A: 0.6 + 0.45; B: 0.3 + 1.5; + 5 ms of remainder and optimizer
  assert step(traced, int8) == pytest.approx(5.0 + 0.6 + 0.45 + 1.8)
  # int8_fwd: A's forward at int8 as traced (0.6, not 0.3), the fp16 gradient legs unchanged
  assert step(traced, PrecisionPolicy.uniform("int8_fwd")) - step(
    prof, PrecisionPolicy.uniform("int8_fwd")
  ) == pytest.approx(0.6 - 0.3)
  # A at int8, B at bf16 (0.5x): A's legs as traced, B's as standalone
  mixed = PrecisionPolicy.from_ops({a: OpPolicy.preset("int8"), b: OpPolicy.preset("bf16")})
  assert step(traced, mixed) == pytest.approx(5.0 + 0.6 + 0.45 + 0.5 * 6)
  for float_plan in ("fp32", "bf16"):  # no quantized leg: unchanged
    assert step(traced, PrecisionPolicy.uniform(float_plan)) == step(
      prof, PrecisionPolicy.uniform(float_plan)
    )


# -- the cluster's links, the two-level reduction and the sharded update ---------------------


def test_default_fields_reproduce_the_single_ring_over_the_slowest_link():
  # the trace test's cluster: 2 groups x 2 devices at 1 Gbit/s, no intra_link_gbps; the
  # gradient (1.25e6 B, one bucket) in one ring over 4 devices: 2·(3/4)·10 ms + 10 µs
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=1.0)
  cluster = _cluster()
  pred = predict(cluster, {"cpu": prof}, Plan.uniform(cluster, "fp32"))
  ring = Comm(4, 1.0)  # what a flat ring over every device at the slowest link_gbps priced
  groups = [GroupCost(g, prof, _fp32(prof), 8) for g in ("a", "b")]
  assert pred.step_ms == sync_step_ms(groups, ring) == pytest.approx(10.0 + 15.01 + 1.0)
  assert pred.comm_ms == pytest.approx(15.01) and pred.comm_ms_by_phase == {"all-reduce": pred.comm_ms}
  explicit = Plan.uniform(cluster, "fp32")
  assert (explicit.reduction, explicit.optimizer_update) == ("flat", "replicated")
  # an intra link equal to the inter link prices the same
  same = ClusterSpec(tuple(g.replace(intra_link_gbps=1.0) for g in cluster.groups))
  assert predict(same, {"cpu": prof}, explicit).step_ms == pred.step_ms
  assert pred.optimizer_tail_ms == {"a": 1.0, "b": 1.0}


def test_the_flat_ring_runs_at_the_slowest_link_it_crosses():
  def spec(*groups):
    return ClusterSpec(tuple(DeviceGroup(n, "cpu", 4, 1.0, 8, link, intra) for n, link, intra in groups))

  # within one group: its intra link only (the NIC is not crossed)
  assert comm_for(spec(("a", 1.0, 24.0))).link_gbps == 24.0
  assert comm_for(spec(("a", 1.0, None))).link_gbps == 1.0
  # across groups: the slowest link_gbps and intra_link_gbps of every group
  assert comm_for(spec(("a", 10.0, 24.0), ("b", 4.0, None))).link_gbps == 4.0
  assert comm_for(spec(("a", 10.0, 24.0), ("b", 4.0, 2.0))).link_gbps == 2.0
  # the leaders' ring of two_level: the slowest link_gbps; each group's tree its intra link
  comm = comm_for(spec(("a", 10.0, 24.0), ("b", 4.0, 2.0)), reduction="two_level")
  assert comm.leader_link_gbps == 4.0 and [(g.n_devices, g.intra_link_gbps) for g in comm.groups] == [
    (4, 24.0),
    (4, 2.0),
  ]


def _nvlink_pair(n_per_group):
  """Two groups of ``n_per_group`` devices: 24 Gbit/s inside each, 1 Gbit/s between them."""
  return ClusterSpec(tuple(DeviceGroup(n, "cpu", n_per_group, 1.0, 8, 1.0, 24.0) for n in ("a", "b")))


def _reductions(cluster, latency_us=0.0):
  # ops A and B (fwd 1, dlhs 2, drhs 3 ms), 625000 B of gradient each, one bucket per op
  prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=1.0)
  return {
    r: predict(
      cluster,
      {"cpu": prof},
      Plan(reduction=r),
      bucket_bytes=4 * ELEMS,
      latency_us=latency_us,
    )
    for r in ("flat", "two_level")
  }


def test_two_level_beats_flat_with_fast_links_inside_groups_of_several_devices():
  pred = _reductions(_nvlink_pair(4))
  # flat: each bucket over 8 devices at 1 Gbit/s, 2·(7/8)·5 ms = 8.75 ms; bucket 0 after B's drhs
  # (7 ms): [7, 15.75], [15.75, 24.5], the last optimizer half after it
  assert pred["flat"].step_ms == pytest.approx(24.5 + 0.5)
  # two_level, in the trainer's 30 MiB buckets (whatever predict's bucket_bytes: they are the flat
  # all-reduce's): one bucket of the whole 1.25e6 B after the backward (10 ms): trees of 2 rounds
  # at 24 Gbit/s (2 x 0.41667 ms) each side of the leaders' ring (2 rounds of 5 ms), then the optimizer
  tree = 2 * 1.25e6 * 8 / 24e9 * 1e3
  assert pred["two_level"].comm_ms_by_phase == pytest.approx(
    {"intra reduce": tree, "inter all-reduce": 10.0, "intra broadcast": tree}
  )
  assert pred["two_level"].step_ms == pytest.approx(10.0 + 2 * tree + 10.0 + 1.0)
  assert pred["two_level"].step_ms < pred["flat"].step_ms
  # two_level's one bucket overlaps nothing of the backward; flat hides 3 ms under A's drhs, 0.5 ms under
  # the optimizer of bucket 0
  assert pred["two_level"].exposed_comm_ms == pytest.approx({"a": 2 * tree + 10.0, "b": 2 * tree + 10.0})
  assert pred["flat"].exposed_comm_ms["a"] == pytest.approx(17.5 - 3.0 - 0.5)
  # with the default latency too
  pred = _reductions(_nvlink_pair(4), latency_us=10.0)
  assert pred["two_level"].step_ms < pred["flat"].step_ms


def test_two_level_runs_bucket_by_bucket_overlapping_the_backward():
  """Two buckets (one per op): each bucket's three stages start once both groups have its
  gradient and after the previous bucket's broadcast; each group's update of a bucket after its
  broadcast. The fast replay (``sync_step_ms``) equals the graph's longest path."""
  fast = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=1.0)
  slow = fake_profile([(2, 4, 6), (2, 4, 6)], rhs_elems=ELEMS, optimizer_ms=2.0, device_type="slow")
  groups = [GroupCost(n, p, _fp32(p), p.batch_per_device) for n, p in (("a", fast), ("b", slow))]
  cluster = ClusterSpec(tuple(DeviceGroup(n, "cpu", 4, 1.0, 8, 1.0, 24.0) for n in ("a", "b")))
  comm = dataclasses.replace(comm_for(cluster, reduction="two_level", latency_us=0.0), bucket_bytes=4 * ELEMS)
  nodes = build_graph(groups, comm)
  times = longest_path(nodes)
  stages = [(n.name, t) for n, t in zip(nodes, times) if n.stream == "comm"]
  assert [name for name, _ in stages] == [
    f"{phase} bucket {b} (0.6 MiB)"
    for b in (0, 1)
    for phase in ("intra reduce", "inter all-reduce", "intra broadcast")
  ]
  tree = 2 * 625000 * 8 / 24e9 * 1e3  # 2 rounds of the bucket at 24 Gbit/s
  # bucket 0 (op B) once the slow group's B drhs ends (2+2 fwd, 4+6 B bwd = 14 ms), while its A drhs
  # runs [14, 20]: 5 ms of ring (2 rounds of 625000/2 B at 1 Gbit/s) between the trees
  assert [x for _, t in stages[:3] for x in t] == pytest.approx(
    [14.0, 14.0 + tree, 14.0 + tree, 19.0 + tree, 19.0 + tree, 19.0 + 2 * tree]
  )
  # bucket 1 (op A) after the slow group's backward (20 ms) and bucket 0's broadcast
  start = max(20.0, 19.0 + 2 * tree)
  assert stages[3][1][0] == pytest.approx(start)
  assert stages[5][1][1] == pytest.approx(start + 5.0 + 2 * tree)
  # each group updates a bucket (half its optimizer_ms) after that bucket's broadcast
  updates = {(n.group, n.name): t for n, t in zip(nodes, times) if n.kind == "optimizer"}
  assert list(updates[("a", "optimizer (bucket 0)")]) == pytest.approx([19.0 + 2 * tree, 19.5 + 2 * tree])
  assert updates[("b", "optimizer (bucket 1)")][1] == pytest.approx(start + 5.0 + 2 * tree + 1.0)
  assert sync_step_ms(groups, comm) == max(end for _, end in times)
  assert comm.bucket_order == "backward"


def test_two_level_takes_the_trainers_buckets():
  cluster = _nvlink_pair(2)
  comm = comm_for(cluster, 1000, bucket_order="tree", reduction="two_level")
  assert (comm.bucket_bytes, comm.bucket_order) == (TWO_LEVEL_BUCKET_BYTES, "backward")
  assert (comm_for(cluster, 1000, bucket_order="tree").bucket_bytes, comm.bucket_bytes) == (1000, 30 * 2**20)


def test_flat_beats_two_level_with_one_device_per_group():
  # the same bytes cross the slow link either way; flat overlaps them with the backward
  pred = _reductions(_nvlink_pair(1))
  assert pred["flat"].step_ms == pytest.approx(17.0 + 0.5)  # buckets [7, 12], [12, 17]
  assert pred["two_level"].comm_ms_by_phase["intra reduce"] == 0.0
  assert pred["two_level"].step_ms == pytest.approx(10.0 + 10.0 + 1.0)
  assert pred["flat"].step_ms < pred["two_level"].step_ms
  pred = _reductions(_nvlink_pair(1), latency_us=10.0)
  assert pred["flat"].step_ms < pred["two_level"].step_ms


def test_sharded_update_divides_the_slow_groups_optimizer_by_the_devices():
  # the "slow" group's devices take 12 ms for the whole update (slow memory), "fast" 1 ms;
  # 2 + 2 devices at 1 Gbit/s, one bucket per op (625000 B: 5 ms over the link)
  profiles = {
    "A100": fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=1.0, device_type="A100"),
    "T4": fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, optimizer_ms=12.0, device_type="T4"),
  }
  cluster = ClusterSpec(
    (DeviceGroup("fast", "A100", 2, 40, 8, 1.0), DeviceGroup("slow", "T4", 2, 16, 8, 1.0))
  )

  def run(update):
    return predict(cluster, profiles, Plan(optimizer_update=update), bucket_bytes=4 * ELEMS, latency_us=0.0)

  replicated, sharded = run("replicated"), run("sharded")
  assert replicated.optimizer_tail_ms == pytest.approx({"fast": 1.0, "slow": 12.0})
  assert sharded.optimizer_tail_ms == pytest.approx({"fast": 1.0 / 4, "slow": 12.0 / 4})
  # replicated: all-reduces of 7.5 ms [7, 14.5], [14.5, 22]; the slow group's 6 ms halves after each
  assert replicated.step_ms == pytest.approx(22.0 + 6.0)
  # sharded: reduce-scatters of 3.75 ms [7, 10.75], [10.75, 14.5]; the slow group's 1.5 ms shard
  # updates [10.75, 12.25], [14.5, 16]; all-gathers after the last reduce-scatter [14.5, 18.25],
  # [18.25, 22]
  assert sharded.comm_ms_by_phase == pytest.approx({"reduce-scatter": 7.5, "all-gather": 7.5})
  assert sharded.step_ms == pytest.approx(22.0)
  assert sharded.comm_ms == pytest.approx(replicated.comm_ms)  # the same bytes on the wire
  # each device holds 1/4 of the optimizer state, and its quarter of the gradient, parameters and
  # update beside them (after the backward, which peaks here: 3 parameters' bytes)
  opt_bytes, params = profiles["T4"].memory["opt_state_bytes"], profiles["T4"].memory["param_bytes"]
  assert opt_bytes > 0
  for g in ("fast", "slow"):
    saved = replicated.memory_bytes[g] - sharded.memory_bytes[g]
    assert saved == pytest.approx(opt_bytes * 3 / 4 - params / 4, abs=1)


def test_two_level_with_a_sharded_update_is_refused_by_name():
  prof = fake_profile([(1, 2, 3)])
  cluster = _cluster()
  with pytest.raises(PlanError, match=r"reduction='two_level' with optimizer_update='sharded'.*Fix: use"):
    predict(cluster, {"cpu": prof}, Plan(reduction="two_level", optimizer_update="sharded"))
  with pytest.raises(PlanError, match=r"two_level.*sharded"):
    comm_for(cluster, reduction="two_level", optimizer_update="sharded")
  with pytest.raises(ValueError, match=r"needs groups and leader_link_gbps.*comm_for"):
    Comm(4, 1.0, reduction="two_level")


def test_predict_applies_where_supported_rules_as_the_trainer_does():
  """``"where_supported": true`` rules: the fp8 rule runs on the H100's dense op only (the A100
  has no fp8, a depthwise conv no 8-bit kernel); those ops get the bf16 default, and predict
  costs each group as the same plan written out op by op."""
  dense = fake_profile([(1, 2, 3)], rhs_elems=ELEMS)
  depthwise = dataclasses.replace(
    dense.ops[0], name="Conv_0:conv", kind="conv", lhs_shape=(8, 4, 4, 16), rhs_shape=(3, 3, 1, 16)
  )
  assert not depthwise.runs_8bit
  rule = {"path": ".*", "policy": "fp8", "where_supported": True}
  policy = PrecisionPolicy.from_json({"rules": [rule], "__default__": "bf16"})
  group = {"count": 1, "memory_gb": 80, "batch_per_device": 8}
  cluster = ClusterSpec.from_json(
    {"groups": [{"name": "h", "device_type": "H100", **group}, {"name": "a", "device_type": "A100", **group}]}
  )
  profiles = {}
  for device_type in ("H100", "A100"):
    prof = fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, device_type=device_type)
    ops = (prof.ops[0], dataclasses.replace(depthwise, rhs_elems=prof.ops[1].rhs_elems))
    op_ms = {"Dense_0:dense": prof.op_ms["Dense_0:dense"], "Conv_0:conv": prof.op_ms["Dense_1:dense"]}
    profiles[device_type] = dataclasses.replace(prof, ops=ops, op_ms=op_ms)
  plan = Plan(policies={"h": policy, "a": policy})
  expected = {
    "h": {"Dense_0:dense": "fp8", "Conv_0:conv": "bf16"},
    "a": {"Dense_0:dense": "bf16", "Conv_0:conv": "bf16"},
  }
  for cost in group_costs(cluster, profiles, plan):
    assert {n: p.fwd for n, p in cost.op_policies.items()} == expected[cost.name], cost.name
  written_out = Plan(
    policies={
      g: PrecisionPolicy.from_ops({n: OpPolicy.preset(p) for n, p in ops.items()})
      for g, ops in expected.items()
    }
  )
  assert (
    predict(cluster, profiles, plan).group_compute_ms
    == predict(cluster, profiles, written_out).group_compute_ms
  )
