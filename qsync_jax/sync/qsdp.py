"""QSDP: fully-sharded data parallel with quantized communication (Markov et al., arXiv 2302.02390).

Each parameter leaf is flattened, zero padded and split evenly over the mesh axis: device i
holds elements ``[i*m, (i+1)*m)``; the optimizer state is sharded the same way, so the
optimizer must be elementwise (sgd, momentum, adam, ...; ``make_qsdp_step`` refuses one that
is not, e.g. a global-norm clip: ``qsync_jax.sync.elementwise``). A step:

1. **weights**: each device quantizes its shard to int8 in buckets of ``bucket_size`` values
   (one absmax scale per bucket, stochastic rounding, via ``pallas_kernels.quantize``), the
   int8 values and the fp32 scales are all-gathered, and every device dequantizes the full
   weights;
2. forward and backward on the local batch at those weights (gradient w.r.t. the dequantized
   weights);
3. **gradients**: share-weighted gradients are reduce-scattered as integers with Global-QSGD's
   scheme (one ``pmax`` of every bucket's max, ``L = floor(qmax / n)`` levels, unbiased
   stochastic rounding), so each device receives the sum for its own shard;
4. the optimizer updates the shard.

Leaves for which ``full_precision(path, leaf)`` is true (default: 1-D or scalar -- biases and
norm scales) are gathered and reduce-scattered in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.quantize.api import dequantize, quantize
from pallas_kernels.quantize.reference import scale_from_absmax
from qsync_jax.errors import QsyncError
from qsync_jax.ops.vma import shard_map
from qsync_jax.sync.common import (
  AXIS,
  all_gather_invariant,
  batch_shares,
  device_key,
  leaf_keys,
  optimizer_init,
  to_varying,
)
from qsync_jax.sync.elementwise import check_elementwise_optimizer
from qsync_jax.sync.global_qsgd import INT_PAYLOADS, dither, payload_for


def small_leaf(path: str, leaf) -> bool:
  """Default full-precision predicate: scalars and 1-D leaves (biases, norm scales)."""
  del path
  return len(jnp.shape(leaf)) <= 1


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """How one parameter leaf is sharded: ``shard`` elements per device; ``quantized`` or not."""

  path: str
  shape: tuple[int, ...]
  dtype: Any
  shard: int
  quantized: bool

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  def padded(self, x, n: int) -> jax.Array:
    """``x`` (this leaf) flattened and zero padded to ``n * shard`` elements: device ``i``'s
    shard is ``padded(x, n)[i * shard:(i + 1) * shard]``."""
    flat = jnp.asarray(x).reshape(-1)
    return jnp.pad(flat, (0, n * self.shard - self.size))

  def unpadded(self, flat) -> jax.Array:
    """The leaf back from its ``n * shard`` padded elements: ``flat[:size].reshape(shape)``."""
    return flat[: self.size].reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class QSDPTrainer:
  """``init(params) -> state``; ``step(state, batch, key) -> (state, metrics)``; ``gather(state)``."""

  init: Callable[[Any], dict]
  step: Callable[[dict, Any, jax.Array], tuple[dict, dict]]
  gather: Callable[[dict], Any]
  layout: Any
  mesh: Mesh

  def params_of(self, state: dict):
    """The model's parameters: ``gather(state)`` (what evaluation and export use)."""
    return self.gather(state)


