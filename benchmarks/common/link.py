"""Link microbenchmark: the all-reduce cost model of the local devices, measured.

The replay costs each gradient bucket as a ring all-reduce (``planners.predictor.collectives.allreduce_ms``):
``ms = latency + 2(n−1)/n · bytes / bandwidth``. ``measure_link(devices)`` times a jitted fp32
``psum`` over ``devices`` at several sizes — on a GPU queued back to back, as a step queues its
collectives (``planners.profiler.timing.default_step_clock``), so the host's round trip per call
stays out of the latency — and fits that line by least squares, giving the
``link_gbps`` (Gbit/s, as ``DeviceGroup.link_gbps``) and ``latency_us`` the replay takes
instead of the catalog's datasheet link. It measures collectives alone, never a training step,
so a prediction calibrated by it is still a prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from planners.profiler.timing import default_step_clock, timed_ms
from qsync_jax.ops.vma import shard_map

DEFAULT_SIZES = (2**20, 2**22, 2**24, 2**26, 2**28)
"""Bytes per device of the timed all-reduces (1 to 256 MiB: gradient buckets up to a whole
gradient; below the largest sizes an NVLink all-reduce does not reach its bandwidth)."""


@dataclasses.dataclass(frozen=True)
class LinkModel:
  """``ms = latency_us/1e3 + ring_bytes / (link_gbps/8 · 1e6)``, fitted on ``n_devices``.

  ``rel_rms``: the fit's relative RMS error over the measured sizes."""

  n_devices: int
  link_gbps: float
  latency_us: float
  rel_rms: float


def ring_bytes(nbytes: float, n_devices: int) -> float:
  """Bytes each device sends in a ring all-reduce of ``nbytes``."""
  return 2.0 * (n_devices - 1) / n_devices * nbytes


def fit_link(n_devices: int, sizes: Sequence[float], times_ms: Sequence[float]) -> LinkModel:
  """Least-squares ``ms = b + a · ring_bytes`` → bandwidth ``8 / (a·1e6)`` Gbit/s, latency ``b``.

  A non-positive slope (times that do not grow with size) cannot give a bandwidth: ValueError."""
  x = np.array([ring_bytes(s, n_devices) for s in sizes], np.float64)
  y = np.asarray(times_ms, np.float64)
  design = np.stack([x, np.ones_like(x)], axis=1)
  (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
  if a <= 0:
    raise ValueError(
      f"all-reduce times {list(np.round(y, 4))} ms do not grow with sizes {list(sizes)} B; "
      "no bandwidth can be fitted. Fix: time larger sizes or more repeats."
    )
  rel = float(np.sqrt(np.mean(((design @ np.array([a, b]) - y) / y) ** 2)))
  return LinkModel(n_devices, 8.0 / (a * 1e6), max(float(b), 0.0) * 1e3, rel)


def measure_link(
  devices: Sequence[jax.Device], sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 10
) -> LinkModel:
  """Fits the all-reduce line from jitted fp32 ``psum``s of ``sizes`` bytes per device."""
  n = len(devices)
  if n < 2:
    raise ValueError(f"measure_link needs at least 2 devices, got {n}.")
  mesh = Mesh(np.asarray(devices), ("link",))
  sharding = NamedSharding(mesh, P("link"))
  psum = jax.jit(
    shard_map(lambda x: jax.lax.psum(x, "link"), mesh=mesh, in_specs=P("link"), out_specs=P("link"))
  )
  times = []
  for size in sizes:
    x = jax.device_put(jnp.ones((n * (size // 4),), jnp.float32), sharding)
    times.append(timed_ms(lambda x=x: psum(x), repeats, clock=default_step_clock())[0])
  return fit_link(n, sizes, times)
