"""Eight-bit only where it pays, measured on the local device: ``auto_policy``.

For one device type and no cluster. Every *candidate* op — a GEMM that can run 8-bit
(``CANDIDATE_KINDS``: Dense, DenseGeneral, Conv, Einsum, a tied head; not the attention
products, which stay at the base type so that fused attention runs, nor embedding lookups,
which are gathers) — is timed inside the training step: the step is traced with every candidate
at the base precision, then once per 8-bit preset the device runs (``eight_bit_presets``), and
each op's kernels are charged to it (``planners.allocator.auto_steps.Programs.op_legs``: device-clock
kernel times on a GPU, per-instruction events on XLA:CPU). An op *pays* at a preset where its
in-step time (forward and gradient legs) is below its base time; its preset is the fastest.

Work outside an op's kernels — a quantize XLA fuses into the producing LayerNorm, a scale
reduction, a transpose — is charged to a neighbour or to no op, so the per-op sums are a guide,
not the answer: ``auto_policy`` then times whole training steps, interleaved. It considers the
base policy alone; per preset, every op that pays at that preset (``"paying_int8"``…); every
paying op at its fastest preset (``"paying"``) and only those saving at least
``auto_candidates.STRONG_GAIN`` of their base time (``"strong"``); and the frontier's choice within the accuracy budget
(``"frontier"``) — and compiles and times only the base, the set the per-op traces predict
fastest, the frontier's, and at most one more whose prediction is close
(``planners.allocator.auto_candidates``: the others are pruned, each with why). Each distinct set
is compiled once (``planners.allocator.auto_steps.Programs``): a candidate equal to an all-base
or all-preset program the per-op traces ran is timed with that program. Embedding lookups are
left as the model wrote them (a gather saves nothing at a lower precision), every other op not
run 8-bit is at the base precision. Every progress line carries the search's elapsed seconds,
and the result the seconds of each phase (``AutoPolicy.search_phases``).

Accuracy: the sensitivity indicator (``omega``: op → precision → Ω; by default the project's
``gradient`` indicator measured on a few batches after a short all-base training,
``auto_steps.measured_omega``) prices each op's 8-bit preset, and the budget
(``planners.allocator.frontier``: a fraction of the Ω of the speed-only choice, ``DEFAULT_BUDGET``
unless given) limits which candidates may win: ``auto_policy`` returns the fastest candidate whose
Ω is within the budget — the base policy always is, so the result is never a step measured slower
than it — and reports the fastest of all (the ``"speed"`` budget's choice) beside it. With the
``"speed"`` budget no indicator is measured and the fastest candidate wins; with 0 nothing is
traced and every op stays at the base. ``cache_dir`` keeps each result on disk
(``planners.allocator.auto_cache``), so that the same search again loads it.

For a cluster's training groups (``qsync plan --train-precision auto``) nothing is timed:
``profile_paying_ops`` applies the same rule (``paying_ops``) to a profile's measured times.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from planners.allocator import auto_cache
from planners.allocator.auto_candidates import candidate_sets, predicted_ms, set_name, timed_sets
from planners.allocator.auto_steps import Programs, Stopwatch, measured_omega
from planners.allocator.frontier import (
  DEFAULT_BUDGET,
  SPEED,
  Choice,
  budget_label,
  choose,
  omega_cost,
  parse_budget,
)
from planners.allocator.greedy import omega_of
from planners.indicator import PROBED_PRECISIONS, check_values
from planners.ops import OpShape, collect_ops
from planners.predictor.graph import op_costs
from planners.profile import GroupCost, Profile
from planners.profiler import timing
from qsync_jax.devices import device_type_of, supported_precisions
from qsync_jax.errors import PlanError
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import PRESETS, OpPolicy
from qsync_jax.train.train_step import init_variables

CANDIDATE_KINDS = ("dense", "dense_general", "conv", "einsum", "embed_attend")
"""Op kinds ``auto_policy`` may quantize."""
EIGHT_BIT_PRESETS = ("int8", "fp8")
"""8-bit op presets tried (every leg 8-bit; ``qsync_jax.precision.PRESETS``)."""


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
  """What ``auto_policy`` measured and chose (``to_json`` for a file, ``from_json`` back). All times
  are measured on ``device_kind``: ``payoffs`` in-step per op, ``step_ms`` whole steps (median of the
  rounds' medians; ``step_round_ms`` each round's) on ``clock``. ``winner``: the fastest candidate
  within the accuracy ``budget`` (every candidate's Ω in ``candidate_omega``, from the table
  ``omega``, measured as ``indicator`` says); ``speed_winner`` and ``speed_policy``: the fastest of
  all (the ``"speed"`` budget's choice); ``frontier``: the frontier's choice within the budget
  (``planners.allocator.frontier``). ``candidates``: every 8-bit set considered; ``step_ms``: those
  timed; ``predicted_ms``: each set's step predicted from the per-op traces, ``pruned``: why a set
  was not timed (``planners.allocator.auto_candidates``). ``search_phases``: the search's seconds per
  phase (``setup``, ``indicator``, ``compile`` — ``compiled_steps`` programs —, ``trace``, ``time``).
  ``loaded``: read from ``cache_path`` instead of measured."""

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
  budget: float | str = SPEED
  omega: dict[str, dict[str, float]] | None = None
  indicator: str = ""
  frontier: Choice | None = None
  candidate_omega: dict[str, float] = dataclasses.field(default_factory=dict)
  speed_winner: str = ""
  speed_policy: PrecisionPolicy | None = None
  search_s: float = 0.0
  predicted_ms: dict[str, float] = dataclasses.field(default_factory=dict)
  pruned: dict[str, str] = dataclasses.field(default_factory=dict)
  search_phases: dict[str, float] = dataclasses.field(default_factory=dict)
  compiled_steps: int = 0
  cache_path: str = ""
  loaded: bool = False

  @property
  def speedup(self) -> float:
    """Measured base step ms / the chosen policy's step ms (1.0 when the base won)."""
    return self.step_ms["base"] / self.step_ms[self.winner]

  @property
  def speed_speedup(self) -> float:
    """Measured base step ms / the fastest candidate's (the speed-only choice's)."""
    return self.step_ms["base"] / self.step_ms[self.speed_winner or self.winner]

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
      "budget": self.budget,
      "omega": self.omega,
      "indicator": self.indicator,
      "frontier": self.frontier.to_json() if self.frontier else None,
      "candidate_omega": self.candidate_omega,
      "speed_winner": self.speed_winner,
      "speed_policy": self.speed_policy.to_json() if self.speed_policy else None,
      "search_s": self.search_s,
      "predicted_ms": self.predicted_ms,
      "pruned": self.pruned,
      "search_phases": self.search_phases,
      "compiled_steps": self.compiled_steps,
      "measured": True,
    }

  @classmethod
  def from_json(cls, obj: Mapping[str, Any], **changes) -> AutoPolicy:
    """The result ``to_json`` wrote (``changes``: fields to replace, e.g. ``loaded=True``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in obj.items() if k in fields}
    values["policy"] = PrecisionPolicy.from_json(obj["policy"])
    values["payoffs"] = tuple(OpPayoff(p["op"], p["base_ms"], p["preset_ms"]) for p in obj["payoffs"])
    values["frontier"] = Choice(**obj["frontier"]) if obj.get("frontier") else None
    values["speed_policy"] = (
      PrecisionPolicy.from_json(obj["speed_policy"]) if obj.get("speed_policy") else None
    )
    return cls(**{**values, **changes})

  def summary(self) -> list[str]:
    """Lines a user reads: the measured steps, the accuracy budget and what it kept, and each
    candidate op's times, Ω and precision (with why, where it is left out)."""
    from planners.allocator.auto_summary import summary_lines

    return summary_lines(self)


