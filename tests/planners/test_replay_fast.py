"""``sync_step_ms`` (the replay without a graph) against the latest end of ``longest_path`` over
``build_graph``: bit-for-bit equal on random fake profiles and BERT-base, every mode."""

import dataclasses
import functools
import os

import numpy as np
import pytest

from benchmarks.common.result_rows import ROOT
from benchmarks.common.zoo import bert_profile
from planners.predictor.graph import Comm, GroupLink, buckets, build_graph, longest_path, op_costs
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import sync_step_ms
from planners.profile import GroupCost
from qsync_jax.precision import LEGS, PRESETS, OpPolicy
from tests.planners.fakes import fake_profile

SEED = 8
MODES = (("flat", "replicated"), ("flat", "sharded"), ("two_level", "replicated"))
ORDERS = ("tree", "backward")
MIXED = OpPolicy(fwd="int8", dlhs="fp32", drhs="bf16")
"""An int8 forward with float gradient legs: its chain has a cast node."""


def graph_step_ms(groups, comm, cost_fn=None) -> float:
  return max(end for _, end in longest_path(build_graph(groups, comm, cost_fn)))


def comm_of(groups, rng, reduction, update, order) -> Comm:
  links = tuple(GroupLink(int(rng.integers(1, 5)), float(rng.uniform(10, 300))) for _ in groups)
  return Comm(
    n_devices=sum(link.n_devices for link in links),
    link_gbps=float(rng.uniform(1, 100)),
    bucket_bytes=int(rng.integers(2_000, 40_000)) if groups[0].profile.model == "fake" else 25 * 2**20,
    latency_us=float(rng.uniform(0, 30)),
    bucket_order=order,
    reduction=reduction,
    optimizer_update=update,
    groups=links,
    leader_link_gbps=float(rng.uniform(1, 100)),
  )


def policies_of(prof, rng) -> dict:
  """A random policy per op among those the profile has every leg's time of (None: float)."""
  out = {}
  for op in prof.ops:
    table = prof.op_ms[op.name]
    usable = [None, MIXED, *PRESETS.values()]
    usable = [p for p in usable if p is None or all(getattr(p, leg) in table[leg] for leg in LEGS)]
    out[op.name] = usable[int(rng.integers(len(usable)))]
  return out


def fake_groups(rng, n_groups: int, n_ops: int) -> list[GroupCost]:
  groups = []
  for j in range(n_groups):
    prof = fake_profile(
      rng.uniform(0.1, 3.0, size=(n_ops, 3)).tolist(),
      rhs_elems=int(rng.integers(200, 5_000)),
      device_type=f"dev{j}",
      remainder_ms=float(rng.uniform(-30.0, 5.0)),  # negative: fitted below the ops' standalone sum
      optimizer_ms=float(rng.uniform(0.0, 4.0)),
      cast_a=float(rng.uniform(0.0, 1e-4)),
      extra_param_bytes=int(rng.integers(0, 8_000)),
    )
    groups.append(GroupCost(f"g{j}", prof, policies_of(prof, rng), int(rng.integers(1, 33))))
  return groups


