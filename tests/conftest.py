"""Test harness: 8 simulated CPU devices and strict dtype promotion, set before jax starts.

The ``gpu``-marked tests run on a GPU with ``JAX_PLATFORMS=cuda`` (then the devices are the
GPU's, not the simulated CPUs): ``JAX_PLATFORMS=cuda python -m pytest -m gpu tests``.

Strict promotion catches silent upcasts in our code. Third-party code is not always clean
under it (optax's Adam raises a Python float to an int32 power in its bias correction), so a
test that runs such code marks itself ``@pytest.mark.standard_promotion`` (or a module sets
``pytestmark = pytest.mark.standard_promotion``) and runs with standard promotion.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU, LLVM's optimization of XLA's generated code is most of a test's compile time and
# the tests' programs are tiny: compiling them unoptimized runs the suite about 12 % faster.
CPU_FLAGS = " --xla_backend_optimization_level=0" if os.environ["JAX_PLATFORMS"] == "cpu" else ""
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + CPU_FLAGS
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

if os.environ["JAX_PLATFORMS"] == "cpu":
  assert jax.device_count() == 8, "tests/conftest.py must run before anything imports jax"


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
  with jax.numpy_dtype_promotion(mode):
    yield


@pytest.fixture(autouse=True, scope="session")
def _auto_policy_cache(tmp_path_factory):
  """``qsync train --plan auto`` keeps its searches in ``$QSYNC_CACHE_DIR``: a fresh one for the
  session, not the user's cache."""
  previous = os.environ.get("QSYNC_CACHE_DIR")
  os.environ["QSYNC_CACHE_DIR"] = str(tmp_path_factory.mktemp("qsync-cache"))
  yield
  if previous is None:
    os.environ.pop("QSYNC_CACHE_DIR", None)
  else:
    os.environ["QSYNC_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def mesh():
  """The 8-device ``data`` mesh of the collective tests (``qsync_jax/sync``, ``planners/test_hlo.py``)."""
  return Mesh(np.array(jax.devices()), ("data",))