INDICATOR_STEPS = 50
"""Steps of the all-base program ``auto_policy`` trains before probing the indicator."""
INDICATOR_BATCHES = 4
"""Batches the indicator probes (``planners.indicator``, ``gradient``)."""


def auto_policy(
  task,
  batch_per_device: int,
  base: str = "bf16",
  omega: Mapping[str, Mapping[str, float]] | None = None,
  budget: float | str = DEFAULT_BUDGET,
  presets: Sequence[str] | None = None,
  trace_repeats: int = 5,
  step_repeats: int | None = None,
  rounds: int = 3,
  progress: Callable[[str], None] | None = None,
  seed: int = 0,
  indicator_steps: int = INDICATOR_STEPS,
  indicator_batches: int = INDICATOR_BATCHES,
  cache_dir: str | None = None,
) -> AutoPolicy:
  """The fastest measured of the base policy and the policies quantizing the ops that pay on the
  local device, within an accuracy budget (module docstring), for ``task`` at ``batch_per_device``.

  Args:
    base: the precision of every op not quantized (a 16-bit or fp32 preset).
    omega: an indicator table (``{op: {precision: Ω}}``); default: the ``gradient`` indicator
      measured on ``indicator_batches`` batches after ``indicator_steps`` all-base training steps.
    budget: ``planners.allocator.frontier.parse_budget``: a fraction of the speed-only choice's Ω
      (default ``DEFAULT_BUDGET``; 0: every op at ``base``), or ``"speed"`` (no indicator, speed alone).
    presets: the 8-bit presets to try (default ``eight_bit_presets`` of the local device).
    trace_repeats: steps per in-step trace; ``step_repeats`` × ``rounds``: the timed steps.
    cache_dir: where results are kept (``planners.allocator.auto_cache``): a search of the same
      case loads its result instead of measuring; None: nothing kept.
  """
  clock = Stopwatch(progress, time.perf_counter())
  budget = parse_budget(budget)
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
  if omega is not None:
    check_values(omega, "omega")
  if min(indicator_steps, indicator_batches - 1) < 0:
    raise PlanError(
      f"indicator_steps={indicator_steps}, indicator_batches={indicator_batches}: the indicator needs at least "
      "one batch and no negative steps. Fix: pass indicator_batches >= 1, indicator_steps >= 0."
    )
  settings = _Settings(
    batch_per_device,
    base,
    presets,
    budget,
    trace_repeats,
    step_repeats,
    rounds,
    seed,
    indicator_steps,
    indicator_batches,
  )
  with clock.phase("setup"):
    batch = timing.device_batch(task, batch_per_device, seed)
    ops = traced_ops(task, batch, seed)
    candidates = [op for op in ops if op.kind in CANDIDATE_KINDS and op.runs_8bit]
    if omega is not None:  # a table without a candidate's Ω is refused before measuring
      cost = omega_cost(omega, base)
      for op in candidates:
        for p in presets:
          cost(op.name, p)
    fields = None
    if cache_dir is not None:
      fields = _cache_fields(task, ops, batch, omega, settings)
      saved = auto_cache.load(cache_dir, fields)
      if saved is not None:
        result = AutoPolicy.from_json(saved, cache_path=auto_cache.path_of(cache_dir, fields), loaded=True)
        clock.say(
          f"loaded the result of an earlier search from {result.cache_path} in {clock.elapsed():.2f} s"
        )
        return result
  measured = _search(task, batch, ops, candidates, omega, settings, clock)
  result = dataclasses.replace(measured, search_s=clock.elapsed(), search_phases=dict(clock.phases))
  clock.say(
    f"searched in {result.search_s:.1f} s: "
    + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.search_phases.items())
    + f" ({result.compiled_steps} training steps compiled)"
  )
  if fields is not None:
    path = auto_cache.save(cache_dir, fields, result.to_json())
    result = dataclasses.replace(result, cache_path=path)
    clock.say(f"kept the result in {path}")
  return result