@pytest.mark.parametrize("reduction,update", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_fast_step_equals_graph_on_random_fake_profiles(reduction, update, order):
  rng = np.random.default_rng([SEED, MODES.index((reduction, update)), ORDERS.index(order)])
  several = 0  # trials whose gradient runs in more than one bucket (one set of collectives each)
  for trial in range(25):
    groups = fake_groups(rng, n_groups=2 + trial % 3, n_ops=int(rng.integers(2, 9)))
    comm = comm_of(groups, rng, reduction, update, order)
    assert sync_step_ms(groups, comm) == graph_step_ms(groups, comm)
    several += len(buckets(groups[0].profile, comm.bucket_bytes, comm.bucket_order)) > 1
  assert several >= 10


def test_fast_step_equals_graph_on_bert_base():
  base = bert_profile()
  profiles = [modeled_profile(base, t) for t in ("A100", "V100", "L4", "T4")]
  rng = np.random.default_rng(SEED)
  for n_groups in (2, 3, 4):
    for reduction, update in MODES:
      for order in ORDERS:
        groups = [
          GroupCost(f"g{j}", prof, policies_of(prof, rng), int(rng.integers(1, 65)))
          for j, prof in enumerate(profiles[:n_groups])
        ]
        comm = comm_of(groups, rng, reduction, update, order)
        assert sync_step_ms(groups, comm) == graph_step_ms(groups, comm)


def test_a_negative_remainder_can_leave_the_forward_as_the_latest_end():
  # forward 2 × 10 ms, remainder -60 ms: the backward (2 × 2 ms) and all else end before 20 ms
  prof = fake_profile([(10.0, 1.0, 1.0), (10.0, 1.0, 1.0)], remainder_ms=-60.0, optimizer_ms=1.0)
  group = GroupCost("g", prof, {}, prof.batch_per_device)
  comm = Comm(n_devices=2, link_gbps=10.0, bucket_bytes=4_000)
  assert sync_step_ms([group], comm) == graph_step_ms([group], comm) == 20.0


def test_memo_follows_policies_batch_and_cost_fn():
  rng = np.random.default_rng(SEED)
  groups = fake_groups(rng, n_groups=2, n_ops=4)
  comm = comm_of(groups, rng, "flat", "replicated", "tree")
  first = sync_step_ms(groups, comm)
  # the same group name with other policies, another batch, or another cost function
  slower = {name: PRESETS["fp32"] for name in groups[0].profile.op_names}
  changed = [
    [GroupCost("g0", groups[0].profile, slower, groups[0].batch_per_device), groups[1]],
    [GroupCost("g0", groups[0].profile, groups[0].op_policies, 64), groups[1]],
  ]
  for other in changed:
    assert sync_step_ms(other, comm) == graph_step_ms(other, comm) != first

  def doubled(group, op_index):
    return {kind: (2 * ms, p) for kind, (ms, p) in op_costs(group, op_index).items()}

  for cost_fn in (doubled, functools.partial(doubled)):
    assert sync_step_ms(groups, comm, cost_fn) == graph_step_ms(groups, comm, cost_fn) > first
  assert sync_step_ms(groups, comm) == first


def test_no_groups_is_an_error():
  with pytest.raises(ValueError, match="at least one group"):
    sync_step_ms([], Comm(n_devices=1, link_gbps=1.0))


@pytest.mark.parametrize("sync", ["bf16", "fp16", "global_qsgd"])
def test_fast_step_equals_graph_for_each_priced_sync(sync):
  rng = np.random.default_rng([SEED, 7, len(sync)])
  for trial in range(10):
    groups = fake_groups(rng, n_groups=2 + trial % 3, n_ops=int(rng.integers(2, 7)))
    types = ("A100", "T4", "cpu", "L4")  # the passes stream at the device type's catalog bandwidth
    groups = [
      dataclasses.replace(g, profile=dataclasses.replace(g.profile, device_type=types[j]))
      for j, g in enumerate(groups)
    ]
    comm = dataclasses.replace(comm_of(groups, rng, "flat", "replicated", "tree"), sync=sync)
    assert sync_step_ms(groups, comm) == graph_step_ms(groups, comm)


def test_a_sync_of_its_own_runs_on_the_whole_gradient_after_the_backward():
  """One group of 4 T4s, 1e6 gradient elements, bf16: the backward, the cast passes (the measured
  bytes, split 6 : 8 before / after as counted, at the T4's 320 GB/s · 0.9), a reduce-scatter's and
  an all-gather's 2-byte payload, the optimizer; no overlap."""
  from planners.predictor.collectives import reduce_scatter_ms
  from planners.predictor.payload import MEASURED_PASS_BYTES, pass_ms, wire_bytes

  prof = fake_profile([(1.0, 1.0, 1.0)], rhs_elems=10**6, device_type="T4", optimizer_ms=2.0)
  elements = prof.memory["param_bytes"] / 4
  group = GroupCost("g", prof, {}, prof.batch_per_device)
  comm = Comm(n_devices=4, link_gbps=8.0, latency_us=0.0, sync="bf16")
  before, after = pass_ms("bf16", "T4", elements, 4)
  counted = 6 * MEASURED_PASS_BYTES["bf16"] / 14
  assert before == pytest.approx(counted * elements / (320e9 * 0.9) * 1e3 + 2 * 5e-3)
  assert wire_bytes("bf16", 4) == 2 and wire_bytes("global_qsgd", 4) == 1 and wire_bytes("fp32", 4) == 4
  backward = graph_step_ms([group], Comm(n_devices=1, link_gbps=8.0)) - 2.0  # one device: no collective
  collective = 2 * reduce_scatter_ms(2 * elements, 4, 8.0, 0.0)
  assert sync_step_ms([group], comm) == pytest.approx(backward + before + collective + after + 2.0)
  nodes = build_graph([group], comm)
  assert [n.kind for n in nodes[-4:]] == ["sync", "comm", "sync", "optimizer"]
  from planners.predictor.timeline import COLORS

  assert {n.kind for n in nodes} <= set(COLORS)  # `qsync predict --png` draws every kind of node


def test_a_sync_of_its_own_is_refused_where_the_trainer_cannot_run_it():
  from qsync_jax.errors import PlanError

  with pytest.raises(PlanError, match="sync 'bf16' with reduction='flat', optimizer_update='sharded'"):
    Comm(n_devices=4, link_gbps=8.0, optimizer_update="sharded", sync="bf16")
  with pytest.raises(PlanError, match="selsync.*Fix:"):
    Comm(n_devices=4, link_gbps=8.0, sync="selsync")


def test_the_priced_passes_are_the_committed_measurement():
  """``MEASURED_PASS_BYTES`` reproduces, through ``pass_ms``, each sync's step over fp32's in the
  committed one-device H200 rows it was derived from (``benchmarks.multigpu --cases sync``)."""
  import json

  from planners.predictor.payload import MEASURED_PASS_BYTES, pass_ms

  rows = [
    json.loads(line)
    for line in open(os.path.join(ROOT, "benchmarks", "results", "multigpu.jsonl"))
    if '"ms_over_fp32_measured"' in line
  ]
  found = {r["case"].split("/")[1]: r for r in rows if r["device"] == "NVIDIA H200 x1" and r["devices"] == 1}
  assert set(MEASURED_PASS_BYTES) <= set(found)
  for sync, r in found.items():
    modeled = sum(pass_ms(sync, "H200", r["param_elements"], 1))
    assert modeled == pytest.approx(r["value"], rel=0.01, abs=1e-9), sync