def make_layout(params, n: int, bucket_size: int, full_precision=small_leaf):
  """The ``LeafLayout`` tree of ``params`` sharded over ``n`` devices."""

  def one(path, x):
    name = jax.tree_util.keystr(path)
    quantized = not full_precision(name, x)
    shard = -(-int(np.prod(jnp.shape(x), dtype=np.int64)) // n)
    if quantized:
      shard = -(-shard // bucket_size) * bucket_size
    return LeafLayout(name, tuple(jnp.shape(x)), jnp.result_type(x), max(shard, 1), quantized)

  return jax.tree_util.tree_map_with_path(one, params)


def even_layout(params, n: int):
  """The ``LeafLayout`` tree of ``params`` sharded evenly over ``n`` devices, none quantized:
  ``ceil(size / n)`` elements per device (at least 1)."""
  return make_layout(params, n, 1, full_precision=lambda path, leaf: True)


def _is_layout(x) -> bool:
  return isinstance(x, LeafLayout)


def _check_optimizer(optimizer, params, layouts) -> None:
  """``QsyncError`` unless the optimizer's update on the shards means its update on ``params``."""
  fix = (
    "use a gradient-hook strategy (fp32, bf16, fp16, global_qsgd), whose optimizer sees the whole gradient"
  )
  check_elementwise_optimizer(optimizer, params, [lay.shard for lay in layouts], where="QSDP", fix=fix)


def make_qsdp_step(
  loss_fn: Callable[[Any, Any, jax.Array], jax.Array],
  optimizer: optax.GradientTransformation,
  params,
  mesh: Mesh | None = None,
  *,
  bucket_size: int = 1024,
  weight_payload: str = "int8",
  grad_payload: str = "auto",
  full_precision: Callable[[str, Any], bool] = small_leaf,
  shares: Sequence[float] | None = None,
  axis_name: str = AXIS,
) -> QSDPTrainer:
  """Builds QSDP's ``init`` / ``step`` / ``gather`` for parameters shaped like ``params``.

  ``weight_payload``: "int8" (quantized all-gather) or "fp32"; ``grad_payload``: "auto" /
  "int8" / "int16" / "int32" (quantized reduce-scatter) or "fp32".
  """
  if weight_payload not in ("int8", "fp32"):
    raise QsyncError(f"QSDP weight_payload={weight_payload!r} must be 'int8' or 'fp32'.")
  if grad_payload != "fp32" and grad_payload != "auto" and grad_payload not in INT_PAYLOADS:
    raise QsyncError(
      f"QSDP grad_payload={grad_payload!r} must be 'auto', 'fp32' or one of {list(INT_PAYLOADS)}."
    )
  if bucket_size < 1:
    raise QsyncError(f"QSDP bucket_size={bucket_size!r} must be a positive int.")
  mesh = mesh or Mesh(np.array(jax.devices()), (axis_name,))
  n = mesh.shape[axis_name]
  share_table = jnp.asarray(batch_shares(n, shares))
  layout = make_layout(params, n, bucket_size, full_precision)
  layouts, treedef = jax.tree.flatten(layout, is_leaf=_is_layout)
  _check_optimizer(optimizer, params, layouts)
  sharded = NamedSharding(mesh, P(axis_name))
  abstract_shards = jax.tree.unflatten(
    treedef, [jax.ShapeDtypeStruct((n * lay.shard,), lay.dtype) for lay in layouts]
  )
  opt_specs = jax.tree.map(
    lambda a: P(axis_name) if a.ndim else P(),
    jax.eval_shape(functools.partial(optimizer_init, optimizer), abstract_shards),
  )

  def init(params):
    def shard(x, lay):
      return jax.device_put(lay.padded(x, n), sharded)

    shards = jax.tree.unflatten(treedef, [shard(x, lay) for x, lay in zip(jax.tree.leaves(params), layouts)])
    out = jax.tree.map(lambda p: NamedSharding(mesh, p), opt_specs, is_leaf=lambda x: isinstance(x, P))
    opt_state = jax.jit(functools.partial(optimizer_init, optimizer), out_shardings=out)(shards)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return {"params": shards, "opt_state": opt_state, "step": step}

  def gather_weights(shards, key):
    full = []
    for x, lay, k in zip(shards, layouts, leaf_keys(key, shards)):
      if lay.quantized and weight_payload == "int8":
        qvalue, scale = quantize(x.reshape(-1, bucket_size), "int8", (1,), "stochastic", k)
        qvalue = all_gather_invariant(qvalue, axis_name)
        scale = all_gather_invariant(scale, axis_name)
        flat = dequantize(qvalue, scale, jnp.float32).reshape(-1)
      else:
        flat = all_gather_invariant(x.astype(jnp.float32), axis_name)
      full.append(lay.unpadded(flat).astype(lay.dtype))
    return full

  def scatter_grads(grads, key):
    rows = [lay.padded(g.astype(jnp.float32), n) for g, lay in zip(grads, layouts)]
    quantized = [i for i, lay in enumerate(layouts) if lay.quantized and grad_payload != "fp32"]
    out = [None] * len(rows)
    if quantized:
      name, levels = payload_for(n, grad_payload)
      buckets = [rows[i].reshape(-1, bucket_size) for i in quantized]
      gmax = lax.pmax(jnp.concatenate([jnp.max(jnp.abs(b), axis=1) for b in buckets]), axis_name)
      scales = scale_from_absmax(gmax, levels)
      start, qs, mine = 0, [], []
      me = lax.axis_index(axis_name)
      for b, k in zip(buckets, leaf_keys(key, buckets)):
        s = scales[start : start + b.shape[0]]
        start += b.shape[0]
        qs.append(dither(b, s[:, None], levels, k, INT_PAYLOADS[name][0]).reshape(-1))
        per_device = b.shape[0] // n
        mine.append(lax.dynamic_slice_in_dim(s, me * per_device, per_device))
      summed = [lax.psum_scatter(q, axis_name, tiled=True) for q in qs]
      for i, q, s in zip(quantized, summed, mine):
        out[i] = (q.astype(jnp.float32).reshape(-1, bucket_size) * s[:, None]).reshape(-1)
    for i, r in enumerate(rows):
      if out[i] is None:
        out[i] = lax.psum_scatter(r, axis_name, tiled=True)
    return [o.astype(lay.dtype) for o, lay in zip(out, layouts)]

  def local_step(state, batch, key):
    key = device_key(key, axis_name)
    k_weights, k_loss, k_grads = jax.random.split(key, 3)
    shards = jax.tree.leaves(state["params"])
    # Typed varying: the gradient w.r.t. an invariant value would come back already psum-ed (in fp32).
    full = to_varying(jax.tree.unflatten(treedef, gather_weights(shards, k_weights)), axis_name)
    share = share_table[lax.axis_index(axis_name)]
    loss, grads = jax.value_and_grad(loss_fn)(full, batch, k_loss)
    weighted = [share.astype(g.dtype) * g for g in jax.tree.leaves(grads)]
    grad_shards = jax.tree.unflatten(treedef, scatter_grads(weighted, k_grads))
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
      updates, opt_state = optimizer.update(grad_shards, state["opt_state"], state["params"])
      new_params = optax.apply_updates(state["params"], updates)
    total_loss = lax.psum(share * loss.astype(jnp.float32), axis_name)
    return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": total_loss}

  spec = {"params": P(axis_name), "opt_state": opt_specs, "step": P()}
  mapped = shard_map(
    local_step, mesh=mesh, in_specs=(spec, P(axis_name), P()), out_specs=(spec, {"loss": P()})
  )
  step = jax.jit(mapped)

  @jax.jit
  def gather(state):
    flat = jax.tree.leaves(state["params"])
    return jax.tree.unflatten(treedef, [lay.unpadded(x) for x, lay in zip(flat, layouts)])

  return QSDPTrainer(init, step, gather, layout, mesh)