def _cache_fields(task, ops, batch, omega, s: _Settings) -> dict[str, Any]:
  """``auto_cache.key_fields`` of a search (the indicator's source: a given table's digest, the
  measured indicator's settings, or none where no indicator is needed)."""
  if omega is not None:
    source = {"table": auto_cache.digest(omega)}
  elif s.budget not in (SPEED, 0.0):
    source = {
      "method": "gradient",
      "steps": s.indicator_steps,
      "batches": s.indicator_batches,
      "seed": s.seed,
    }
  else:
    source = {}
  fingerprint = auto_cache.model_fingerprint(task, policy_of(ops, s.base, {}), batch, s.seed)
  return auto_cache.key_fields(fingerprint, s.batch_per_device, s.base, s.presets, s.budget, source)


def traced_ops(task, batch, seed: int) -> tuple[OpShape, ...]:
  """The quantizable ops of ``task``'s training-mode ``apply`` on ``batch`` (``collect_ops`` on
  abstract variables: traced, nothing computed)."""
  variables = jax.eval_shape(lambda b: init_variables(task, seed, b)[0], batch)
  kwargs = {**task.train_kwargs, **({"mutable": list(task.mutable)} if task.mutable else {})}
  keys = jax.random.split(jax.random.key(seed), len(task.rng_streams))
  kwargs["rngs"] = dict(zip(task.rng_streams, keys))
  return tuple(collect_ops(task.model, variables, *task.inputs(batch), **kwargs))


