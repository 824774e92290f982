"""Balancing the batch from measured speeds: online calibration and re-planning.

A plan's per-device batches come from modeled costs. While the trainer runs, each group's
compute is measured (``measure_groups``: one device's step of the group without collectives —
forward, backward and optimizer update at its policy — on one of its own devices, at two
per-device batches, timed after a warm-up; nothing is added to the training step itself). Each group's time is fitted as ``ms(b) = intercept + slope · b``
(``GroupSpeed``) and ``balance`` splits the same global batch so that the slowest group finishes
first: ``min over batches of max_g ms_g(b_g)`` with ``Σ_g count_g · b_g = global batch``.

``Replanner`` decides when that split replaces the running one:

* ``mode="once"``: measure after the first ``warmup_steps`` steps; re-plan if the balanced
  split's predicted step is at least ``threshold`` shorter than the running split's, as both
  are predicted from the same measurements.
* ``mode="auto"``: as ``once``, then watch the step time (median over windows of
  ``window`` steps); when it moves by more than ``threshold`` from what it was after the last
  decision, or every ``recheck_windows`` windows (a group that gets faster does not shorten the
  step while another group is the slowest), measure again and re-plan by the same rule. A
  re-plan needs a predicted gain of ``threshold`` and at least ``window`` steps since the last
  one, so noisy timings cannot make it oscillate.
* ``mode="off"``: never.

Every group keeps at least ``granularity`` examples per device (a group is not dropped: the
devices and their state stay as they are). The precisions of the plan are kept.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import QsyncError

MODES = ("off", "once", "auto")


@dataclasses.dataclass(frozen=True)
class GroupSpeed:
  """A group's measured compute per step as ``intercept_ms + slope_ms · batch_per_device``."""

  intercept_ms: float
  slope_ms: float

  def ms(self, batch_per_device: int) -> float:
    return self.intercept_ms + self.slope_ms * batch_per_device

  @classmethod
  def fit(cls, ms_at: Mapping[int, float]) -> GroupSpeed:
    """The line through the measured ``{batch: ms}`` (least squares; one point: through 0)."""
    sizes = sorted(ms_at)
    if len(sizes) == 1:
      return cls(0.0, ms_at[sizes[0]] / sizes[0])
    x, y = np.asarray(sizes, float), np.asarray([ms_at[b] for b in sizes], float)
    slope, intercept = np.polyfit(x, y, 1)
    slope = max(float(slope), 1e-9)  # more examples never take less time
    intercept = max(float(intercept), 0.0)
    return cls(intercept, slope)


