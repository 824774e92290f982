"""The accuracy cost of a gradient sync's payload, measured like Ω on the indicator's batches.

A gradient sync other than fp32 hands the optimizer another combined gradient than the fp32 sum
(``qsync_jax.sync``; the trainer's defaults, no error feedback in any):

* ``bf16`` / ``fp16``: every device's share-weighted gradient rounded to nearest in the payload
  dtype, the devices' values summed in fp32, the sum rounded to nearest again;
* ``global_qsgd``: every leaf dithered to integers in ``[-L, L]``, ``L = floor(127 / n)`` among
  ``n ≤ 127`` devices, by unbiased stochastic rounding against one scale per leaf that the devices
  share (a ``pmax`` of their maxima), the integers summed and scaled back.

``measure_payload`` runs the trainer's own sync functions (``qsync_jax.sync.make_grad_sync``, what
``qsync train --sync`` builds) on the fp32 gradients of the indicator's batches, ``n`` devices
simulated by ``jax.vmap`` over the sync's mesh axis (its collectives run over the mapped axis,
with the values ``shard_map`` gives them). Of ``N`` batches, window ``k`` gives device ``i`` the
gradient of batch ``(k + i) mod N`` weighted ``1/n`` (equal shares: the trainer hands the sync
``b_i / B · g_i``) and the sync the key ``fold_in(key, k)``; ``n ≤ N``, so no two devices of a
window hold one batch. The parameters are measured one top-level module at a time
(``module_groups``, at most ``MAX_LEAVES`` leaves each: every sync rounds, and Global-QSGD scales,
each leaf on its own, so the figures add over leaves; chunk ``c`` draws its dithers from ``fold_in(window key, c)``): a
window holds ``n`` copies of a chunk's gradient, not of the model's, and chunks of one shape (a
transformer's blocks) share one compiled program. Over the ``N`` windows, with ``δ = g_sync − g_fp32`` (``g_fp32``: the
fp32 sync's sum of the same values), it records

* ``error2``: ``E‖δ‖²``, the gradient-error variance against fp32 (``gradient2``: ``‖ḡ‖²``);
* ``omega``: the expected squared loss change of the update that error makes, on the scale of
  the gradient indicator's Ω (``E[ΔL²]``, ``planners.indicator.gradient``)::

    Ω_payload = E[(η Σ_j ḡ_j δ_j / (√v_j + ε))²]  ≈  η² Σ_j (ḡ_j / (√v_j + ε))² · E[δ_j²]

  Assumptions: the trainer's default optimizer, ``optax.adam(η = 1e-3)`` (``ε = 1e-8``): an
  error ``δ`` enters Adam's first moment and, over the steps that follow, moves parameter ``j`` by
  ``η δ_j / (√v_j + ε)`` in all (β1's weights sum to 1; the second moment hardly moves); ``v_j``
  is the mean square of the batches' gradients (Adam's second moment at the indicator's batch
  size); the loss changes to first order along ``ḡ``, the mean of the batches' gradients (the
  expected loss's gradient, as Ω judges an op on the expected loss change); and the errors of
  different elements are uncorrelated with mean 0, so the square of the sum is the sum of the
  squares (for stochastic rounding exactly, given the scales; for nearest rounding the errors of
  different elements are deterministic but as good as uncorrelated), which keeps the estimate's
  noise that of an average over the elements. It scales with ``η²``: at another learning rate,
  multiply by ``(lr / 1e-3)²``.

``payload_omega(section, sync, n)`` reads the figure back (``fp32``: 0, the reference), or None
where the indicator did not measure it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from qsync_jax.errors import QsyncError
from qsync_jax.sync import STRATEGIES

PAYLOAD_SYNCS = tuple(name for name, s in STRATEGIES.items() if s.kind == "grad_sync" and name != "fp32")
"""The syncs whose payload is measured: the trainer's gradient hooks other than fp32 (the reference)."""
DEFAULT_DEVICES = (2, 4, 8)
"""The device counts ``qsync indicator`` measures at (those up to its number of batches)."""
ADAM_LR, ADAM_EPS = 1e-3, 1e-8
"""The trainer's default optimizer, ``optax.adam(1e-3)`` (its ``eps`` 1e-8): ``omega``'s update."""