class _Settings(NamedTuple):
  """``auto_policy``'s arguments that ``_search`` reads."""

  batch_per_device: int
  base: str
  presets: tuple[str, ...]
  budget: float | str
  trace_repeats: int
  step_repeats: int | None
  rounds: int
  seed: int
  indicator_steps: int
  indicator_batches: int


def _search(task, batch, ops, candidates, omega, s: _Settings, clock: Stopwatch) -> AutoPolicy:
  """``auto_policy``'s measurements: the indicator (unless given or unneeded), the per-op traces, the
  candidate sets, the pruning of those the traces predict slower, the interleaved whole-step timing
  of the others, and the choice."""
  base, presets, budget, say = s.base, s.presets, s.budget, clock.say
  with clock.phase("setup"):
    variables = jax.block_until_ready(jax.jit(lambda b: init_variables(task, s.seed, b)[0])(batch))
  programs = Programs(task, ops, lambda chosen: policy_of(ops, base, chosen), batch, variables, say)
  calls = sum(op.calls for op in ops)
  shared = f" ({calls} calls: a module called more than once is one op)" if calls != len(ops) else ""
  say(
    f"{len(candidates)} of the model's {len(ops)} quantizable ops{shared} can run 8-bit; "
    f"accuracy budget {budget_label(budget)}"
  )
  payoffs, indicator, frontier, predicted = (), "given" if omega is not None else "", None, {}
  sets: dict[str, dict[str, str]] = {"base": {}}
  if budget != 0.0 and presets and candidates:
    if omega is None and budget != SPEED:
      omega, indicator = _measure_omega(task, programs, s, clock)
    payoffs, base_step = _trace(task, programs, candidates, s, clock)
    if budget != SPEED:
      frontier = choose(payoffs, omega_cost(omega, base), budget)
    paying = lambda min_gain, preset: paying_ops(payoffs, min_gain, preset=preset)  # noqa: E731
    sets = candidate_sets(paying, presets, frontier.chosen if frontier is not None else None)
    predicted = {name: predicted_ms(base_step, payoffs, chosen) for name, chosen in sets.items()}
  cost = omega_cost(omega, base) if omega is not None else None
  candidate_omega = {n: sum(cost(op, p) for op, p in c.items()) for n, c in sets.items()} if cost else {}
  allowed = frontier.allowed * (1 + 1e-12) if frontier is not None else float("inf")
  eligible = [n for n in sets if n == "base" or budget == SPEED or candidate_omega[n] <= allowed]
  frontier_name = set_name(sets, frontier.chosen if frontier is not None else None)
  names, pruned = ["base"], {}
  if predicted:
    names, pruned = timed_sets(predicted, None if budget == SPEED else eligible, frontier_name)
  for name, why in pruned.items():
    say(f"not timing {name} ({len(sets[name])} ops 8-bit): {why}")
  say(
    f"timing {len(names)} candidate steps: "
    + ", ".join(
      f"{n} ({len(sets[n])} ops 8-bit"
      + (f", predicted {predicted[n]:.3f} ms" if n in predicted else "")
      + (", the program of its trace" if programs.has(sets[n]) else "")
      + ")"
      for n in names
    )
  )
  with clock.phase("compile"):
    runs = {name: programs.get(sets[name], name).run for name in names}
  step_clock = timing.default_step_clock()
  with clock.phase("time"):
    timed = timing.time_round_robin(
      runs,
      s.step_repeats or timing.default_step_repeats(step_clock),
      s.rounds,
      clocks=(step_clock,),
      progress=say,
    )[step_clock]
  step_ms = {name: float(np.median(timed[name])) for name in names}
  winner = min((n for n in names if n in eligible), key=lambda n: (step_ms[n], n != "base"))
  speed_winner = min(names, key=lambda n: (step_ms[n], n != "base"))
  return AutoPolicy(
    policy_of(ops, base, sets[winner]),
    dict(sets[winner]),
    base,
    jax.devices()[0].device_kind,
    s.batch_per_device,
    payoffs,
    sets,
    step_ms,
    {name: list(timed[name]) for name in names},
    winner,
    step_clock,
    budget=budget,
    omega={p.op: dict(omega[p.op]) for p in payoffs if p.op in omega} if omega is not None else None,
    indicator=indicator,
    frontier=frontier,
    candidate_omega=candidate_omega,
    speed_winner=speed_winner,
    speed_policy=policy_of(ops, base, sets[speed_winner]),
    predicted_ms=predicted,
    pruned=pruned,
    compiled_steps=programs.compiled,
  )


