"""The gradient payload's accuracy cost (``planners.indicator.payload_cost``): measured with the trainer's
own sync functions, fp32 the reference at 0, the narrower payloads ordered as their rounding says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.indicator.payload_cost import PAYLOAD_SYNCS, module_groups, payload_omega, synced, window_errors
from qsync_jax.ops.vma import shard_map
from qsync_jax.sync import make_grad_sync
from qsync_jax.sync.common import AXIS

N, SHAPES = 4, [(24, 16), (16,), (16, 5)]
"""Four batches' gradients of three leaves (a seeded draw, leaves of different magnitudes)."""


@pytest.fixture(scope="module")
def gradients():
  keys = jax.random.split(jax.random.key(7), len(SHAPES))
  stacked = [(i + 1.0) * jax.random.normal(k, (N, *s)) for i, (k, s) in enumerate(zip(keys, SHAPES))]
  weights = [jnp.full(s, 1e-6) for s in SHAPES]
  return stacked, weights


@pytest.fixture(scope="module")
def errors(gradients):
  """``window_errors`` at 2 devices for fp32 and every measured sync, and the windows' values."""
  stacked, weights = gradients
  syncs = ("fp32", *PAYLOAD_SYNCS)
  out = np.asarray(window_errors(stacked, weights, 2, jax.random.key(3), syncs))
  windows = [[np.asarray(x)[[k, (k + 1) % N]] / 2 for x in stacked] for k in range(N)]
  return dict(zip(syncs, np.moveaxis(out, 1, 0))), windows


def test_fp32_costs_nothing_and_the_narrower_payloads_cost_as_their_rounding_says(errors):
  by_sync, _ = errors
  assert np.all(by_sync["fp32"] == 0.0)  # the reference against itself, every window
  assert payload_omega(None, "fp32", 8) == 0.0  # measured or not
  error2 = {s: by_sync[s][:, 0].mean() for s in PAYLOAD_SYNCS}
  # fp16 keeps 11 significant bits, bf16 8, Global-QSGD int8 about log2(127 / 2) of the largest value
  assert 0 < error2["fp16"] < error2["bf16"] / 16 < error2["global_qsgd"] / 100
  omega = {s: by_sync[s][:, 1].mean() for s in PAYLOAD_SYNCS}
  np.testing.assert_allclose(
    [omega[s] for s in PAYLOAD_SYNCS], [1e-6 * error2[s] for s in PAYLOAD_SYNCS], rtol=1e-5
  )


def test_bf16s_cost_is_its_nearest_rounding_summed_in_fp32(errors):
  """The trainer's bf16 sync rounds each device's value to nearest, sums in fp32 and rounds the sum:
  the measured error is that, window by window (another rounding or accumulation would not be)."""
  by_sync, windows = errors
  for k, leaves in enumerate(windows):
    expected = 0.0
    for x in leaves:
      rounded = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
      summed = np.asarray(jnp.asarray(rounded.sum(0)).astype(jnp.bfloat16).astype(jnp.float32))
      expected += float(np.sum(np.square(summed - x.sum(0))))
    np.testing.assert_allclose(by_sync["bf16"][k, 0], expected, rtol=1e-4)  # fp32 summation order


def test_global_qsgds_cost_is_its_stochastic_rounding_variance(errors):
  """Unbiased dithering against the shared scale s = max|x| / floor(127 / n) leaves each device's
  element an error of variance s² p (1 − p), p the fraction of x / s: the measured E‖δ‖² over the
  windows is their sum (nearest rounding would give about half)."""
  by_sync, windows = errors
  expected = 0.0
  for leaves in windows:
    for x in leaves:
      scale = np.abs(x).max() / (127 // 2)
      p = x / scale - np.floor(x / scale)
      expected += float(np.sum(scale**2 * p * (1 - p))) / N
  np.testing.assert_allclose(by_sync["global_qsgd"][:, 0].mean(), expected, rtol=0.08)  # 4 draws of 4 × 808


def test_the_measured_sync_is_what_the_trainer_runs_under_shard_map(gradients):
  """``synced`` (``jax.vmap`` over the sync's axis) gives what the trainer's ``shard_map`` step gets
  from the same sync, values and key: the random draws included."""
  stacked, _ = gradients
  weighted = [x / N for x in stacked]
  key = jax.random.key(11)
  sync = make_grad_sync("global_qsgd")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), (AXIS,))

  def step(leaves):
    combined, _ = sync.sync([x[0] for x in leaves], sync.init(None), key)
    return [c[None] for c in combined]

  spec = jax.sharding.PartitionSpec(AXIS)
  on_mesh = jax.jit(shard_map(step, mesh=mesh, in_specs=([spec] * 3,), out_specs=[spec] * 3))(weighted)
  measured = jax.jit(lambda leaves: synced("global_qsgd", leaves, key))(weighted)
  for a, b in zip(measured, on_mesh):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[0])


