"""fp32/bf16/fp16 all-reduce and Global-QSGD under shard_map over 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels.quantize.reference import scale_from_absmax
from planners.profiler import hlo
from qsync_jax.errors import QsyncError
from qsync_jax.ops.vma import shard_map
from qsync_jax.sync import allreduce, global_qsgd_allreduce, make_grad_sync
from qsync_jax.sync.global_qsgd import payload_for

N = 8


def _tree(key, scale=1.0):
  """A gradient-like tree with one row per device (leading axis N)."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "dense": {
      "kernel": scale * jax.random.normal(k1, (N, 48, 40)),
      "bias": scale * jax.random.normal(k2, (N, 40)),
    },
    "conv": scale * jax.random.normal(k3, (N, 3, 3, 4, 8)),
  }


def _per_device(fn, mesh):
  """Runs ``fn(local_tree, key) -> tree`` per device on a tree whose leading axis is the device."""

  def local(tree, key):
    out = fn(jax.tree.map(lambda x: x[0], tree), key)
    return jax.tree.map(lambda x: x[None], out)

  return jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))


@pytest.mark.parametrize(
  "dtype,accumulate,tol",
  [("fp32", "payload", 1e-6), ("bf16", "payload", 3e-2), ("bf16", "fp32", 1e-2), ("fp16", "fp32", 1e-3)],
)
def test_allreduce_matches_sum(mesh, dtype, accumulate, tol):
  tree = _tree(jax.random.key(101))
  out = _per_device(lambda t, k: allreduce(t, "data", dtype=dtype, accumulate=accumulate), mesh)(
    tree, jax.random.key(0)
  )
  for got, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    want = np.asarray(x).sum(0)
    assert got.dtype == x.dtype
    for d in range(N):  # every device holds the same sum
      # tolerance relative to the largest summand: n-way sums of O(1) values, rounded in the payload
      np.testing.assert_allclose(np.asarray(got[d]), want, atol=tol * N * float(np.abs(x).max()), rtol=0)


def _qsgd_draws(mesh, tree, keys, rounding):
  """``len(keys)`` independent Global-QSGD all-reduces of ``tree`` (vmapped over the keys)."""

  def local(t, ks):
    t = jax.tree.map(lambda x: x[0], t)
    out = jax.vmap(lambda k: global_qsgd_allreduce(t, "data", k, rounding=rounding))(ks)
    return jax.tree.map(lambda x: x[None], out)

  fn = jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
  return fn(tree, keys)


def _max_z(draws, tree):
  """Largest |mean of draws - true sum| in standard errors, over every element of every leaf."""
  worst = 0.0
  for d, x in zip(jax.tree.leaves(draws), jax.tree.leaves(tree)):
    d = np.asarray(d[0], np.float64)  # device 0's copy: (draws, ...)
    bias = d.mean(0) - np.asarray(x, np.float64).sum(0)
    se = d.std(0, ddof=1) / np.sqrt(d.shape[0])
    worst = max(worst, float(np.max(np.abs(bias) / (se + 1e-6 * np.abs(x).max()))))
  return worst


def _small_values_tree(key):
  """Values mostly below half a quantization level, plus one max per leaf: nearest rounding zeroes them."""
  tree = _tree(key, scale=0.01)
  return jax.tree.map(lambda x: x.at[(slice(None),) + (0,) * (x.ndim - 1)].set(1.0), tree)


def test_global_qsgd_is_unbiased_and_the_test_catches_bias(mesh):
  tree = _small_values_tree(jax.random.key(102))
  keys = jax.random.split(jax.random.key(103), 400)
  # max over ~2.5k elements of |z|; P(|z| > 5) per element is 6e-7 for an unbiased estimator.
  assert _max_z(_qsgd_draws(mesh, tree, keys, "stochastic"), tree) < 5.0
  assert _max_z(_qsgd_draws(mesh, tree, keys, "nearest"), tree) > 5.0  # deterministic and biased


def test_global_qsgd_cannot_overflow(mesh):
  """Every worker at +max (and at -max): the int8 sum n*L = 120 <= 127 and comes back exactly."""
  gmax = float(np.random.default_rng(107).uniform(0.5, 2.0))
  for sign in (1.0, -1.0):
    tree = jax.tree.map(lambda x, v=sign * gmax: jnp.full_like(x, v), _tree(jax.random.key(0)))
    out = _per_device(lambda t, k: global_qsgd_allreduce(t, "data", k), mesh)(tree, jax.random.key(1))
    for got in jax.tree.leaves(out):
      np.testing.assert_allclose(np.asarray(got), sign * N * gmax, rtol=1e-6)


