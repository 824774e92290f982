"""Shared fixtures of the sync tests: the 8-device ``data`` mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


@pytest.fixture(scope="session")
def mesh():
  return Mesh(np.array(jax.devices()), ("data",))
