"""Re-planning while training: measure each group's speed, re-balance the batch, undo what
measures slower (``replanner``: when; ``group_probes``: each group's step timed outside the training
step; ``decide``: the pure decision over measurements; ``group_speed``: speeds and the balanced
split; ``lift``: 8-bit legs lifted to 16 bits; ``window``: step timing; ``events``: what the
trainer logs and switches to; ``setup``: the trainer's mode and its default)."""

from qsync_jax.train.replan.decide import Decision, Running, Undone, decide
from qsync_jax.train.replan.events import ReplanEvent, describe, describe_measured, describe_undone
from qsync_jax.train.replan.group_probes import (
  PROBE_COST_RUNS,
  Measure,
  Measurements,
  compile_seconds,
  measure_groups,
  probe_sizes,
)
from qsync_jax.train.replan.group_speed import GroupSpeed, balance, predicted_ms
from qsync_jax.train.replan.lift import Lift, lifted_policy
from qsync_jax.train.replan.replanner import MODES, Replanner
from qsync_jax.train.replan.setup import default_replan, trainer_replanner
from qsync_jax.train.replan.window import StepTimer, StepWindows, any_process, process_zero_value

__all__ = [
  "MODES",
  "PROBE_COST_RUNS",
  "Decision",
  "GroupSpeed",
  "Lift",
  "Measure",
  "Measurements",
  "ReplanEvent",
  "Replanner",
  "Running",
  "StepTimer",
  "StepWindows",
  "Undone",
  "any_process",
  "balance",
  "compile_seconds",
  "decide",
  "default_replan",
  "describe",
  "describe_measured",
  "describe_undone",
  "lifted_policy",
  "measure_groups",
  "predicted_ms",
  "probe_sizes",
  "process_zero_value",
  "trainer_replanner",
]
