"""SelSync: selective synchronization (Tyagi & Sharma, arXiv 2307.07950).

Every device keeps its own parameters and optimizer state (leaves carry a leading device axis
sharded over the mesh axis) and tracks an exponentially smoothed norm of its gradient,
``ema_t = a * |g_t| + (1 - a) * ema_{t-1}`` with ``a = 2 / (window + 1)``. Its flag is up when
the relative change ``|ema_t - ema_{t-1}| / ema_{t-1}`` reaches ``delta`` (or during the
first ``warmup`` steps). One ``psum`` of a 2-vector ``[flag, share * loss]`` tells every device
whether anyone flagged; if so all synchronize inside a ``lax.cond`` branch:

* ``mode="params"`` (default): each device applies its local update, then the parameters are
  averaged (weighted by batch share);
* ``mode="grads"``: the share-weighted gradients are summed before the update.

Otherwise each device applies its local update and nothing else is sent: the only collective
of a non-sync step is that 2-float ``psum``. ``consolidate(state)`` returns the share-weighted
average of the per-device parameters (for evaluation and export).

``loss_fn(params, batch, key) -> scalar`` is the mean loss over the device's local batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qsync_jax.errors import QsyncError
from qsync_jax.ops.vma import shard_map
from qsync_jax.sync.common import AXIS, batch_shares, device_key, optimizer_init, to_varying

MODES = ("params", "grads")


@dataclasses.dataclass(frozen=True)
class SelSyncConfig:
  """``delta``: relative-change threshold; ``window``: EMA span; ``warmup``: synchronous steps."""

  delta: float = 0.3
  window: int = 25
  warmup: int = 25
  mode: str = "params"
  sync_opt_state: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise QsyncError(f"SelSync mode={self.mode!r} must be one of {MODES}.")
    if not self.delta > 0:
      raise QsyncError(f"SelSync delta={self.delta!r} must be > 0 (the paper uses 0.3).")
    if self.window < 1 or self.warmup < 0:
      raise QsyncError(f"SelSync window={self.window!r} must be >= 1 and warmup={self.warmup!r} >= 0.")


@dataclasses.dataclass(frozen=True)
class SelSyncTrainer:
  """``init(params) -> state``; ``step(state, batch, key) -> (state, metrics)``; ``consolidate``."""

  init: Callable[[Any], dict]
  step: Callable[[dict, Any, jax.Array], tuple[dict, dict]]
  consolidate: Callable[[dict], Any]
  mesh: Mesh
  config: SelSyncConfig

  def params_of(self, state: dict):
    """The model's parameters: ``consolidate(state)`` (what evaluation and export use)."""
    return self.consolidate(state)


def make_selsync_step(
  loss_fn: Callable[[Any, Any, jax.Array], jax.Array],
  optimizer: optax.GradientTransformation,
  mesh: Mesh | None = None,
  *,
  config: SelSyncConfig | None = None,
  shares: Sequence[float] | None = None,
  axis_name: str = AXIS,
  **options,
) -> SelSyncTrainer:
  """Builds SelSync's ``init`` / ``step`` / ``consolidate``; ``options`` fill a ``SelSyncConfig``.

  The global batch passed to ``step`` has a leading batch axis split evenly over the devices.
  """
  config = config or SelSyncConfig(**options)
  mesh = mesh or Mesh(np.array(jax.devices()), (axis_name,))
  n = mesh.shape[axis_name]
  share_table = jnp.asarray(batch_shares(n, shares))
  alpha = 2.0 / (config.window + 1.0)
  per_device = NamedSharding(mesh, P(axis_name))
  replicated = NamedSharding(mesh, P())

  def init(params):
    stack = lambda x: jax.device_put(jnp.broadcast_to(x, (n, *jnp.shape(x))), per_device)  # noqa: E731
    return {
      "params": jax.tree.map(stack, params),
      "opt_state": jax.tree.map(stack, optimizer_init(optimizer, params)),
      "ema": jax.device_put(jnp.zeros((n,), jnp.float32), per_device),
      "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
      "syncs": jax.device_put(jnp.zeros((), jnp.int32), replicated),
    }

  def local_step(state, batch, key):
    unstack = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
    params, opt_state, ema = unstack(state["params"]), unstack(state["opt_state"]), state["ema"][0]
    share = share_table[lax.axis_index(axis_name)]
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, device_key(key, axis_name))
    norm = optax.global_norm(grads).astype(jnp.float32)
    first = state["step"] == 0
    new_ema = jnp.where(first, norm, alpha * norm + (1.0 - alpha) * ema)
    change = jnp.abs(new_ema - ema) / jnp.maximum(ema, jnp.finfo(jnp.float32).tiny)
    flag = (state["step"] < config.warmup) | (~first & (change >= config.delta))
    # The one collective of every step: [number of flags, share-weighted loss].
    votes = lax.psum(jnp.stack([flag.astype(jnp.float32), share * loss.astype(jnp.float32)]), axis_name)
    sync = votes[0] > 0

    def average(tree):
      return to_varying(
        lax.psum(jax.tree.map(lambda x: share.astype(x.dtype) * x, tree), axis_name), axis_name
      )

    if config.mode == "grads":
      grads = lax.cond(sync, average, lambda g: g, grads)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    if config.mode == "params":
      if config.sync_opt_state:
        params, opt_state = lax.cond(
          sync, lambda t: (average(t[0]), _average_floats(t[1], average)), lambda t: t, (params, opt_state)
        )
      else:
        params = lax.cond(sync, average, lambda p: p, params)
    stack = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731
    new_state = {
      "params": stack(params),
      "opt_state": stack(opt_state),
      "ema": new_ema[None],
      "step": state["step"] + 1,
      "syncs": state["syncs"] + sync.astype(jnp.int32),
    }
    return new_state, {"loss": votes[1], "synced": sync, "flags": votes[0]}

  state_specs = {
    "params": P(axis_name),
    "opt_state": P(axis_name),
    "ema": P(axis_name),
    "step": P(),
    "syncs": P(),
  }
  mapped = shard_map(
    local_step,
    mesh=mesh,
    in_specs=(state_specs, P(axis_name), P()),
    out_specs=(state_specs, {"loss": P(), "synced": P(), "flags": P()}),
  )
  step = jax.jit(mapped)

  @jax.jit
  def consolidate(state):
    def mean(x):
      if not jnp.issubdtype(x.dtype, jnp.floating):
        return x[0]
      return jnp.tensordot(share_table.astype(x.dtype), x, axes=1)

    return jax.tree.map(mean, state["params"])

  return SelSyncTrainer(init, step, consolidate, mesh, config)


def _average_floats(tree, average):
  """``average`` applied to the float leaves of ``tree`` (integer counters are left alone)."""
  leaves, treedef = jax.tree.flatten(tree)
  idx = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
  averaged = average([leaves[i] for i in idx]) if idx else []
  for i, a in zip(idx, averaged):
    leaves[i] = a
  return jax.tree.unflatten(treedef, leaves)