def balance(
  counts: Mapping[str, int], speeds: Mapping[str, GroupSpeed], global_batch: int, granularity: int = 1
) -> dict[str, int]:
  """Per-device batch of each group (multiples of ``granularity``, at least one multiple each)
  with ``Σ counts[g] · b[g] == global_batch`` that minimizes ``max_g speeds[g].ms(b[g])``.
  ``QsyncError`` when no such split exists.

  Exact: the least step time ``T`` (among the groups' times at each batch) for which batches
  with ``ms_g(b_g) <= T`` can add up to the global batch (a subset sum over the groups, as bit
  sets), then one such split."""
  names = list(counts)
  units = global_batch // granularity if global_batch % granularity == 0 else -1
  top = {g: units // counts[g] for g in names} if units > 0 else {}
  times = sorted({speeds[g].ms(k * granularity) for g in names for k in range(1, top.get(g, 0) + 1)})
  split = None
  lo, hi = 0, len(times) - 1
  while lo <= hi:  # the least feasible time: feasibility only grows with the time allowed
    mid = (lo + hi) // 2
    found = _split_within(names, counts, speeds, units, granularity, times[mid])
    if found is None:
      lo = mid + 1
    else:
      split, hi = found, mid - 1
  if split is None:
    raise QsyncError(
      f"the global batch {global_batch} cannot be split over groups {dict(counts)} in multiples of "
      f"{granularity} per device, at least one each. Fix: choose a global batch that these device "
      "counts can add up to, or another granularity."
    )
  return {g: k * granularity for g, k in split.items()}


def _split_within(names, counts, speeds, units, granularity, limit) -> dict[str, int] | None:
  """Per-device batches (in units of ``granularity``) adding up to ``units`` with every group's
  time at most ``limit``; None if there are none."""
  allowed = {g: [k for k in range(1, units // counts[g] + 1) if speeds[g].ms(k * granularity) <= limit] for g in names}
  reach = [1]  # reach[i]: bit s set when the first i groups can take s units
  for g in names:
    mask = 0
    for k in allowed[g]:
      mask |= reach[-1] << (counts[g] * k)
    reach.append(mask & ((1 << (units + 1)) - 1))
  if not (reach[-1] >> units) & 1:
    return None
  out, left = {}, units
  for i in range(len(names) - 1, -1, -1):  # walk back, the largest batch that still fits first
    g = names[i]
    k = next(k for k in reversed(allowed[g]) if left >= counts[g] * k and (reach[i] >> (left - counts[g] * k)) & 1)
    out[g], left = k, left - counts[g] * k
  return {g: out[g] for g in names}


def predicted_ms(speeds: Mapping[str, GroupSpeed], batches: Mapping[str, int]) -> float:
  """The synchronous step's compute: the slowest group's."""
  return max(speeds[g].ms(b) for g, b in batches.items())


def probe_sizes(batch_per_device: int) -> tuple[int, int]:
  """The two per-device batches a group is timed at: half its batch and its batch (1 and 2 for
  a batch of 1)."""
  return (max(1, batch_per_device // 2), batch_per_device) if batch_per_device > 1 else (1, 2)


def measure_groups(program, state, host_batch, repeats: int = 5) -> dict[str, dict[int, float]]:
  """``{group: {per-device batch: ms}}``: one device's training step of each group without its
  collectives — the forward and backward of the group's policy and the optimizer update — on
  one of the group's devices (of this process), at ``probe_sizes`` of its batch, on the first
  rows of ``host_batch``, median of ``repeats`` runs after one that compiles. In a
  multi-process job every process measures its own groups and all get every group's numbers."""
  import optax

  from qsync_jax.train.task_step import task_loss

  cluster, task, optimizer = program.cluster, program.task, program.optimizer
  variables = {"params": state.params, **state.model_state}
  opt_state = state.opt_state
  groups_devices = _first_local_device(program)
  out: dict[str, dict[int, float]] = {}
  for branch in program.branches:
    loss = task_loss(task, branch.policy)

    def one_step(v, o, batch, key, loss=loss):
      grads = jax.grad(lambda p: loss({**v, "params": p}, batch, key)[0])(v["params"])
      with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
        updates, o = optimizer.update(grads, o, v["params"])
        return optax.apply_updates(v["params"], updates), o

    for name in branch.groups:
      device = groups_devices.get(name)
      if device is None:
        continue
      local = jax.device_put(jax.tree.map(_local_copy, variables), device)
      local_opt = jax.device_put(jax.tree.map(_local_copy, opt_state), device)
      key = jax.device_put(jax.random.key(0), device)
      timed = jax.jit(one_step)
      out[name] = {}
      for b in probe_sizes(cluster.group(name).batch_per_device):
        rows = jax.device_put(jax.tree.map(lambda x, b=b: np.asarray(x)[:b], host_batch), device)
        jax.block_until_ready(timed(local, local_opt, rows, key))
        times = []
        for _ in range(repeats):
          t0 = time.perf_counter()
          jax.block_until_ready(timed(local, local_opt, rows, key))
          times.append(1e3 * (time.perf_counter() - t0))
        out[name][b] = statistics.median(times)
  return _gather(out, cluster)


def any_process(flag: bool) -> bool:
  """Whether ``flag`` is true on any process of the job (every process must call it)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))


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


def _gather(measured: dict[str, dict[int, float]], cluster: ClusterSpec) -> dict[str, dict[int, float]]:
  """Every process's measurements, on every process (the first measurement of each group)."""
  if jax.process_count() == 1:
    return measured
  from jax.experimental import multihost_utils

  names = cluster.group_names
  sizes = {g: probe_sizes(cluster.group(g).batch_per_device) for g in names}
  table = np.full((len(names), 2), np.nan)
  for i, g in enumerate(names):
    for j, b in enumerate(sizes[g]):
      table[i, j] = measured.get(g, {}).get(b, np.nan)
  every = np.asarray(multihost_utils.process_allgather(table))  # [processes, groups, 2]
  out = {}
  for i, g in enumerate(names):
    rows = [r for r in every[:, i] if not np.isnan(r).any()]
    if rows:
      out[g] = {b: float(rows[0][j]) for j, b in enumerate(sizes[g])}
  return out


@dataclasses.dataclass
class Replanner:
  """When to re-plan (see the module docstring). ``measure(program, state, host_batch)`` gives
  ``{group: {batch: ms}}`` (default ``measure_groups``; tests inject their own)."""

  mode: str = "once"
  threshold: float = 0.05
  warmup_steps: int = 3
  window: int = 20
  recheck_windows: int = 10
  granularity: int = 1
  measure: Callable = measure_groups
  history: list = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.mode not in MODES:
      raise QsyncError(f"replan mode {self.mode!r} is not one of {MODES}. Fix: pass off, once or auto.")
    if not 0 < self.threshold < 1:
      raise QsyncError(f"replan threshold {self.threshold!r} must be in (0, 1). Fix: e.g. 0.05.")
    self._last_decision_step = None
    self._reference_ms = None
    self._window: list[float] = []
    self._windows = 0

  def wants_measurement(self, step: int, start_step: int, step_ms: float | None) -> bool:
    """Whether to measure the groups after ``step`` (``step_ms``: the wall time of the step
    just taken, or None when it was not timed)."""
    if self.mode == "off":
      return False
    if self._last_decision_step is None:
      return step >= start_step + self.warmup_steps and not (self.mode == "once" and self.history)
    if self.mode != "auto" or step_ms is None:
      return False
    self._window.append(step_ms)
    if len(self._window) < self.window:
      return False
    median, self._window = statistics.median(self._window), []
    self._windows += 1
    if self._reference_ms is None:
      self._reference_ms = median
      return False
    moved = abs(median - self._reference_ms) / self._reference_ms > self.threshold
    # Each process times its own steps: they decide together (a window ends at the same step
    # everywhere), or one would measure, a collective, while the others train on.
    return any_process(moved) or self._windows >= self.recheck_windows

  def decide(self, step: int, cluster: ClusterSpec, measured: Mapping[str, Mapping[int, float]]):
    """``(new per-device batches or None, record)`` from the measurements: the balanced split
    when it is predicted ``threshold`` faster than the running one."""
    running = {g.name: g.batch_per_device for g in cluster.groups}
    speeds = {g: GroupSpeed.fit(measured[g]) for g in running}
    counts = {g.name: g.count for g in cluster.groups}
    balanced = balance(counts, speeds, cluster.global_batch, self.granularity)
    before, after = predicted_ms(speeds, running), predicted_ms(speeds, balanced)
    self._last_decision_step, self._reference_ms, self._window, self._windows = step, None, [], 0
    record = {
      "step": step,
      "ms_per_example": {g: round(s.slope_ms, 4) for g, s in speeds.items()},
      "old": running,
      "new": balanced,
      "predicted_ms_old": round(before, 3),
      "predicted_ms_new": round(after, 3),
    }
    if balanced == running or after > before * (1 - self.threshold):
      return None, {**record, "replanned": False}
    record = {**record, "replanned": True}
    self.history.append(record)
    return balanced, record


def describe(record: Mapping) -> str:
  """One log line for a decision ``record`` of ``Replanner.decide``."""
  speeds = ", ".join(f"{g} {ms:.3g}" for g, ms in record["ms_per_example"].items())
  split = "/".join(str(b) for b in record["old"].values())
  new = "/".join(str(b) for b in record["new"].values())
  verdict = "re-planned" if record["replanned"] else "kept the plan"
  return (
    f"step {record['step']}: measured ms per example {speeds}; split {split} -> {new} "
    f"(predicted {record['predicted_ms_old']:.3g} -> {record['predicted_ms_new']:.3g} ms): {verdict}"
  )