def _payload(omega):
  """An indicator's payload section measured at 4 devices: ``{sync: Ω}``."""
  syncs = {s: {"4": {"error2": 1.0, "omega": w}} for s, w in omega.items()}
  return {"syncs": syncs, "devices": [4], "batches": 4, "optimizer": "adam", "lr": 1e-3}


def _plan(payload, slack):
  from planners.allocator.greedy import make_problem
  from planners.allocator.joint import joint_plan
  from planners.predictor.payload import PRICED_SYNCS
  from qsync_jax.cluster import ClusterSpec, DeviceGroup
  from tests.planners.fakes import fake_indicator, fake_profile

  # 4 A100 on a 10 Gbit/s link, 2 MB of gradient: Global-QSGD's step is the fastest, bf16's and
  # fp16's 1.11× it, fp32's 1.31×; the ops run at the training precision (their cost is 0)
  profile = fake_profile([(1.0, 1.0, 1.0)] * 2, device_type="A100", rhs_elems=250_000)
  cluster = ClusterSpec((DeviceGroup("train", "A100", 4, 40.0, 8, 10.0),))
  indicator = fake_indicator(profile.op_names, [1.0, 1.0])
  if payload is not None:
    indicator["payload"] = payload
  return joint_plan(make_problem(cluster, {"A100": profile}, indicator), 1, slack, syncs=PRICED_SYNCS)[0]


def test_sync_auto_takes_the_payload_of_least_measured_cost_within_the_slack():
  unmeasured = _plan(None, 0.2)
  assert (unmeasured.sync, unmeasured.payload_cost) == ("bf16", None)  # the widest within the slack
  cheap_fp16 = _plan(_payload({"bf16": 1e-9, "fp16": 1e-11, "global_qsgd": 1e-8}), 0.2)
  assert (cheap_fp16.sync, cheap_fp16.cost, cheap_fp16.payload_cost) == ("fp16", 1e-11, 1e-11)
  cheap_qsgd = _plan(_payload({"bf16": 1e-9, "fp16": 1e-9, "global_qsgd": 1e-10}), 0.2)
  assert (cheap_qsgd.sync, cheap_qsgd.payload_cost) == ("global_qsgd", 1e-10)
  # beyond the slack speed decides: the fastest payload, whatever it costs
  assert _plan(_payload({"bf16": 1e-9, "fp16": 1e-11, "global_qsgd": 1e-8}), 0.02).sync == "global_qsgd"
  # a device count the indicator did not measure: not measured, nothing charged
  assert payload_omega(_payload({"bf16": 1e-9}), "bf16", 8) is None
  assert payload_omega(_payload({"bf16": 1e-9}), "bf16", 4) == 1e-9


def test_the_figures_add_over_modules_so_a_model_is_measured_one_module_at_a_time(gradients):
  """``measure_payload`` measures one top-level module at a time (``module_groups``): every sync
  rounds each leaf on its own, so the nearest-rounding payloads' errors of two halves of the
  leaves add up to the whole's, window by window (a sync coupling leaves would not)."""
  stacked, weights = gradients
  whole = np.asarray(window_errors(stacked, weights, 2, jax.random.key(3), ("bf16", "fp16")))
  halves = [
    np.asarray(
      window_errors([stacked[i] for i in g], [weights[i] for i in g], 2, jax.random.key(5), ("bf16", "fp16"))
    )
    for g in ([0], [1, 2])
  ]
  np.testing.assert_allclose(halves[0] + halves[1], whole, rtol=1e-5)  # fp32 summation order
  params = {
    "block0": {"b": np.zeros(3), "k": np.zeros(5)},
    "block1": {"k": np.zeros(6)},
    "head": {"b": np.zeros(1)},
  }
  assert module_groups(params) == [[0, 1], [2], [3]]  # one top-level module a group
  nested = {"model": params, "ln": {"s": np.zeros(2)}}  # leaves: ln/s, model/block0/b, …/k, block1/k, head/b
  assert module_groups(nested) == [[0], [1, 2, 3, 4]]
  # a module of more leaves than the bound split by its next key, recursively
  assert module_groups(nested, max_leaves=2) == [[0], [1, 2], [3], [4]]
  assert module_groups({"w": np.zeros(2), "b": np.zeros(2)}, max_leaves=1) == [[0], [1]]