def test_global_qsgd_sends_zeros_for_a_leaf_too_small_for_a_normal_scale(mesh):
  """A leaf whose max / L is below float32's smallest normal (flushed to 0 by XLA) gets scale 1
  (not 0, which divides its zeros into NaN) and comes back as zeros; the leaves beside it are
  summed as usual."""
  scales = jax.jit(lambda m: scale_from_absmax(m, 15))(jnp.array([0.0, 1e-37, 1.5]))
  np.testing.assert_allclose(np.asarray(scales), [1.0, 1.0, 0.1], rtol=1e-6)
  tree = _tree(jax.random.key(5))
  tree["dense"]["bias"] = jnp.where(jnp.arange(40) % 2 == 0, 0.0, 1e-37) * jnp.ones((N, 40))
  out = _per_device(lambda t, k: global_qsgd_allreduce(t, "data", k), mesh)(tree, jax.random.key(6))
  bias = np.asarray(out["dense"]["bias"])
  assert np.all(np.isfinite(bias)) and np.max(np.abs(bias)) <= N * 1e-37
  kernel = np.asarray(out["dense"]["kernel"])
  want = np.asarray(tree["dense"]["kernel"]).sum(0)
  # one quantization step of the leaf's own scale per worker
  assert np.max(np.abs(kernel[0] - want)) <= N * np.abs(np.asarray(tree["dense"]["kernel"])).max() / 15


def test_payload_choice():
  assert payload_for(8) == ("int8", 15)
  assert payload_for(127) == ("int8", 1)
  assert payload_for(128) == ("int16", 255)
  assert payload_for(8, "int32")[0] == "int32"
  with pytest.raises(QsyncError, match="wider payload"):
    payload_for(200, "int8")


def _compiled(mesh, reduce_fn, params):
  def local(t, key):
    return reduce_fn(jax.tree.map(lambda x: x[0], t), key)

  fn = jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
  return hlo.compiled_text(fn, params, jax.random.key(0))


def test_hlo_payload_global_qsgd_vs_fp32(mesh):
  tree = _tree(jax.random.key(3))
  fp32 = hlo.collectives(_compiled(mesh, lambda t, k: allreduce(t, "data"), tree))
  qsgd = hlo.collectives(
    _compiled(mesh, lambda t, k: global_qsgd_allreduce(t, "data", k, bucket_size=512), tree)
  )
  bf16 = hlo.collectives(_compiled(mesh, lambda t, k: allreduce(t, "data", dtype="bf16"), tree))
  fp32_bytes = hlo.summarize(fp32)["bytes"]
  assert fp32_bytes == 4 * sum(x[0].size for x in jax.tree.leaves(tree))
  assert hlo.summarize(qsgd)["bytes"] <= 0.26 * fp32_bytes
  assert {c.dtypes for c in qsgd if c.op == "all-reduce" and c.bytes > 64} == {("s8",)}
  assert len([c for c in qsgd if "f32" in c.dtypes]) == 1  # the one pmax of all bucket maxima
  wide = hlo.collectives(
    _compiled(mesh, lambda t, k: global_qsgd_allreduce(t, "data", k, payload="int16"), tree)
  )
  assert {c.dtypes for c in wide if c.op == "all-reduce" and c.bytes > 64} == {("s16",)}
  # bf16 (fp32 accumulation): all_to_all + all_gather of uint16 bits, half the ring traffic of fp32
  assert {c.dtypes for c in bf16} == {("u16",)}
  assert hlo.summarize(bf16)["wire_bytes"] == pytest.approx(0.5 * hlo.summarize(fp32)["wire_bytes"])


def test_make_grad_sync_contract(mesh):
  tree = _tree(jax.random.key(104))
  for name in ("fp32", "bf16", "fp16", "global_qsgd"):
    init, sync = make_grad_sync(name)
    state = init(jax.tree.map(lambda x: x[0], tree))

    def local(t, s, k, sync=sync):
      out, s = sync(jax.tree.map(lambda leaf: leaf[0], t), s, k)
      return out, s

    fn = jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P(), P())))
    out, state = fn(tree, state, jax.random.key(1))
    assert int(state["steps"]) == 1
    for got, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
      assert got.shape == x.shape[1:] and got.dtype == x.dtype
      np.testing.assert_allclose(np.asarray(got), np.asarray(x).sum(0), atol=0.5 * float(np.abs(x).max()) * N)
  with pytest.raises(QsyncError, match="make_selsync_step"):
    make_grad_sync("selsync")
  with pytest.raises(QsyncError, match="unknown"):
    make_grad_sync("int4")


