"""Eight-bit only where it pays, measured on the local device: ``auto_policy``.

For one device type and no cluster. Every *candidate* op — a GEMM that can run 8-bit
(``CANDIDATE_KINDS``: Dense, DenseGeneral, Conv, Einsum, a tied head; not the attention
products, which stay at the base type so that fused attention runs, nor embedding lookups,
which are gathers) — is timed inside the training step: the step is traced with every candidate
at the base precision, then once per 8-bit preset the device runs (``eight_bit_presets``), and
each op's kernels are charged to it (``planners.profiler.measure.op_leg_ms``: device-clock
kernel times on a GPU, per-instruction events on XLA:CPU). An op *pays* at a preset where its
in-step time (forward and gradient legs) is below its base time; its preset is the fastest.

Work outside an op's kernels — a quantize XLA fuses into the producing LayerNorm, a scale
reduction, a transpose — is charged to a neighbour or to no op, so the per-op sums are a guide,
not the answer: ``auto_policy`` then times whole training steps, interleaved — the base policy
alone; per preset, every op that pays at that preset (``"paying_int8"``…); every paying op at its
fastest preset (``"paying"``) and only those saving at least ``STRONG_GAIN`` of their base time
(``"strong"``) — and returns the fastest. The base policy is a candidate, so the result is never
a step measured slower than it. Embedding lookups are left as the model wrote them (a gather
saves nothing at a lower precision), every other op not run 8-bit is at the base precision.

With an indicator table (``omega``: op → precision → Ω, ``qsync indicator``) and ``budget``, the
paying ops are added in order of least Ω per ms saved while their summed Ω stays within
``budget`` × the Ω of quantizing every paying op (1.0: no limit; 0.0: nothing quantized).

For a cluster's training groups (``qsync plan --train-precision auto``) nothing is timed:
``profile_paying_ops`` applies the same rule (``paying_ops``) to a profile's measured times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from planners.allocator.greedy import omega_of
from planners.ops import OpShape
from planners.predictor.graph import op_costs
from planners.profile import GroupCost, Profile
from planners.profiler import timing
from planners.profiler.measure import op_leg_ms, task_ops
from qsync_jax.devices import device_type_of, supported_precisions
from qsync_jax.errors import PlanError
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import PRESETS, OpPolicy

CANDIDATE_KINDS = ("dense", "dense_general", "conv", "einsum", "embed_attend")
"""Op kinds ``auto_policy`` may quantize."""
EIGHT_BIT_PRESETS = ("int8", "fp8")
"""8-bit op presets tried (every leg 8-bit; ``qsync_jax.precision.PRESETS``)."""
STRONG_GAIN = 0.10
"""The ``"strong"`` candidate keeps ops that save at least this fraction of their base time."""


def eight_bit_presets(device_type: str) -> tuple[str, ...]:
  """The ``EIGHT_BIT_PRESETS`` whose every leg ``device_type`` runs (``supported_precisions``,
  which lists only precisions with a kernel on its architecture)."""
  runs = supported_precisions(device_type)
  return tuple(p for p in EIGHT_BIT_PRESETS if all(q in runs for q in PRESETS[p].precisions))


@dataclasses.dataclass(frozen=True)
class OpPayoff:
  """One candidate op's in-step time (ms per step, forward + gradient legs) at the base precision
  and at each 8-bit preset timed."""

  op: str
  base_ms: float
  preset_ms: Mapping[str, float]

  def best(self) -> tuple[str, float] | None:
    """``(preset, ms saved)`` of the fastest preset that saves time; None if none does."""
    if not self.preset_ms:
      return None
    preset, ms = min(self.preset_ms.items(), key=lambda kv: (kv[1], kv[0]))
    return (preset, self.base_ms - ms) if ms < self.base_ms else None


def paying_ops(
  payoffs: Sequence[OpPayoff],
  min_gain: float = 0.0,
  omega: Mapping[str, Mapping[str, float]] | None = None,
  budget: float = 1.0,
  preset: str | None = None,
) -> dict[str, str]:
  """``{op: preset}``: the ops that save more than ``min_gain`` × their base time at their best
  preset (``OpPayoff.best``; at ``preset`` alone if given), limited by the accuracy budget
  (module docstring) when ``omega`` is given. Equivalent to::

    pay = {p.op: p.best() for p in payoffs if p.best() and p.best()[1] > min_gain * p.base_ms}
    # then, with omega: sorted by omega[op][precision] / saved ms, kept while the running sum of
    # Ω ≤ budget * (the sum over every op of pay)
  """
  if preset is not None:
    payoffs = [
      OpPayoff(p.op, p.base_ms, {preset: p.preset_ms[preset]}) for p in payoffs if preset in p.preset_ms
    ]
  pay = {}
  for p in payoffs:
    best = p.best()
    if best is not None and best[1] > min_gain * p.base_ms:
      pay[p.op] = best
  if omega is None:
    return {op: preset for op, (preset, _) in pay.items()}
  if not 0.0 <= budget <= 1.0:
    raise PlanError(
      f"accuracy budget {budget!r} is outside [0, 1]. Fix: give a fraction of the Ω of every paying op."
    )

  def cost(op: str) -> float:
    return omega_of(omega, op, PRESETS[pay[op][0]].fwd)

  total = sum(cost(op) for op in pay)
  chosen, spent = {}, 0.0
  for op in sorted(pay, key=lambda op: (cost(op) / pay[op][1], op)):
    if spent + cost(op) <= budget * total * (1 + 1e-12):  # the relative term absorbs rounding of the sum
      chosen[op] = pay[op][0]
      spent += cost(op)
  return chosen


def has_measured_times(profile: Profile) -> bool:
  """Whether ``profile``'s op times are measured: a ``qsync profile`` run on the device
  (``source="measured"``), or such a profile with every time scaled by one factor
  (``source="calibrated"`` from a measured base, ``planners.calibrate``: the same ops pay)."""
  if profile.source == "calibrated":
    return profile.meta.get("calibration", {}).get("base", {}).get("source") == "measured"
  return profile.source == "measured"


def profile_payoffs(profile: Profile, base: str, presets: Sequence[str]) -> tuple[OpPayoff, ...]:
  """An ``OpPayoff`` per candidate op of ``profile`` (``CANDIDATE_KINDS``, ``runs_8bit``): its
  forward and gradient legs (with their casts) at the profile's batch under the preset ``base``
  and under each of ``presets``, as the predictor costs them (``planners.predictor.graph.op_costs``):
  the 8-bit legs at their in-step times where the profile traced the all-int8 step
  (``Profile.quantized_in_step_ms``), else at their standalone times; the 16-bit legs at their
  standalone times. Equivalent to::

    ms = lambda op, preset: sum(t for t, _ in op_costs(GroupCost("", profile, {op.name: PRESETS[preset]},
                                                                 profile.batch_per_device), i).values())
    OpPayoff(op.name, ms(op, base), {p: ms(op, p) for p in presets})
  """

  def ms(i: int, preset: str) -> float:
    op = profile.ops[i].name
    cost = GroupCost("", profile, {op: PRESETS[preset]}, profile.batch_per_device)
    return sum(t for t, _ in op_costs(cost, i).values())

  return tuple(
    OpPayoff(op.name, ms(i, base), {p: ms(i, p) for p in presets})
    for i, op in enumerate(profile.ops)
    if op.kind in CANDIDATE_KINDS and op.runs_8bit
  )


def profile_paying_ops(
  profile: Profile, base: str, omega: Mapping[str, Mapping[str, float]], budget: float = 1.0
) -> dict[str, str]:
  """``{op: 8-bit preset}``: ``paying_ops(profile_payoffs(profile, base, eight_bit_presets(its
  device type)), 0.0, omega, budget)`` — the ops whose measured 8-bit cost is below their cost at
  ``base``, within the accuracy budget. ``PlanError`` when the profile's times are not measured
  (``has_measured_times``: a modeled or traced profile has no 8-bit times to trust) or its
  device type has no 8-bit kernel."""
  what = f"the profile of {profile.model!r} on {profile.device_type}"
  if not has_measured_times(profile):
    raise PlanError(
      f"{what} is {profile.source}, not measured: it has no measured 8-bit times to decide which ops pay. "
      f"Fix: profile the model on a {profile.device_type} (`qsync profile`) and pass that file, or pass a "
      "16-bit preset."
    )
  presets = eight_bit_presets(profile.device_type)
  if not presets:
    raise PlanError(
      f"{what}: a {profile.device_type} has no 8-bit kernel (it runs {list(supported_precisions(profile.device_type))}). "
      "Fix: pass a 16-bit preset for it."
    )
  return paying_ops(profile_payoffs(profile, base, presets), 0.0, omega, budget)


def policy_of(ops: Sequence[OpShape], base: str, chosen: Mapping[str, str]) -> PrecisionPolicy:
  """The policy running each op of ``chosen`` at its preset, embedding lookups unmodified and
  every other op at ``base``."""
  return PrecisionPolicy.from_ops(
    {op.name: None if op.kind == "embed" else OpPolicy.preset(chosen.get(op.name, base)) for op in ops}
  )


@dataclasses.dataclass(frozen=True)
class AutoPolicy:
  """What ``auto_policy`` measured and chose (``to_json`` for a file). All times are measured on
  ``device_kind``: ``payoffs`` in-step per op, ``step_ms`` whole steps (median of the rounds'
  medians; ``step_round_ms`` each round's) on ``clock``."""

  policy: PrecisionPolicy
  chosen: dict[str, str]
  base: str
  device_kind: str
  batch_per_device: int
  payoffs: tuple[OpPayoff, ...]
  candidates: dict[str, dict[str, str]]
  step_ms: dict[str, float]
  step_round_ms: dict[str, list[float]]
  winner: str
  clock: str

  @property
  def speedup(self) -> float:
    """Measured base step ms / the chosen policy's step ms (1.0 when the base won)."""
    return self.step_ms["base"] / self.step_ms[self.winner]

  def to_json(self) -> dict[str, Any]:
    return {
      "policy": self.policy.to_json(),
      "chosen": self.chosen,
      "base": self.base,
      "device_kind": self.device_kind,
      "batch_per_device": self.batch_per_device,
      "payoffs": [{"op": p.op, "base_ms": p.base_ms, "preset_ms": dict(p.preset_ms)} for p in self.payoffs],
      "candidates": self.candidates,
      "step_ms": self.step_ms,
      "step_round_ms": self.step_round_ms,
      "winner": self.winner,
      "clock": self.clock,
      "measured": True,
    }

  def summary(self) -> list[str]:
    """Lines a user reads: the measured steps and which ops run 8-bit."""
    lines = [
      f"auto policy on {self.device_kind} (measured, {self.clock} clock, batch {self.batch_per_device} per device): "
      + ", ".join(
        f"{name} ({len(self.candidates[name])} ops 8-bit) {ms:.3f} ms" for name, ms in self.step_ms.items()
      )
      + f" -> {self.winner}, {self.speedup:.3f}x the all-{self.base} step"
    ]
    for p in self.payoffs:
      timed = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p.preset_ms.items()))
      mark = self.chosen.get(p.op, self.base)
      lines.append(f"  {p.op}: {self.base} {p.base_ms:.3f} ms, {timed} ms in step -> {mark}")
    return lines


