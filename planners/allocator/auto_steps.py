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
batch from the measured output error of each op alone) on a few batches.
"""

from __future__ import annotations

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

  def get(self, chosen: Mapping[str, str], name: str = "") -> timing.BuiltStep:
    """The program of ``chosen`` (compiled on first use)."""
    k = self.key(chosen)
    if k not in self._built:
      self.say(f"compiling the step with {len(chosen)} ops 8-bit" + (f" ({name})" if name else ""))
      self._built[k] = timing.build_train_step(
        self.task,
        self.policy_for(chosen),
        self.batch,
        compiler_options=timing.trace_options(),
        variables=_copy(self.variables),
      )
    return self._built[k]

  def op_legs(self, chosen: Mapping[str, str], repeats: int) -> dict[str, dict[str, float]]:
    """``{op: {"fwd": ms, "bwd": ms}}`` of ``chosen``'s program from a trace of ``repeats`` steps
    (``timing.traced_instruction_times``, charged by ``step_hlo.per_op_ms``); empty when another
    JAX profiler trace is running."""
    built = self.get(chosen)
    try:
      hlo, instruction_ms = timing.traced_instruction_times(built.compiled, built.run, repeats)
    except RuntimeError:
      return {}
    by_op = per_op_ms(hlo, instruction_ms, self.ops)
    return {op.name: by_op[op.name] for op in self.ops if op.name in by_op}

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
