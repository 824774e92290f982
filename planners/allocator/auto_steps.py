"""The compiled steps ``auto_policy`` measures, each compiled once and used for every measurement
of its 8-bit set, and the indicator it measures by default.

``Programs`` compiles the single-device training step (``planners.profiler.timing``) once per
distinct set of 8-bit ops, under the options a per-op trace needs (``timing.trace_options``: on a
GPU, XLA's command buffers off, so that every kernel names its instruction). One program serves the
set's per-op trace (``op_legs``), its whole-step timing, and, for the all-base set, the short
training the indicator probes after (``warmed_variables``). Every candidate is timed as compiled
for the trace, so they compare alike; the trainer's own program (command buffers on) may differ
from all of them by the same launch overhead.

``measured_omega``: the project's ``gradient`` indicator (``planners.indicator``: E[ΔL²] of a
batch from the measured output error of each op alone) on a few batches: one compiled program
scores every precision.

``Stopwatch``: the seconds since the search began on every progress line, and each phase's seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from planners.ops import OpShape
from planners.profiler import timing
from planners.profiler.step_hlo import per_op_ms


def _copy(tree):
  return jax.tree_util.tree_map(jnp.copy, tree)


class Programs:
  """One compiled training step per distinct ``{op: preset}`` set (``get``) under the policy
  ``policy_for(set)``, each starting from a copy of ``variables``; ``ops``: the model's ops (to
  charge a trace's kernels to)."""

  def __init__(self, task, ops: Sequence[OpShape], policy_for, batch, variables, say: Callable[[str], None]):
    self.task, self.ops, self.policy_for, self.batch = task, ops, policy_for, batch
    self.variables, self.say = variables, say
    self._built: dict[tuple, timing.BuiltStep] = {}

  @staticmethod
  def key(chosen: Mapping[str, str]) -> tuple:
    return tuple(sorted(chosen.items()))

  def has(self, chosen: Mapping[str, str]) -> bool:
    return self.key(chosen) in self._built

  @property
  def compiled(self) -> int:
    """How many programs were compiled."""
    return len(self._built)

  def get(self, chosen: Mapping[str, str], name: str = "") -> timing.BuiltStep:
    """The program of ``chosen`` (compiled on first use)."""
    k = self.key(chosen)
    if k not in self._built:
      what = f"the step with {len(chosen)} ops 8-bit" + (f" ({name})" if name else "")
      self.say(f"compiling {what}")
      t0 = time.perf_counter()
      self._built[k] = timing.build_train_step(
        self.task,
        self.policy_for(chosen),
        self.batch,
        compiler_options=timing.trace_options(),
        variables=_copy(self.variables),
      )
      seconds = time.perf_counter() - t0
      stages = ", ".join(f"{stage.removesuffix('_s')} {s:.1f}" for stage, s in self._built[k].seconds.items())
      self.say(f"compiled {what} in {seconds:.1f} s ({stages} s)")
    return self._built[k]

  def op_legs(self, chosen: Mapping[str, str], repeats: int) -> dict[str, dict[str, float]]:
    """``{op or "rest": {"fwd": ms, "bwd": ms}}`` of ``chosen``'s program from a trace of
    ``repeats`` steps (``timing.traced_instruction_times``, charged by ``step_hlo.per_op_ms``:
    ``"rest"`` holds the instructions of no op, so the entries sum to the traced step); empty when
    another JAX profiler trace is running."""
    built = self.get(chosen)
    try:
      hlo, instruction_ms = timing.traced_instruction_times(built.compiled, built.run, repeats)
    except RuntimeError:
      return {}
    return per_op_ms(hlo, instruction_ms, self.ops)

  def warmed_variables(self, batches) -> dict:
    """The variables after one step of the all-base program (``timing.default_optimizer``) per
    batch of ``batches``, from a copy of the initial ones."""
    built = self.get({})
    variables = _copy(self.variables)
    opt_state = timing.default_optimizer().init(variables["params"])
    key = jax.random.key(0)
    for i, batch in enumerate(batches):
      variables, opt_state, _ = built.compiled(variables, opt_state, batch, jax.random.fold_in(key, i))
    return jax.block_until_ready(variables)


def measured_omega(
  task, variables, batches, precisions: Sequence[str], seed: int
) -> dict[str, dict[str, float]]:
  """``{op: {precision: Ω}}`` of the ``gradient`` indicator (``planners.indicator.compute``, its
  default ``moments`` estimator) at ``precisions`` on ``batches``."""
  from planners.indicator import compute

  table = compute(task, variables, batches, ("gradient",), tuple(precisions), seed=seed)["gradient"]
  return {op: dict(row) for op, row in table["omega"].items()}


class Stopwatch:
  """Seconds since ``t0`` (a ``time.perf_counter()``) in front of every line ``say`` passes on to
  ``progress`` (None: nothing printed), and the seconds spent in each named ``phase``."""

  def __init__(self, progress: Callable[[str], None] | None, t0: float):
    self.progress, self.t0 = progress, t0
    self.phases: dict[str, float] = {}

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def say(self, msg: str) -> None:
    if self.progress is not None:
      self.progress(f"[{self.elapsed():6.1f} s] {msg}")

  @contextlib.contextmanager
  def phase(self, name: str):
    """Adds the seconds of the ``with`` block to ``phases[name]``."""
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0
