"""The link microbenchmark's fit and its measurement on simulated CPU devices."""

import jax
import numpy as np
import pytest

from benchmarks.common import link
from planners.predictor.collectives import allreduce_ms


def test_fit_recovers_the_ring_model():
  rng = np.random.default_rng(101)
  n, gbps, lat = int(rng.integers(2, 9)), float(rng.uniform(50, 3000)), float(rng.uniform(5, 50))
  sizes = [2**20, 2**22, 2**24, 2**26]
  times = [allreduce_ms(s, n, gbps, lat) for s in sizes]
  fit = link.fit_link(n, sizes, times)
  assert fit.link_gbps == pytest.approx(gbps, rel=1e-6)
  assert fit.latency_us == pytest.approx(lat, rel=1e-6)
  assert fit.rel_rms < 1e-9


def test_fit_refuses_times_that_do_not_grow():
  with pytest.raises(ValueError, match="do not grow"):
    link.fit_link(2, [2**20, 2**22], [1.0, 0.5])


def test_measure_link_on_simulated_devices():
  fit = link.measure_link(jax.devices()[:2], sizes=(2**16, 2**20, 2**22), repeats=3)
  assert fit.n_devices == 2
  assert fit.link_gbps > 0 and fit.latency_us >= 0


def test_measure_link_needs_two_devices():
  with pytest.raises(ValueError, match="at least 2"):
    link.measure_link(jax.devices()[:1])
