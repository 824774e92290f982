"""Balancing the batch from measured speeds: when to measure and re-plan (``Replanner``).

A plan's per-device batches come from modeled costs. While the trainer runs, each group's
compute is measured (``measure.measure_groups``: one device's step of the group without
collectives, outside the training step) and each group's time is a ``group_speed.GroupSpeed``
through those points; ``decide.decide`` (pure) balances the same global batch so that the slowest
group finishes first and says whether that split replaces the running one. A decision
first measures each group at two batches (half its batch and its batch), balances, then
measures each group at the batch the balance gave it (``refine`` rounds at most), so that the
split it picks is predicted from measurements at that split, not extrapolated from other
batches (a device time-sliced with another process is far from linear at small batches).

``Replanner`` decides when to measure and keeps what decisions need between them (the last
measurements, the undone re-plans, the ``history``). Steps are timed as the wall time between two
steps' completions, read one step behind (``window.StepTimer``: the device always has the next
step queued, no host sync is added), the first ``warmup_steps`` steps of a run (or of a resumed
run) left out (they compile), in windows of ``window`` steps (``window.StepWindows``); a window's
median is *the measured step* (in a multi-process job, process 0's, so that every process decides
alike).

The trainer's side (``Trainer.run``'s re-planning hook) is three calls: ``times_steps()`` (whether
to time the step), ``observe(step, start_step, step_ms)`` (whether to measure now, and the events
of re-plans measured since), ``replan_event(step, program, state, host_batch)`` (measure, decide,
the event); an event (``events.ReplanEvent``) carries its log line, its ``metrics.jsonl`` record
and the split to switch to. A checkpoint stores ``history``; ``restore(history)`` takes it up.

* ``mode="once"``: after ``warmup_steps`` untimed steps and one timed window of the running
  split (its measured step, ``measured_ms_old``), measure and decide: re-plan if the balanced
  split's predicted step is at least ``threshold`` shorter than the running split's, as both
  are predicted from the same measurements. The first full window after the switch (the steps
  that compile the new split left out) is the new split's measured step (``measured_ms_new``).
* ``mode="auto"``: as ``once``, then time every step in windows. A *check* measures each group
  at its running batch only (the probes are compiled): when one of them moved by more than
  ``threshold`` from its last measurement (and a second measurement of it agrees), a full
  decision follows. A check runs when the step time's window median moved by more than
  ``threshold`` from its reference (the first window after the last decision) in two windows in
  a row, or every ``recheck_windows`` windows (a group that gets faster does not shorten the
  step while another group is the slowest, so only a check finds it); and only once the
  training time since the last check or decision is at least the time that one took over
  ``max_overhead`` (compiling aside: a probe compiles once per batch size, the step once per
  split; the first decision, which ``once`` pays too, costs nothing here). A re-plan needs a
  predicted gain of ``threshold``; noisy timings cannot make it oscillate.
* **Undo** (both modes): a re-plan is *undone* when its measured step is not shorter than the
  measured step before it, ``measured_ms_new >= measured_ms_old`` (both rounded to 1 µs; no
  margin: the re-plan was predicted ``threshold`` faster, and a measured step that shows no gain
  at all says the prediction was wrong). The trainer switches back to the split that ran before
  (its step is kept: nothing compiles; the same global batches in the same order) and an
  ``undone`` record joins ``history``. The undone split is not chosen again while the groups'
  speeds stay as they were: a later decision whose balanced split is that split keeps the
  running one, unless some group's predicted time at that split's batch, from the new
  measurements, differs by more than ``threshold`` from its time from the measurements of the
  undone re-plan (then the block is lifted). So a split can be undone again only after the
  speeds moved by ``threshold``: noise cannot make re-plans and undos alternate.
* ``mode="off"``: never.

**Precision lift.** A full decision also measures each group whose policy runs some legs in 8
bits (int8, fp8) at its *lifted* policy (``lifted_policy``: those legs at the 16-bit precision
of the policy's other ops), at the batches its running policy was just measured at. A group
whose lifted policy is measured at least ``threshold`` faster at every one of them is predicted
at its lifted policy (its further measurements too), and a re-plan switches it to that policy
(``lifted`` in the record: each such group's old and new policy and its measurements). The lift
only ever raises precisions, so it can only improve accuracy; it needs the same predicted gain
as any re-plan, it is undone with the split, and a lifted group is never lowered again.

Every group keeps at least ``granularity`` examples per device (a group is not dropped: the
devices and their state stay as they are). Precisions change only by a lift.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import QsyncError
from qsync_jax.train.replan.decide import Running, Undone, decide
from qsync_jax.train.replan.events import ReplanEvent, decision_event, measured_event
from qsync_jax.train.replan.group_probes import (
  Measure,
  Measurements,
  compile_seconds,
  measure_groups,
  probe_sizes,
)
from qsync_jax.train.replan.group_speed import GroupSpeed, balance, predicted_ms
from qsync_jax.train.replan.lift import Lift, lifted_policy
from qsync_jax.train.replan.window import StepWindows, any_process

MODES = ("off", "once", "auto")


@dataclasses.dataclass
class Replanner:
  """When to re-plan (see the module docstring).

  ``measure``: a ``Measure`` (default ``measure_groups``; tests inject their own, with the same
  signature). ``report(record)``, if given, is called on every process with every decision record
  as it is taken, with ``{"step", "measured_after_replan"}`` once a re-planned split's step is
  timed (``"undone": True`` in it when the re-plan is undone), and with ``{"step", "checked"}``
  for a check that changed nothing. ``clock``: seconds, for the cost of measuring (tests inject
  their own).

  ``history``: every change of split (and policies), in order — a decision record that
  re-planned (``"replanned": True``, ``"old"`` and ``"new"`` split, ``"lifted"`` policies,
  ``measured_ms_new`` once timed), and an undo record ``{"step", "undone": <step of the
  re-plan>, "old", "new", "measured_ms_old", "measured_ms_new"}`` (``new``: the split it went
  back to). ``restore(history)`` takes up a checkpoint's."""

  mode: str = "once"
  threshold: float = 0.05
  warmup_steps: int = 3
  window: int = 20
  recheck_windows: int = 10
  granularity: int = 1
  refine: int = 3
  max_overhead: float = 0.05
  measure: Measure = measure_groups
  report: Callable | None = None
  clock: Callable[[], float] = time.perf_counter
  history: list = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.mode not in MODES:
      raise QsyncError(f"replan mode {self.mode!r} is not one of {MODES}. Fix: pass off, once or auto.")
    if not 0 < self.threshold < 1:
      raise QsyncError(f"replan threshold {self.threshold!r} must be in (0, 1). Fix: e.g. 0.05.")
    if not 0 < self.max_overhead <= 1:
      raise QsyncError(f"replan max_overhead {self.max_overhead!r} must be in (0, 1]. Fix: e.g. 0.05.")
    self._last_decision_step = None
    self._windows = StepWindows(self.window)
    self._reset_windows()
    self._points: Measurements = {}  # each group's last full measurement
    self._sizes_seen: dict[str, set[int]] = {}
    self._debt_ms = 0.0  # what the last measurement cost, compiling aside (the first: nothing)
    self._awaiting = None  # a re-plan's record, until the step it made is timed
    self._notes: list[dict] = []
    self._last_median = None
    self._undone: tuple[Undone, ...] = ()

  # -- the trainer's side ---------------------------------------------------------------------
  def observe(self, step: int, start_step: int, step_ms: float | None) -> tuple[bool, list[ReplanEvent]]:
    """``(whether to measure after step, the events of re-planned splits measured since the last
    call)``: ``wants_measurement`` and ``take_notes``; every process must call it at every step."""
    wants = self.wants_measurement(step, start_step, step_ms)
    return wants, [measured_event(note) for note in self.take_notes()]

  def replan_event(self, step: int, program, state, host_batch) -> ReplanEvent | None:
    """Measures and decides after ``step`` (``replan``): the decision's event, None when a check
    found nothing to decide."""
    _, record = self.replan(step, program, state, host_batch)
    return None if record is None else decision_event(record)

  @property
  def decided_step(self) -> int | None:
    """The step of the last decision, undo or check (None: none yet); a checkpoint keeps it."""
    return self._last_decision_step

  def restore(self, history: list[dict], decided_step: int | None = None) -> None:
    """Takes up the ``history`` and ``decided_step`` of a checkpointed run: its undone splits stay
    blocked; a run that decided (even to keep its split) makes no first decision again — ``once``
    no decision at all, ``auto`` only the ones its step times call for —, but in ``once`` a re-plan
    not yet timed is timed (the first full window after the resumed run's warm-up) and may be
    undone."""
    self.history[:] = history
    by_step = {r["step"]: r for r in history if r.get("replanned")}
    self._undone = tuple(Undone.of_record(by_step[r["undone"]]) for r in history if "undone" in r)
    if decided_step is None and history:
      decided_step = history[-1]["step"]
    if decided_step is not None:
      self._last_decision_step = decided_step
    if self.mode == "once" and history:
      last = history[-1]
      self._awaiting = last if last.get("replanned") and "measured_ms_new" not in last else None

  def times_steps(self) -> bool:
    """Whether the trainer should time its steps for ``wants_measurement`` now."""
    first = self.mode == "once" and self._last_decision_step is None
    return self.mode == "auto" or first or self._awaiting is not None

  # -- when -----------------------------------------------------------------------------------
  def _reset_windows(self) -> None:
    self._reference_ms, self._drifted = None, 0
    self._windows.reset()

  def take_notes(self) -> list[dict]:
    """The measured steps after re-plans found since the last call: ``{"step",
    "decision_step", "predicted_ms", "measured_ms", "measured_ms_old", "undone"}``; an undone
    one has ``"restored"``, the split to switch back to (the trainer does), and
    ``"restored_policies"`` (JSON) where the re-plan lifted some."""
    notes, self._notes = self._notes, []
    return notes

  def wants_measurement(self, step: int, start_step: int, step_ms: float | None) -> bool:
    """Whether to measure the groups after ``step`` (``step_ms``: the wall time of a step just
    taken, or None when it was not timed; steps up to ``start_step + warmup_steps`` are not
    counted). Every process must call it at every step: at the end of a window the processes
    agree (a collective)."""
    if self.mode == "off" or step_ms is None or not self.times_steps():
      return False
    if step <= start_step + self.warmup_steps:
      return False
    median = self._windows.add(step_ms)
    if median is None:
      return False
    self._last_median = median
    if self._last_decision_step is None:
      return True  # the first decision: after one timed window of the running split
    if self._reference_ms is None:
      self._reference_ms = median
      if self._awaiting is not None:
        self._judge(step, median)
      return False
    if self.mode != "auto":
      return False
    moved = abs(median - self._reference_ms) / self._reference_ms > self.threshold
    self._drifted = self._drifted + 1 if moved else 0
    affordable = self._windows.since_ms * self.max_overhead >= self._debt_ms
    want = affordable and (self._drifted >= 2 or self._windows.count >= self.recheck_windows)
    # Each process times its own steps: they decide together (a window ends at the same step
    # everywhere), or one would measure, a collective, while the others train on.
    return any_process(want)

  def _judge(self, step: int, median: float) -> None:
    """The awaited re-plan's measured step is ``median``: kept, or undone (the rule of the
    module docstring) — an undo record joins ``history`` and a note asks to switch back."""
    record, self._awaiting = self._awaiting, None
    record["measured_ms_new"] = round(median, 3)
    note = {
      "decision_step": record["step"],
      "predicted_ms": record["predicted_ms_new"],
      "measured_ms": round(median, 3),
    }
    old = record.get("measured_ms_old")
    undone = old is not None and record["measured_ms_new"] >= old
    note = {**note, **({"measured_ms_old": old} if old is not None else {}), "undone": undone}
    if undone:
      note["restored"] = dict(record["old"])
      lifted = record.get("lifted", {})
      if lifted:
        note["restored_policies"] = {g: lift["old"] for g, lift in lifted.items()}
      for g in lifted:  # the checks' reference: the running policy's measurements again
        self._points[g] = {int(b): ms for b, ms in record["measured_ms"][g].items()}
      self.history.append(
        {
          "step": step,
          "undone": record["step"],
          "old": dict(record["new"]),
          "new": dict(record["old"]),
          "measured_ms_old": old,
          "measured_ms_new": record["measured_ms_new"],
        }
      )
      self._undone = (*self._undone, Undone.of_record(record))
      self._last_decision_step = step
      self._reset_windows()  # the first window after the switch back is the reference
    self._notes.append({"step": step, **note})
    if self.report is not None:
      self.report({"step": step, "measured_after_replan": note})

  # -- measuring ------------------------------------------------------------------------------
  def replan(self, step: int, program, state, host_batch):
    """Measures and decides after ``step``: ``(new per-device batches or None, record or
    None)``. After a first decision, a check at the running batches comes first: when no
    group's time moved by ``threshold`` (confirmed by a second measurement of the groups that
    did), nothing more is measured (record None)."""
    t0, compiling = self.clock(), compile_seconds()
    first = not self._points
    cluster = program.cluster
    running = {g.name: g.batch_per_device for g in cluster.groups}
    fresh: Measurements = {g: {} for g in running}
    if not first:
      checked = self._check(program, state, host_batch, running)
      if checked is None:
        self._last_decision_step = step
        self._reset_windows()
        self._debt_ms = 1e3 * (self.clock() - t0 - (compile_seconds() - compiling))
        if self.report is not None:
          self.report({"step": step, "checked": "no group moved", "measure_s": round(self._debt_ms / 1e3, 3)})
        return None, None
      for g in running:
        fresh[g].update(checked.get(g, {}))
    sizes = {g: tuple(b for b in self._first_sizes(g, running[g]) if b not in fresh[g]) for g in running}
    _merge(fresh, self._measure(program, state, host_batch, sizes))
    lifts = self._lifts(program, state, host_batch, fresh)
    self._refine(program, state, host_batch, fresh, lifts)
    batches, record = self.decide(step, cluster, fresh, report=False, lifted=lifts)
    cost_s = self.clock() - t0
    record["measure_s"] = round(cost_s, 3)
    self._debt_ms = 0.0 if first else 1e3 * (cost_s - (compile_seconds() - compiling))
    if self.report is not None:
      self.report(record)
    return batches, record

  def _refine(self, program, state, host_batch, fresh: Measurements, lifts: Mapping[str, Lift]) -> None:
    """Measures each group at the batch the balance gives it, up to ``refine`` rounds, while a
    re-plan is in sight and a balanced batch was not measured (into ``fresh`` or the lift's)."""
    cluster = program.cluster
    running = {g.name: g.batch_per_device for g in cluster.groups}
    counts = {g.name: g.count for g in cluster.groups}
    for _ in range(self.refine):
      if not all(fresh.values()):
        break
      speeds = {g: GroupSpeed.fit(lifts[g].measured if g in lifts else fresh[g]) for g in running}
      balanced = balance(counts, speeds, cluster.global_batch, self.granularity)
      before = predicted_ms({g: GroupSpeed.fit(fresh[g]) for g in running}, running)
      if predicted_ms(speeds, balanced) > before * (1 - self.threshold):
        break  # no re-plan in sight: no new sizes (each one compiles a probe)
      missing = {
        g: (b,) for g, b in balanced.items() if b not in (lifts[g].measured if g in lifts else fresh[g])
      }
      if not missing:
        break
      policies = {g: lifts[g].lifted for g in missing if g in lifts}
      for g, points in self._measure(program, state, host_batch, missing, policies).items():
        (lifts[g].measured if g in lifts else fresh[g]).update(points)

  def _check(self, program, state, host_batch, running):
    """Each group's time at its running batch, or None when none moved by ``threshold`` from
    the last full measurement (a group that did is measured again: both must agree)."""
    checked = self._measure(program, state, host_batch, {g: (b,) for g, b in running.items()})
    for g, b in running.items():  # a batch the last decision did not measure: this is its reference
      if b in checked.get(g, {}) and b not in self._points.setdefault(g, {}):
        self._points[g][b] = checked[g][b]

    def change(measured, g):
      old, new = self._points.get(g, {}).get(running[g]), measured.get(g, {}).get(running[g])
      return 0.0 if old is None or new is None else (new - old) / old

    moved = [g for g in running if abs(change(checked, g)) > self.threshold]
    if not moved:
      return None
    again = self._measure(
      program, state, host_batch, {g: ((running[g],) if g in moved else ()) for g in running}
    )
    confirmed = [
      g for g in moved if abs(change(again, g)) > self.threshold and change(again, g) * change(checked, g) > 0
    ]
    if not confirmed:
      return None
    for g in moved:
      if running[g] in again.get(g, {}):
        checked[g][running[g]] = (checked[g][running[g]] + again[g][running[g]]) / 2
    return checked

  def _measure(self, program, state, host_batch, sizes, policies=None) -> Measurements:
    """``measure`` at ``sizes``, of ``policies`` where given (else the groups' running policies)."""
    if not any(sizes.values()):  # the same on every process: none of them measures
      return {}
    return self.measure(program, state, host_batch, sizes, dict(policies or {}))

  def _lifts(self, program, state, host_batch, measured) -> dict[str, Lift]:
    """The groups whose ``lifted_policy`` is measured at least ``threshold`` faster than their
    running policy at every batch ``measured`` holds of them (measured at those batches)."""
    running = {g: program.plan.policy_for(g) for g in measured}
    lifted = {g: lifted_policy(p) for g, p in running.items()}
    lifted = {g: p for g, p in lifted.items() if p is not None and measured[g]}
    sizes = {g: tuple(sorted(measured[g])) if g in lifted else () for g in measured}
    timed = self._measure(program, state, host_batch, sizes, lifted) if lifted else {}
    out = {}
    for g, policy in lifted.items():
      ms = timed.get(g, {})
      if all(b in ms and ms[b] <= t * (1 - self.threshold) for b, t in measured[g].items()):
        out[g] = Lift(running[g], policy, dict(ms))
    return out

  def _first_sizes(self, group: str, batch: int) -> tuple[int, ...]:
    """A full measurement's first sizes: the running batch and, after a first decision, the
    size measured before that lies farthest from it (its probe is compiled); else
    ``probe_sizes``."""
    seen = self._sizes_seen.get(group, set()) - {batch}
    if seen:
      return (batch, max(seen, key=lambda b: (abs(b - batch), b)))
    return probe_sizes(batch)

  # -- deciding -------------------------------------------------------------------------------
  def decide(
    self,
    step: int,
    cluster: ClusterSpec,
    measured: Mapping[str, Mapping[int, float]],
    report: bool = True,
    lifted: Mapping[str, Lift] | None = None,
  ):
    """``(new per-device batches or None, record)``: ``decide.decide`` on the measurements of the
    running policies (and of the ``lifted`` groups' lifted policies), with this replanner's
    undone re-plans; the record joins ``history`` when it re-plans."""
    lifted = dict(lifted or {})
    decision = decide(
      measured,
      Running.of(cluster),
      self._undone,
      lifted=lifted,
      threshold=self.threshold,
      granularity=self.granularity,
    )
    self._undone = decision.undone
    self._points = {g.name: dict(measured[g.name]) for g in cluster.groups}
    for g in self._points:
      self._sizes_seen.setdefault(g, set()).update(measured[g])
    last_median = self._last_median
    self._last_decision_step = step
    self._reset_windows()
    self._last_median = None
    record = {"step": step, **decision.record}
    if last_median is not None:
      record["measured_ms_old"] = round(last_median, 3)
    if decision.blocked_by is not None:
      record["undone_replan"] = decision.blocked_by
    record["replanned"] = decision.batches is not None
    if decision.batches is not None:
      self.history.append(record)
      self._awaiting = record
      for g, lift in lifted.items():  # the checks' reference: the lifted policy runs now
        self._points[g] = dict(lift.measured)
        self._sizes_seen[g].update(lift.measured)
    if report and self.report is not None:
      self.report(record)
    return decision.batches, record


def _merge(into: Measurements, measured: Measurements) -> None:
  for g, points in measured.items():
    if g in into:
      into[g].update(points)