def batch_gradients(task, variables, batches: Sequence[Any], seed: int = 0) -> list[list[jax.Array]]:
  """The fp32 gradient leaves (``jax.tree.leaves`` of the params) of the task's training loss on
  each of ``batches``, batch ``i`` with the key ``fold_in(key(seed), i)`` (dropout…)."""
  from qsync_jax.policy import PrecisionPolicy
  from qsync_jax.train.task_step import task_loss

  loss_fn = task_loss(task, PrecisionPolicy.uniform("fp32"))
  params = variables["params"]

  def loss(p, batch, key):
    return loss_fn({**variables, "params": p}, batch, key)[0]

  grad = jax.jit(jax.grad(loss))
  key = jax.random.key(seed)
  return [jax.tree.leaves(grad(params, b, jax.random.fold_in(key, i))) for i, b in enumerate(batches)]


def synced(sync: str, weighted: Sequence[jax.Array], key) -> list[jax.Array]:
  """The combined gradient (leaves) the trainer's ``sync`` (``make_grad_sync(sync)``) hands the
  optimizer on every device when device ``i`` holds the share-weighted leaves ``weighted[j][i]``:
  the devices simulated by ``jax.vmap`` over the sync's mesh axis, the sync's key ``key`` (the
  same on every device, as the trainer's); device 0's result, which every device holds."""
  from qsync_jax.sync import make_grad_sync
  from qsync_jax.sync.common import AXIS

  built = make_grad_sync(sync)
  state = built.init(None)  # every built-in sync's state is its step count

  def on_device(leaves):
    return built.sync(list(leaves), state, key)[0]

  return [x[0] for x in jax.vmap(on_device, axis_name=AXIS)(list(weighted))]


MAX_LEAVES = 16
"""The most parameter leaves ``measure_payload`` measures in one program (``module_groups``): a
window's program rounds every leaf of its group for each sync, and XLA:GPU's compile of one
program holding a whole model's leaves (144 of BERT-base's, Global-QSGD's random bits for each) ran
for minutes."""


def module_groups(params, max_leaves: int = MAX_LEAVES) -> list[list[int]]:
  """The positions in ``jax.tree.leaves(params)`` measured together: each top-level module (a leaf's
  first path key) on its own; a module of more than ``max_leaves`` leaves split by its next path
  key, and so on. Modules of one shape (a transformer's blocks) give groups of one shape, which
  share one compiled program."""
  leaves = [(i, path) for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])]

  def split(members, depth):
    if (depth and len(members) <= max_leaves) or all(len(path) <= depth for _, path in members):
      return [[i for i, _ in members]]
    by_key: dict[str, list] = {}
    for i, path in members:
      by_key.setdefault(str(path[depth]) if len(path) > depth else "", []).append((i, path))
    return [group for sub in by_key.values() for group in split(sub, depth + 1)]

  return split(leaves, 0)


@functools.lru_cache(maxsize=64)
def _windows_program(n: int, count: int, syncs: tuple[str, ...]):
  """The jitted ``window_errors`` of ``n`` devices over ``count`` batches: one per arguments, so
  leaves of the same shapes (modules of one shape) reuse its compiled program."""

  def window(stacked, weights, k, window_key):
    rows = (k + jnp.arange(n)) % count
    weighted = [x[rows] / n for x in stacked]
    exact = synced("fp32", weighted, window_key)
    out = []
    for sync in syncs:
      delta = [a - b for a, b in zip(synced(sync, weighted, window_key), exact)]
      error2 = sum(jnp.sum(jnp.square(d)) for d in delta)
      out.append(jnp.stack([error2, sum(jnp.sum(w * jnp.square(d)) for w, d in zip(weights, delta))]))
    return jnp.stack(out)

  def windows(stacked, weights, keys):
    return jax.lax.map(lambda a: window(stacked, weights, *a), (jnp.arange(count), keys))

  return jax.jit(windows)


def window_errors(
  stacked: Sequence[jax.Array],
  weights: Sequence[jax.Array],
  n: int,
  key,
  syncs: Sequence[str] = PAYLOAD_SYNCS,
) -> jax.Array:
  """``[N, len(syncs), 2]``: for each of the ``N`` windows of ``n`` devices over ``stacked`` (each
  leaf ``[N, ...]``: the batches' gradients) and each of ``syncs``, ``(‖δ‖², Σ_j weights_j δ_j²)``,
  ``δ`` the sync's combined gradient less the fp32 sync's (module docstring)."""
  count = stacked[0].shape[0]
  if not 1 <= n <= count:
    raise QsyncError(f"payload measurement at {n} devices needs 1 ≤ n ≤ {count} (the batches).")
  keys = jax.vmap(lambda k: jax.random.fold_in(key, k))(jnp.arange(count))
  return _windows_program(n, count, tuple(syncs))(list(stacked), list(weights), keys)