def auto_policy(
  task,
  batch_per_device: int,
  base: str = "bf16",
  omega: Mapping[str, Mapping[str, float]] | None = None,
  budget: float = 1.0,
  presets: Sequence[str] | None = None,
  trace_repeats: int = 5,
  step_repeats: int | None = None,
  rounds: int = 3,
  progress: Callable[[str], None] | None = None,
  seed: int = 0,
) -> AutoPolicy:
  """The fastest measured of the base policy and the policies quantizing the ops that pay on the
  local device (module docstring), for ``task`` at ``batch_per_device``.

  Args:
    base: the precision of every op not quantized (a 16-bit or fp32 preset).
    omega, budget: an indicator table and the share of its Ω the chosen ops may spend.
    presets: the 8-bit presets to try (default ``eight_bit_presets`` of the local device).
    trace_repeats: steps per in-step trace; ``step_repeats`` × ``rounds``: the timed steps.
  """
  say = progress or (lambda msg: None)
  device = jax.devices()[0]
  device_type = device_type_of(device)
  if base not in PRESETS or PRESETS[base].fwd in EIGHT_BIT_PRESETS:
    raise PlanError(f"base precision {base!r} is not a float preset. Fix: use bf16, fp16 or fp32.")
  PrecisionPolicy.uniform(base).validate_for_device(device_type)
  available = eight_bit_presets(device_type)
  presets = tuple(available if presets is None else presets)
  for p in presets:
    if p not in available:
      raise PlanError(
        f"8-bit preset {p!r} has no kernel on {device.device_kind} ({device_type}; it runs {list(available)}). "
        "Fix: leave presets unset, or choose among those."
      )
  batch, _, ops = task_ops(task, batch_per_device, seed)
  candidates = [op for op in ops if op.kind in CANDIDATE_KINDS and op.runs_8bit]
  clock = timing.default_step_clock()
  base_policy = policy_of(ops, base, {})
  calls = sum(op.calls for op in ops)
  shared = f" ({calls} calls: a module called more than once is one op)" if calls != len(ops) else ""
  say(
    f"{len(candidates)} of the model's {len(ops)} quantizable ops{shared} can run 8-bit; tracing the all-{base} step"
  )
  traces = {base: op_leg_ms(task, base_policy, batch, ops, trace_repeats)}
  for p in presets:
    say(f"tracing the step with every candidate at {p}")
    traces[p] = op_leg_ms(
      task, policy_of(ops, base, {op.name: p for op in candidates}), batch, ops, trace_repeats
    )
  if candidates and not any(op.name in traces[base] for op in candidates):
    raise PlanError(
      f"auto policy: none of the {len(candidates)} candidate ops was found in the instruction names of "
      f"{task.name!r}'s compiled step (their JAX name stacks), so their times cannot be told apart. "
      "Fix: run the model's ops inside Flax modules (linen or nnx), or pass a plan from `qsync plan`."
    )
  payoffs = tuple(
    OpPayoff(
      op.name,
      sum(traces[base].get(op.name, {}).values()),
      {p: sum(traces[p].get(op.name, {}).values()) for p in presets},
    )
    for op in candidates
  )
  sets = {"base": {}}
  tries = [(f"paying_{p}", 0.0, p) for p in presets] + [("paying", 0.0, None), ("strong", STRONG_GAIN, None)]
  for name, min_gain, only in tries:
    chosen = paying_ops(payoffs, min_gain, omega, budget, only)
    if chosen and chosen not in sets.values():
      sets[name] = chosen
  say(
    f"timing {len(sets)} candidate steps: " + ", ".join(f"{n} ({len(c)} ops 8-bit)" for n, c in sets.items())
  )
  timed = timing.time_train_steps_interleaved(
    task,
    {name: policy_of(ops, base, chosen) for name, chosen in sets.items()},
    batch,
    step_repeats or timing.default_step_repeats(clock),
    rounds,
    clocks=(clock,),
    progress=say,
  )[clock]
  step_ms = {name: timed[name][0] for name in sets}
  winner = min(step_ms, key=lambda n: (step_ms[n], n != "base"))
  return AutoPolicy(
    policy_of(ops, base, sets[winner]),
    dict(sets[winner]),
    base,
    device.device_kind,
    batch_per_device,
    payoffs,
    sets,
    step_ms,
    {name: list(timed[name][1]) for name in sets},
    winner,
    clock,
  )