def _trace(task, programs: Programs, candidates, s: _Settings, clock: Stopwatch):
  """``(payoffs, traced all-base step ms)``: each candidate op's in-step times from a trace of the
  all-base step and of the step with every candidate at each preset (``Programs.op_legs``)."""
  traces = {}
  for preset in (s.base, *s.presets):
    chosen = {} if preset == s.base else {op.name: preset for op in candidates}
    with clock.phase("compile"):
      programs.get(chosen, f"all-{preset}")
    with clock.phase("trace"):
      clock.say(f"tracing the step with every candidate at {preset}")
      traces[preset] = programs.op_legs(chosen, s.trace_repeats)
  if not any(op.name in traces[s.base] for op in candidates):
    raise PlanError(
      f"auto policy: none of the {len(candidates)} candidate ops was found in the instruction names of "
      f"{task.name!r}'s compiled step (their JAX name stacks), so their times cannot be told apart. "
      "Fix: run the model's ops inside Flax modules (linen or nnx), or pass a plan from `qsync plan`."
    )
  payoffs = tuple(
    OpPayoff(
      op.name,
      sum(traces[s.base].get(op.name, {}).values()),
      {p: sum(traces[p].get(op.name, {}).values()) for p in s.presets},
    )
    for op in candidates
  )
  return payoffs, sum(ms for legs in traces[s.base].values() for ms in legs.values())


def _measure_omega(task, programs: Programs, s: _Settings, clock: Stopwatch):
  """``(Ω table, how it was measured)``: the ``gradient`` indicator at the presets' forward
  precisions (and the base's, which the frontier counts Ω above) on ``indicator_batches`` training
  batches, after ``indicator_steps`` steps of the all-base program on others."""
  base, size, steps, n_batches = s.base, s.batch_per_device, s.indicator_steps, s.indicator_batches
  stream = task.train_batches(size, s.seed + 1)
  with clock.phase("compile"):
    programs.get({}, f"all-{base}")
  with clock.phase("indicator"):
    clock.say(f"training {steps} all-{base} steps")
    warm = programs.warmed_variables(jax.tree_util.tree_map(jnp.asarray, next(stream)) for _ in range(steps))
    probe = [next(stream) for _ in range(n_batches)]
    floor = PRESETS[base].fwd
    precisions = sorted(
      {PRESETS[p].fwd for p in s.presets} | ({floor} if floor in PROBED_PRECISIONS else set())
    )
    clock.say(f"probing the indicator at {', '.join(precisions)} on {n_batches} batches (one program)")
    omega = measured_omega(task, warm, probe, precisions, s.seed)
  return omega, f"gradient indicator on {n_batches} batches of {size} after {steps} {base} steps"