def measure_payload(
  task,
  variables,
  batches: Sequence[Any],
  devices: Sequence[int] = DEFAULT_DEVICES,
  seed: int = 0,
  on_count: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
  """The indicator table's ``payload`` section: ``error2`` and ``omega`` (module docstring) of each
  of ``PAYLOAD_SYNCS`` at each of ``devices`` device counts (each at most ``len(batches)``), from
  the gradients of ``batches`` at ``variables`` (all held at once: ``len(batches)`` × the
  parameters' fp32 bytes, and a window's ``n`` × a chunk's: ``module_groups``)::

    {"syncs": {"bf16": {"4": {"error2": …, "omega": …}, …}, …}, "devices": [2, 4],
     "gradient2": ‖ḡ‖², "batches": N, "optimizer": "adam", "lr": 1e-3, "eps": 1e-8}

  The counts are measured in the order ``devices`` gives them; ``on_count``, where given, receives
  the section of the counts measured so far after each (a caller that writes it keeps them if the
  run is cut short). A count's figures do not depend on the others'.
  """
  grads = batch_gradients(task, variables, batches, seed)
  stacked = [jnp.stack(leaf) for leaf in zip(*grads)]
  del grads  # the stacked copies alone from here
  groups = module_groups(variables["params"])
  means = [x.mean(0) for x in stacked]
  weights = [
    jnp.square(ADAM_LR * m / (jnp.sqrt(jnp.mean(jnp.square(x), 0)) + ADAM_EPS))
    for m, x in zip(means, stacked)
  ]
  key = jax.random.key(seed)
  syncs: dict[str, dict[str, dict[str, float]]] = {s: {} for s in PAYLOAD_SYNCS}
  measured: list[int] = []
  gradient2 = float(sum(jnp.sum(jnp.square(m)) for m in means))

  def section() -> dict[str, Any]:
    return {
      "syncs": {s: {str(n): by_n[str(n)] for n in sorted(measured)} for s, by_n in syncs.items()},
      "devices": sorted(measured),
      "gradient2": gradient2,
      "batches": len(batches),
      "optimizer": "adam",
      "lr": ADAM_LR,
      "eps": ADAM_EPS,
    }

  for n in dict.fromkeys(devices):
    key_n = jax.random.fold_in(key, n)
    mean = 0.0
    for c, group in enumerate(groups):
      leaves, leaf_weights = [stacked[i] for i in group], [weights[i] for i in group]
      mean = mean + window_errors(leaves, leaf_weights, n, jax.random.fold_in(key_n, c)).mean(0)
    mean = jax.device_get(mean)
    for s, (error2, omega) in zip(PAYLOAD_SYNCS, mean):
      syncs[s][str(n)] = {"error2": float(error2), "omega": float(omega)}
    measured.append(n)
    if on_count is not None:
      on_count(section())
  return section()


def payload_omega(section: Mapping[str, Any] | None, sync: str, n: int) -> float | None:
  """The payload's Ω of ``sync`` among ``n`` devices in an indicator's ``payload`` ``section``:
  0 for ``fp32`` (the reference); None where ``section`` is None or holds no figure for them."""
  if sync == "fp32":
    return 0.0
  if section is None:
    return None
  figure = section.get("syncs", {}).get(sync, {}).get(str(n))
  return None if figure is None else float(figure["omega"])


def check_payload(section: Any, source: str) -> None:
  """``QsyncError`` naming ``source`` unless ``section`` (an indicator's ``payload``) maps each
  sync to ``{devices: {"error2", "omega"}}`` of finite numbers at least 0."""
  bad = []
  syncs = section.get("syncs") if isinstance(section, Mapping) else None
  if not isinstance(syncs, Mapping):
    bad.append("no 'syncs' table")
  for sync, by_n in (syncs or {}).items():
    for n, figure in by_n.items() if isinstance(by_n, Mapping) else [("?", by_n)]:
      values = [figure.get(k) for k in ("error2", "omega")] if isinstance(figure, Mapping) else [None]
      ok = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        for v in values
      )
      if not ok or not str(n).isdigit():
        bad.append(f"{sync}[{n}]={figure!r}")
  if bad:
    raise QsyncError(
      f"indicator table {source!r}: its payload section is not one `qsync indicator` writes ({', '.join(bad[:3])}). "
      "Fix: run `qsync indicator` again, or drop the table's 'payload' key (the plan then says the payload's "
      "accuracy cost is not measured)."
    )


__all__ = [
  "ADAM_EPS",
  "ADAM_LR",
  "MAX_LEAVES",
  "DEFAULT_DEVICES",
  "PAYLOAD_SYNCS",
  "batch_gradients",
  "check_payload",
  "measure_payload",
  "module_groups",
  "payload_omega",
  "synced",
  "window_errors",
]
