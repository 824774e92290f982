"""Measuring each device group's compute while the trainer runs (``measure_groups``, a ``Measure``).

One device's training step of a group without its collectives — forward, backward and optimizer
update at the group's policy — on one of the group's own devices, outside the training step:
nothing is added to the step itself. A size is timed as the training loop runs it, back to back
(``PROBE_ROUNDS`` rounds of ``PROBE_RUNS`` runs after one run that warms up or compiles, the
median round), so a device shared with another process is measured in the regime it trains in.
The compiled probes are kept: measuring a size again never recompiles.

``Measure`` is the one signature a measurement has (``measure_groups``'s; a test double takes the
same arguments).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import numpy as np

from qsync_jax.cluster import ClusterSpec
from qsync_jax.policy import PrecisionPolicy

PROBE_ROUNDS = 3  # timed rounds per size (the median round counts)
PROBE_RUNS = 2  # back-to-back runs per round
PROBE_COST_RUNS = 1 + PROBE_ROUNDS * PROBE_RUNS  # runs of one size in a measurement (warm-up included)


Measurements = dict[str, dict[int, float]]
"""``{group: {per-device batch: ms}}``."""


class Measure(Protocol):
  """Times each group of ``program`` (a ``TrainStep``: its ``cluster``, ``plan``, ``branches``,
  ``mesh``, ``task`` and ``optimizer``) at the per-device batches ``sizes[group]`` (a group with
  none, or not in ``sizes``, is not measured), at ``policies[group]`` where given (else the
  group's running policy), from ``state`` and the rows of ``host_batch``; every process of a job
  calls it and gets every group's times."""

  def __call__(
    self,
    program: Any,
    state: Any,
    host_batch: Any,
    sizes: Mapping[str, tuple[int, ...]],
    policies: Mapping[str, PrecisionPolicy],
  ) -> Measurements: ...


def probe_sizes(batch_per_device: int) -> tuple[int, int]:
  """The two per-device batches a group is first timed at: half its batch and its batch (1
  and 2 for a batch of 1)."""
  return (max(1, batch_per_device // 2), batch_per_device) if batch_per_device > 1 else (1, 2)


# Compiled probes, kept between measurements (and re-plans): {key: (task, optimizer, jitted step)}.
_PROBES: dict = {}
_PROBES_KEPT = 16
_COMPILE_S = [0.0]  # seconds measure_groups has spent compiling probes, in this process


def compile_seconds() -> float:
  """Seconds ``measure_groups`` has spent compiling probes in this process (a batch size it had
  not run before, once per size and policy)."""
  return _COMPILE_S[0]


def _probe(task, optimizer, policy, cache: dict):
  """The jitted one-device step of ``policy`` (made once per task, optimizer and policy)."""
  key = (id(task), id(optimizer), json.dumps(policy.to_json(), sort_keys=True))
  kept = cache.get(key)
  if kept is not None and kept[0] is task and kept[1] is optimizer:
    return kept[2]
  import optax

  from qsync_jax.train.task_step import task_loss

  loss = task_loss(task, policy)

  def one_step(v, o, batch, key):
    grads = jax.grad(lambda p: loss({**v, "params": p}, batch, key)[0])(v["params"])
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
      updates, o = optimizer.update(grads, o, v["params"])
      return optax.apply_updates(v["params"], updates), o

  fn = jax.jit(one_step)
  while len(cache) >= _PROBES_KEPT:
    cache.pop(next(iter(cache)))
  cache[key] = (task, optimizer, fn)
  return fn


def measure_groups(
  program,
  state,
  host_batch,
  sizes: Mapping[str, tuple[int, ...]] | None = None,
  policies: Mapping[str, PrecisionPolicy] | None = None,
  *,
  cache: dict | None = None,
) -> Measurements:
  """``{group: {per-device batch: ms}}``: one device's training step of each group without its
  collectives — the forward and backward of the group's policy (``policies[group]`` where
  given) and the optimizer update — on one of the group's devices (of this process), at
  ``sizes[group]`` (default ``probe_sizes`` of its batch), on the first rows of
  ``host_batch``: ``PROBE_ROUNDS`` rounds of ``PROBE_RUNS``
  back-to-back runs after one that warms up (and compiles, the first time: the jitted probes
  stay in ``cache``), the median round's time per run. In a multi-process job every process
  measures its own groups and all get every group's numbers."""
  cluster, task, optimizer = program.cluster, program.task, program.optimizer
  if sizes is None:
    sizes = {g.name: probe_sizes(g.batch_per_device) for g in cluster.groups}
  cache = _PROBES if cache is None else cache
  variables = {"params": state.params, **state.model_state}
  opt_state = program.full_state(state).opt_state  # a sharded update's, gathered
  groups_devices = _first_local_device(program)
  out: dict[str, dict[int, float]] = {}
  for branch in program.branches:
    for name in branch.groups:
      device = groups_devices.get(name)
      if device is None or not sizes.get(name):
        continue
      timed = _probe(task, optimizer, (policies or {}).get(name, branch.policy), cache)
      local = jax.device_put(jax.tree.map(_local_copy, variables), device)
      local_opt = jax.device_put(jax.tree.map(_local_copy, opt_state), device)
      key = jax.device_put(jax.random.key(0), device)
      out[name] = {}
      for b in sizes[name]:
        rows = jax.device_put(jax.tree.map(lambda x, b=b: np.asarray(x)[:b], host_batch), device)
        compiled = _cache_size(timed)
        t0 = time.perf_counter()
        jax.block_until_ready(timed(local, local_opt, rows, key))
        warm = 1e3 * (time.perf_counter() - t0)
        rounds = []
        for _ in range(PROBE_ROUNDS):
          t0 = time.perf_counter()
          for _ in range(PROBE_RUNS):  # queued back to back, as training steps are
            result = timed(local, local_opt, rows, key)
          jax.block_until_ready(result)
          rounds.append(1e3 * (time.perf_counter() - t0) / PROBE_RUNS)
        out[name][b] = statistics.median(rounds)
        if _cache_size(timed) != compiled or (compiled is None and warm > 5 * out[name][b]):
          _COMPILE_S[0] += max(0.0, warm - out[name][b]) / 1e3
  return _gather(out, cluster, sizes)


def _cache_size(fn) -> int | None:
  """How many compiled versions the jitted ``fn`` holds (None where JAX does not say)."""
  size = getattr(fn, "_cache_size", None)
  return size() if callable(size) else None


def _local_copy(x):
  """This process's copy of a replicated array (the value itself for a host array)."""
  shards = getattr(x, "addressable_shards", None)
  return shards[0].data if shards else x


def _first_local_device(program) -> dict[str, object]:
  """``{group: one of its devices that this process drives}``."""
  names = [program.cluster.groups[i].name for i in program.cluster.device_group_indices()]
  out = {}
  for name, device in zip(names, program.mesh.devices.flat):
    if device.process_index == jax.process_index():
      out.setdefault(name, device)
  return out


def _gather(
  measured: dict[str, dict[int, float]], cluster: ClusterSpec, sizes
) -> dict[str, dict[int, float]]:
  """Every process's measurements, on every process (the first measurement of each group)."""
  if jax.process_count() == 1:
    return measured
  from jax.experimental import multihost_utils

  names = [g for g in cluster.group_names if sizes.get(g)]
  width = max((len(sizes[g]) for g in names), default=0)
  table = np.full((len(names), width), np.nan)
  for i, g in enumerate(names):
    for j, b in enumerate(sizes[g]):
      table[i, j] = measured.get(g, {}).get(b, np.nan)
  every = np.asarray(multihost_utils.process_allgather(table))  # [processes, groups, sizes]
  out = {}
  for i, g in enumerate(names):
    n = len(sizes[g])
    rows = [r for r in every[:, i, :n] if not np.isnan(r).any()]
    if rows:
      out[g] = {b: float(rows[0][j]) for j, b in enumerate(sizes[g])}
  return out