def test_all_gather_invariant_fallback(mesh, monkeypatch):
  """On a jax whose all_gather lacks ``to="invarying"``, the psum fallback gathers the same values."""
  from jax import lax

  from qsync_jax.sync.common import all_gather_invariant

  x = jax.random.normal(jax.random.key(105), (N * 4, 3))
  fn = lambda: jax.jit(shard_map(all_gather_invariant, mesh=mesh, in_specs=P("data"), out_specs=P()))  # noqa: E731
  native = fn()(x)
  plain = lax.all_gather

  def old_all_gather(x, axis_name, *, tiled=False, to="varying", **kwargs):
    if to != "varying":
      raise TypeError("all_gather() got an unexpected keyword argument 'to'")
    return plain(x, axis_name, tiled=tiled, **kwargs)

  monkeypatch.setattr(lax, "all_gather", old_all_gather)
  fallback = fn()(x)
  assert [c.op for c in hlo.collectives(hlo.compiled_text(fn(), x))] == ["all-reduce"]  # the fallback ran
  np.testing.assert_array_equal(np.asarray(native), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(fallback), np.asarray(x))


def test_bucketed_allreduce_is_one_collective_per_bucket_in_leaf_order(mesh):
  """``bucket_bytes``: consecutive leaves concatenated into psums of at most that many bytes;
  the sums are those of the one-psum all-reduce."""
  tree = _tree(jax.random.key(106))
  sizes = [4 * x[0].size for x in jax.tree.leaves(tree)]  # conv 1152, dense bias 160, kernel 7680 B
  assert sizes == [1152, 160, 7680]
  plain = _per_device(lambda t, k: allreduce(t, "data"), mesh)(tree, jax.random.key(0))
  bucketed = _per_device(lambda t, k: allreduce(t, "data", bucket_bytes=2000), mesh)(tree, jax.random.key(0))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(bucketed)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-5)
  # the program we hand XLA: {conv, bias} = 1312 B fit in 2000; the kernel is a bucket of its
  # own (XLA:CPU's combiner then merges the two; XLA:GPU's merges only up to 30 MiB together)
  assert _psum_bytes(lambda t: allreduce(t, "data", bucket_bytes=2000), tree) == [[1312], [7680]]
  # unbucketed: one psum per leaf, left to XLA's combiner
  assert _psum_bytes(lambda t: allreduce(t, "data"), tree) == [[1152], [160], [7680]]
  with pytest.raises(QsyncError, match="bucket_bytes.*Fix"):
    allreduce(tree, "data", dtype="bf16", bucket_bytes=2000)  # the all_to_all path has no buckets


def _psum_bytes(reduce_fn, tree) -> list[list[int]]:
  """Operand bytes of every psum in the jaxpr of ``reduce_fn`` on one device's leaves, in order."""
  local = jax.tree.map(lambda x: x[0], tree)
  jaxpr = jax.make_jaxpr(lambda t: reduce_fn(t), axis_env=[("data", N)])(local)
  return [
    [v.aval.size * v.aval.dtype.itemsize for v in eqn.invars]
    for eqn in jaxpr.jaxpr.eqns
    if eqn.primitive.name.startswith("psum")
  ]


def test_pack_keeps_order_and_limit():
  from qsync_jax.sync.allreduce import pack

  assert pack([3, 3, 5, 1, 9, 2], 6) == [[0, 1], [2, 3], [4], [5]]
  assert pack([], 6) == []


@pytest.mark.parametrize(
  "name, options, match",
  [
    ("fp32", {"bucket_bytes": "abc"}, "is of type str, but bucket_bytes takes an integer.*Fix"),
    ("fp32", {"bucket_bytes": 0}, "not a positive number of bytes.*Fix"),
    ("bf16", {"bucket_bytes": 1024}, "apply to the psum paths.*Fix"),
  ],
)
def test_make_grad_sync_refuses_bad_buckets_when_built(name, options, match):
  with pytest.raises(QsyncError, match=match):
    make_grad_sync(name, **options)
  make_grad_sync("bf16", bucket_bytes=1024, accumulate="payload")  # the payload psum takes buckets
