"""Times of the gradient collectives the step runs, as pure functions of bytes, devices, link.

Every function takes ``nbytes`` (the buffer each device holds), a device count and a link
bandwidth in Gbit/s (as ``qsync_jax.cluster.DeviceGroup.link_gbps``, NICs are quoted so), or
``groups = [(devices, Gbit/s)]``, and returns milliseconds; ``latency_us`` is the fixed cost of one collective (or of one round of
point-to-point sends). With ``B = gbps · 1e9 / 8`` bytes/s and ``L = latency_us · 1e-3`` ms:

* ring all-reduce (``allreduce_ms``): ``2(n−1)/n · S/B + L``;
* ring reduce-scatter (``reduce_scatter_ms``) and all-gather (``all_gather_ms``) of a buffer of
  ``S`` bytes: ``(n−1)/n · S/B + L`` each, the two halves of the ring all-reduce's bytes;
* binary trees (``tree_ms``): a reduce to the first device of every group at once, or its
  reverse broadcast, one point-to-point collective per round: round ``r`` sends ``S`` between
  pairs of every group of more than ``2^r`` devices and lasts as long as its slowest pair:
  ``Σ_{r < ceil(log2 max n_g)} (max_{g: n_g > 2^r} S/B_g + L)``; one group of ``n``:
  ``ceil(log2 n) · (S/B + L)``;
* ring all-reduce in separate rounds (``round_ring_allreduce_ms``): a reduce-scatter then an
  all-gather in ``n`` chunks, ``2(n−1)`` rounds of ``S/n`` bytes: ``2(n−1) · (S/(n·B) + L)``;
* two-level (``two_level_ms``): the trees' reduce, a round ring among the ``G`` group leaders,
  the trees' broadcast: ``2 · tree_ms + round_ring_allreduce_ms(G)``.

All are 0 for one device (nothing to exchange). These are modeled times, not measured.
"""

from __future__ import annotations

from collections.abc import Sequence


def transfer_ms(nbytes: float, gbps: float) -> float:
  """ms to send ``nbytes`` over a link of ``gbps`` Gbit/s: ``1e3 · nbytes / (gbps · 1e9 / 8)``."""
  return 1e3 * nbytes / (gbps * 1e9 / 8)


def allreduce_ms(nbytes: float, n_devices: int, link_gbps: float, latency_us: float = 10.0) -> float:
  """Ring all-reduce time in ms: ``2(n−1)/n · bytes / bandwidth + latency`` (0 for n ≤ 1).

  ``link_gbps`` is in Gbit/s, as ``qsync_jax.cluster.DeviceGroup.link_gbps`` (NICs are quoted so).
  """
  if n_devices <= 1:
    return 0.0
  return 2.0 * (n_devices - 1) / n_devices * transfer_ms(nbytes, link_gbps) + latency_us * 1e-3


def reduce_scatter_ms(nbytes: float, n_devices: int, link_gbps: float, latency_us: float = 10.0) -> float:
  """Ring reduce-scatter of ``nbytes`` per device into ``n`` shards: ``(n−1)/n · bytes / bandwidth
  + latency`` (0 for n ≤ 1), the first half of ``allreduce_ms``'s bytes."""
  if n_devices <= 1:
    return 0.0
  return (n_devices - 1) / n_devices * transfer_ms(nbytes, link_gbps) + latency_us * 1e-3


def all_gather_ms(nbytes: float, n_devices: int, link_gbps: float, latency_us: float = 10.0) -> float:
  """Ring all-gather of ``n`` shards into ``nbytes`` on every device: the same time as
  ``reduce_scatter_ms`` (the second half of ``allreduce_ms``'s bytes)."""
  return reduce_scatter_ms(nbytes, n_devices, link_gbps, latency_us)


def tree_rounds(n_devices: int) -> int:
  """Rounds of a binary tree over ``n`` devices: ``ceil(log2 n)`` (0 for one device)."""
  return max(n_devices - 1, 0).bit_length()


def tree_ms(nbytes: float, groups: Sequence[tuple[int, float]], latency_us: float = 10.0) -> float:
  """Binary-tree reduces of ``nbytes`` to the first device of each of ``groups = [(devices,
  Gbit/s between two of them)]`` by point-to-point sends, or the reverse broadcasts, every
  group's sends of a round in one collective (``qsync_jax.sync.two_level``): round ``r`` (of
  ``ceil(log2 max n_g)``) sends the whole buffer in every group of more than ``2^r`` devices and
  lasts as long as the slowest of them: ``Σ_r (max_{g: n_g > 2^r} bytes / bandwidth_g + latency)``
  (0 where every group has one device)."""
  rounds = tree_rounds(max((n for n, _ in groups), default=1))
  slowest = [min(gbps for n, gbps in groups if n > 2**r) for r in range(rounds)]
  return sum(transfer_ms(nbytes, gbps) + latency_us * 1e-3 for gbps in slowest)


def round_ring_allreduce_ms(
  nbytes: float, n_devices: int, link_gbps: float, latency_us: float = 10.0
) -> float:
  """A ring all-reduce run as ``2(n−1)`` separate rounds (reduce-scatter then all-gather in ``n``
  chunks), each sending ``bytes / n`` and paying the latency: ``2(n−1) · (bytes / (n ·
  bandwidth) + latency)`` (0 for one device)."""
  if n_devices <= 1:
    return 0.0
  rounds = 2 * (n_devices - 1)
  return rounds * (transfer_ms(nbytes / n_devices, link_gbps) + latency_us * 1e-3)


def two_level_ms(
  nbytes: float, groups: Sequence[tuple[int, float]], leader_link_gbps: float, latency_us: float = 10.0
) -> float:
  """Two-level all-reduce of ``nbytes`` over ``groups = [(devices, intra-group Gbit/s)]``: every
  group reduces to its first device (``tree_ms``), the ``G`` leaders all-reduce
  (``round_ring_allreduce_ms`` over ``leader_link_gbps``), every group broadcasts back
  (``tree_ms``): ``2 · tree_ms + round_ring_allreduce_ms(G)``."""
  ring = round_ring_allreduce_ms(nbytes, len(groups), leader_link_gbps, latency_us)
  return 2 * tree_ms(nbytes, groups, latency_us) + ring
