"""The collective formulas against hand-computed times.

Throughout: 1e6 bytes over 8 Gbit/s (1e9 bytes/s) take 1 ms; a latency of 10 µs is 0.01 ms.
"""

import pytest

from planners.predictor.collectives import (
  all_gather_ms,
  allreduce_ms,
  reduce_scatter_ms,
  round_ring_allreduce_ms,
  transfer_ms,
  tree_ms,
  tree_rounds,
  two_level_ms,
)

S, GBPS, LAT = 1e6, 8.0, 10.0


def test_transfer():
  assert transfer_ms(S, GBPS) == pytest.approx(1.0)
  assert transfer_ms(S, 2 * GBPS) == pytest.approx(0.5)


def test_ring_all_reduce_is_reduce_scatter_then_all_gather():
  assert allreduce_ms(S, 4, GBPS, LAT) == pytest.approx(2 * 3 / 4 + 0.01)
  assert reduce_scatter_ms(S, 4, GBPS, LAT) == pytest.approx(3 / 4 + 0.01)
  assert all_gather_ms(S, 4, GBPS, LAT) == pytest.approx(3 / 4 + 0.01)
  # the same bytes on the wire; the two collectives pay two latencies
  halves = reduce_scatter_ms(S, 4, GBPS, LAT) + all_gather_ms(S, 4, GBPS, LAT)
  assert halves == pytest.approx(allreduce_ms(S, 4, GBPS, LAT) + 0.01)
  for f in (allreduce_ms, reduce_scatter_ms, all_gather_ms):
    assert f(S, 1, GBPS, LAT) == 0.0  # one device: nothing to exchange


@pytest.mark.parametrize("n, rounds", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)])
def test_tree_rounds_are_ceil_log2(n, rounds):
  assert tree_rounds(n) == rounds


def test_tree_sends_the_whole_buffer_each_round():
  assert tree_ms(S, [(4, GBPS)], LAT) == pytest.approx(2 * (1.0 + 0.01))
  assert tree_ms(S, [(5, GBPS)], LAT) == pytest.approx(3 * (1.0 + 0.01))
  assert tree_ms(S, [(1, GBPS), (1, GBPS)], LAT) == 0.0  # one device per group: no round


def test_the_groups_trees_share_their_rounds():
  # 4 devices at 16 Gbit/s and 2 at 8: round 0 pairs devices in both groups and waits for the
  # slower (1 ms), round 1 only in the group of 4 (0.5 ms); each round pays the latency once
  assert tree_ms(S, [(4, 2 * GBPS), (2, GBPS)], LAT) == pytest.approx(1.01 + 0.51)


def test_round_ring_pays_the_latency_every_round():
  # 2(n-1) rounds of S/n bytes
  assert round_ring_allreduce_ms(S, 2, GBPS, LAT) == pytest.approx(2 * (0.5 + 0.01))
  assert round_ring_allreduce_ms(S, 4, GBPS, LAT) == pytest.approx(6 * (0.25 + 0.01))
  assert round_ring_allreduce_ms(S, 1, GBPS, LAT) == 0.0
  # the bytes of a ring all-reduce, 2(n-1) latencies instead of one
  assert round_ring_allreduce_ms(S, 4, GBPS, 0.0) == pytest.approx(allreduce_ms(S, 4, GBPS, 0.0))


def test_two_level_is_the_trees_around_the_leaders_ring():
  # trees 1.52 ms (above) each way; leaders' ring over 2 groups: 2 x (0.5 + 0.01) ms
  groups = [(4, 2 * GBPS), (2, GBPS)]
  assert two_level_ms(S, groups, GBPS, LAT) == pytest.approx(2 * 1.52 + 1.02)
  # one device per group: only the leaders' ring
  assert two_level_ms(S, [(1, GBPS), (1, GBPS)], GBPS, LAT) == pytest.approx(1.02)
  # one group: only its trees
  assert two_level_ms(S, [(4, GBPS)], GBPS, LAT) == pytest.approx(2 * 2.02)
