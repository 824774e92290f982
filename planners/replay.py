"""Replay simulator: predicted step time and peak memory of a plan on a cluster.

``predict(cluster, profiles, plan)`` costs the step graph of ``planners.graph`` for every
device group (its profile, its policy, its batch), takes the longest path, and returns a
``Prediction``:

* ``step_ms`` — the synchronous step: every group's forward and backward, the shared
  bucketed all-reduce (overlapping the backward), then the optimizer;
* ``group_step_ms`` — each group's step if every device were like it (its own graph with the
  same all-reduce), which tells the straggler;
* ``group_compute_ms`` — forward + backward + optimizer of each group, no communication;
* ``memory_bytes`` — peak memory per device of each group, the larger of two moments:

  - where the backward starts: parameters + optimizer state + gradients + batch +
    activations saved for the backward as the compiled step keeps them
    (``planners.op_memory.kept_bytes``: the stored precision, fp32 for 16-bit residuals on
    backends that upcast 16-bit products and for fp8 residuals on backends without fp8
    arithmetic) + the largest backward transient
    (int8/fp8 residuals dequantized to fp32, ``transient_bytes``) + the profile's fitted
    ``other_bytes``
    + the largest library scratch buffer of the plan's ops (``scratch_bytes``: on GPUs
    cuDNN / cuBLAS scratch; XLA packs them by liveness, the largest decides), with
    ``other_bytes`` mixed with ``other_bytes_16bit`` (where fitted) by the plan's share of
    16-bit activations (``planners.graph.mixed_by_16bit_share``);
  - during each op's forward: the fp32 step's peak less its headroom there
    (``Profile.forward_headroom``; where unmeasured, the fp32 residuals of the later ops),
    plus what the plan keeps beyond fp32 for the earlier ops, plus the op's own forward
    extra (``forward_extra_bytes``: an int8/fp8 conv's fp32 patches, GEMM operands and
    dequantized residual at once). Where the profile measured the op's own forward bytes
    in the fp32 step (``Profile.forward_own_bytes``), an int8/fp8 forward instead replaces
    them by its own (``quantized_forward_bytes``), on the fp32 step's own peak (its
    ``other_bytes`` and library scratch): on an H100 the fp32 step's largest scratch, a
    221 MB cuDNN workspace of a backward conv, is not live at any forward.

Profiles are keyed by device type; a group whose type has no profile gets one modeled from
the catalog (``planners.derived_profiles.modeled_profile``), and its numbers are labelled so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from planners.derived_profiles import modeled_profile
from planners.graph import (
  DEFAULT_BUCKET_BYTES,
  DEFAULT_LATENCY_US,
  PRESET_NAMES,
  Comm,
  GroupCost,
  Node,
  build_graph,
  float_precision,
  longest_path,
  mixed_by_16bit_share,
)
from planners.op_memory import (
  dequantizes_fp8_residuals,
  forward_extra_bytes,
  kept_bytes,
  quantized_forward_bytes,
  residual_bytes,
  transient_bytes,
  upcasts_16bit_products,
)
from planners.profiler import QUANTIZED_FIT_PRESET, SIXTEEN_BIT_FIT_PRESET, Profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.errors import PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted step of a plan; see the module docstring. Times in ms, memory in bytes."""

  step_ms: float
  group_step_ms: dict[str, float]
  group_compute_ms: dict[str, float]
  memory_bytes: dict[str, int]
  memory_limit_bytes: dict[str, int]
  comm_ms: float
  sources: dict[str, str]
  nodes: tuple[Node, ...] = ()
  times: tuple[tuple[float, float], ...] = ()

  @property
  def fits(self) -> bool:
    return all(self.memory_bytes[g] <= self.memory_limit_bytes[g] for g in self.memory_bytes)

  def to_json(self) -> dict:
    return {
      "step_ms": self.step_ms,
      "group_step_ms": self.group_step_ms,
      "group_compute_ms": self.group_compute_ms,
      "memory_bytes": self.memory_bytes,
      "memory_limit_bytes": self.memory_limit_bytes,
      "comm_ms": self.comm_ms,
      "cost_source": self.sources,
    }


def profile_for(profiles: Mapping[str, Profile], device_type: str) -> Profile:
  """The profile of ``device_type``, else one modeled from a measured profile of the model."""
  if device_type in profiles:
    return profiles[device_type]
  if not profiles:
    raise PlanError("no cost profile given. Fix: pass at least one file from `qsync profile`.")
  base = sorted(profiles.values(), key=lambda p: p.source != "measured")[0]
  return modeled_profile(base, device_type)


def group_costs(cluster: ClusterSpec, profiles: Mapping[str, Profile], plan: Plan) -> list[GroupCost]:
  """One ``GroupCost`` per group of ``cluster``, with the plan's policies and batches."""
  plan.validate_for(cluster)
  cluster = plan.apply_to(cluster)
  out = []
  for g in cluster.groups:
    prof = profile_for(profiles, g.device_type)
    policy = plan.policy_for(g.name)
    out.append(GroupCost(g.name, prof, policy.resolve(prof.op_names), g.batch_per_device))
  return out


def comm_for(
  cluster: ClusterSpec,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  latency_us: float = DEFAULT_LATENCY_US,
  bucket_order: str = "tree",
) -> Comm:
  """The all-reduce of ``cluster``: all its devices, in a ring limited by the slowest link,
  each collective paying ``latency_us`` (e.g. fitted by a link microbenchmark), in buckets
  packed in ``bucket_order`` (``planners.graph.buckets``)."""
  links = min(g.link_gbps for g in cluster.groups)
  return Comm(cluster.num_devices, links, bucket_bytes, latency_us, bucket_order)


class OpMemory(NamedTuple):
  """Bytes of one op of a group at its batch (see ``memory_bytes``).

  Attributes:
    kept: what the step keeps for its backward (``kept_bytes``).
    transient: live only while its backward runs (``transient_bytes``).
    fp32_kept: what it would keep as an fp32 op.
    forward_delta: kept beyond ``fp32_kept`` while later forwards run.
    forward_extra: its forward's busiest bytes beyond the fp32 op's (``forward_extra_bytes``).
    forward_own: an int8/fp8 forward's own busiest bytes (``quantized_forward_bytes``), else 0.
  """

  kept: int
  transient: int
  fp32_kept: int
  forward_delta: int
  forward_extra: int
  forward_own: int


def op_memory(group: GroupCost, op_index: int) -> OpMemory:
  """The ``OpMemory`` of one op of ``group`` at its batch."""
  prof = group.profile
  op = prof.ops[op_index].scaled(group.batch_per_device / prof.batch_per_device)
  pol = group.op_policies.get(op.name)
  device = prof.device_type
  upcast, fp8, differentiated = (
    upcasts_16bit_products(device),
    dequantizes_fp8_residuals(device),
    op_index > 0,
  )
  kept = kept_bytes(op, pol, upcast, differentiated, fp8)
  fp32_kept = residual_bytes(op, None)
  return OpMemory(
    kept,
    transient_bytes(op, pol, upcast, fp8),
    fp32_kept,
    kept_bytes(op, pol, upcast, differentiated, fp8) - fp32_kept,
    forward_extra_bytes(op, pol, upcast, differentiated, fp8),
    quantized_forward_bytes(op, pol, upcast, fp8),
  )


def scratch_bytes(group: GroupCost) -> int:
  """The largest library scratch buffer of any op of ``group`` under its policy: the
  ``"scratch_bytes"`` its whole-policy program recorded (``op_programs.measure_policy``; an
  unmodified op at the float precision XLA runs it in, ``graph.float_precision``); for a
  policy that is no preset, the largest the op recorded under any. 0 where the profile
  recorded none (XLA:CPU, older profiles). Not scaled with the batch (cuBLAS asks for a fixed
  32 MiB). The step's largest is charged at its peak: conservative where the call that asks
  for it runs away from the peak."""
  prof = group.profile
  out = 0.0
  for op in prof.ops:
    pol = group.op_policies.get(op.name) or OpPolicy.uniform(float_precision(prof))
    entries = prof.op_ms.get(op.name, {})
    preset = PRESET_NAMES.get(pol)
    if preset is not None and f"policy:{preset}" in entries:
      out = max(out, entries[f"policy:{preset}"].get("scratch_bytes", 0.0))
    else:
      out = max([out] + [e.get("scratch_bytes", 0.0) for k, e in entries.items() if k.startswith("policy:")])
  return int(out)


def memory_bytes(group: GroupCost, memory_fn=None) -> int:
  """Peak bytes on one device of ``group``; see the module docstring. ``memory_fn`` defaults
  to ``op_memory`` (a caller evaluating many plans may pass a memoized one)."""
  memory_fn = memory_fn or op_memory
  prof = group.profile
  scale = group.batch_per_device / prof.batch_per_device
  mem = prof.memory
  terms = [memory_fn(group, i) for i in range(len(prof.ops))]
  other = mixed_by_16bit_share(prof, group.op_policies, mem["other_bytes"], mem.get("other_bytes_16bit"))
  base = (
    2 * mem["param_bytes"]
    + mem["opt_state_bytes"]
    + scale * (mem["batch_bytes"] + other)
    + scratch_bytes(group)
  )
  backward = base + sum(t.kept for t in terms) + max((t.transient for t in terms), default=0)
  fp32_peak = base + sum(t.fp32_kept for t in terms)
  # the fp32 step's own peak, which its forward headroom is measured from: its `other_bytes`
  # and its library scratch (on GPUs a cuDNN workspace of the backward, not live in a forward)
  fp32_step_peak = (
    fp32_peak + scale * (mem["other_bytes"] - other) + fp32_scratch_bytes(group) - scratch_bytes(group)
  )
  forward, before, later = 0.0, 0, sum(t.fp32_kept for t in terms)
  for op, t in zip(prof.ops, terms):
    later -= t.fp32_kept
    # unmeasured: the fp32 step holds all but the residuals of the ops still to run
    headroom = scale * prof.forward_headroom[op.name] if op.name in prof.forward_headroom else later
    if t.forward_own and op.name in prof.forward_headroom and op.name in prof.forward_own_bytes:
      # the fp32 step at this forward without the op's own buffers, then the quantized op's
      at_op = fp32_step_peak - headroom - scale * prof.forward_own_bytes[op.name]
      forward = max(forward, at_op + before + t.forward_own)
    else:
      forward = max(forward, fp32_peak - headroom + before + t.forward_extra)
    before += t.forward_delta
  return int(max(backward, forward))


def fp32_scratch_bytes(group: GroupCost) -> int:
  """``scratch_bytes`` of ``group`` with every op at fp32: the fp32 step's largest scratch."""
  fp32 = OpPolicy.uniform("fp32")
  return scratch_bytes(dataclasses.replace(group, op_policies={op.name: fp32 for op in group.profile.ops}))


def sync_step_ms(groups: Sequence[GroupCost], comm: Comm, cost_fn=None) -> float:
  """The synchronous step time (ms) of ``groups`` sharing ``comm``: the longest path."""
  return max(end for _, end in longest_path(build_graph(groups, comm, cost_fn)))


def predict(
  cluster: ClusterSpec,
  profiles: Mapping[str, Profile],
  plan: Plan,
  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
  latency_us: float = DEFAULT_LATENCY_US,
  bucket_order: str = "tree",
) -> Prediction:
  """Predicted step time and memory of ``plan`` on ``cluster``; see the module docstring.
  ``latency_us`` is the fixed cost of each all-reduce bucket; ``bucket_order`` how the
  gradients are packed into buckets: ``"tree"`` by XLA's combiner (the trainer's default),
  ``"backward"`` by an all-reduce with ``bucket_bytes``."""
  groups = group_costs(cluster, profiles, plan)
  comm = comm_for(cluster, bucket_bytes, latency_us, bucket_order)
  nodes = build_graph(groups, comm)
  times = longest_path(nodes)
  limits = {g.name: int(g.memory_gb * 1e9) for g in cluster.groups}
  return Prediction(
    step_ms=max(end for _, end in times),
    group_step_ms={g.name: sync_step_ms([g], comm) for g in groups},
    group_compute_ms={
      g.name: sum(n.ms for n in nodes if n.group == g.name and n.stream == "compute") for g in groups
    },
    memory_bytes={g.name: memory_bytes(g) for g in groups},
    memory_limit_bytes=limits,
    comm_ms=sum(n.ms for n in nodes if n.stream == "comm"),
    sources={g.name: f"{g.profile.source} ({g.profile.device_type})" for g in groups},
    nodes=tuple(nodes),
    times=tuple(times),
  )


def refit_remainder(cluster: ClusterSpec, profile: Profile, step_ms: float, **predict_kwargs) -> Profile:
  """``profile`` with its remainder refitted so that the replay of the uniform fp32 plan on
  ``cluster`` (whose groups are all of ``profile``'s device type) predicts ``step_ms``, the
  fp32 step measured there (its ``fp32_leg_scale`` kept). ``measure_profile`` fits the
  remainder so on one device; refitted on a cluster it also carries what the op profile does
  not see (that host's launch rate, host work per device when one process drives several,
  collectives slowed by the compute beside them) as time added alike to every plan's step.
  ``predict_kwargs`` go to ``predict``.
  A step shorter than the profile's ops alone needs a negative remainder (seen on a loaded CPU
  host, where the standalone op timings were inflated); it moves the rest of the step earlier
  by its full amount (``planners.graph.longest_path``), but an earlier node may still end later
  than the step it was fitted to."""
  return profile.with_remainder(
    _rest_to(cluster, profile.with_remainder(0.0), "fp32", step_ms, **predict_kwargs)
  )


def _scale_to(
  cluster: ClusterSpec, profile: Profile, field: str, preset: str, step_ms: float, **predict_kwargs
) -> tuple[float | None, float | None]:
  """``(scale, floor)``: the value of ``profile``'s leg scale ``field`` (``quantized_leg_scale``,
  ``fp32_leg_scale``) at which the replay of the uniform ``preset`` plan on ``cluster`` predicts
  ``step_ms``. None when the plan has no leg the scale touches. A step shorter than the replay
  at scale 0 (those legs free) gets scale 0 and ``floor``, that replay's ms; else floor is None.

  The predicted step never falls as the scale grows, and is linear in it while the last node
  ends the step; the secant through scales 0 and 1 is taken when it reproduces ``step_ms``,
  else the scale is bisected (with an all-reduce, a bucket may end the step at one scale and
  the backward at another; a very negative remainder, from standalone timings inflated on a
  busy host, lets an earlier node end it)."""
  plan = Plan(policies={g.name: PrecisionPolicy.uniform(preset) for g in cluster.groups})

  def step_at(scale):
    scaled = dataclasses.replace(profile, **{field: scale})
    return predict(cluster, {profile.device_type: scaled}, plan, **predict_kwargs).step_ms

  free, unit = step_at(0.0), step_at(1.0)
  if unit <= free:  # no leg of the plan at that precision: nothing to fit
    return None, None
  if step_ms <= free:
    return 0.0, free
  scale = (step_ms - free) / (unit - free)
  if abs(step_at(scale) - step_ms) > 1e-9 * step_ms:
    low, high = 0.0, 1.0
    while step_at(high) < step_ms:
      low, high = high, 2 * high
    for _ in range(60):
      low, high = (
        (low, (low + high) / 2) if step_at((low + high) / 2) >= step_ms else ((low + high) / 2, high)
      )
    scale = high
  return scale, None


def _with_clip(meta: dict, step_key: str, step_ms: float, clip_key: str, floor: float | None) -> dict:
  """``meta`` recording the fit step (``step_key``) and, where ``_scale_to`` clipped the scale at
  0, its ``floor`` (``clip_key``; a stale one dropped)."""
  out = {k: v for k, v in meta.items() if k != clip_key}
  return {**out, step_key: step_ms, **({clip_key: floor} if floor is not None else {})}


def refit_quantized_leg_scale(
  cluster: ClusterSpec, profile: Profile, step_ms: float, **predict_kwargs
) -> Profile:
  """``profile`` with its ``quantized_leg_scale`` refitted so that the replay of the uniform
  ``QUANTIZED_FIT_PRESET`` (all-int8) plan on ``cluster`` predicts ``step_ms``, that plan's step
  measured there (``_scale_to``); the remainder is kept, so fit it first. A step shorter than
  the replay with the quantized legs free gets scale 0, said in
  ``meta["quantized_leg_scale_clipped"]`` (that floor in ms). ``predict_kwargs`` go to
  ``predict``."""
  scale, floor = _scale_to(
    cluster, profile, "quantized_leg_scale", QUANTIZED_FIT_PRESET, step_ms, **predict_kwargs
  )
  if scale is None:  # no int8 op in the plan
    return profile
  meta = _with_clip(profile.meta, "quantized_fit_step_ms", step_ms, "quantized_leg_scale_clipped", floor)
  return dataclasses.replace(profile, quantized_leg_scale=scale, meta=meta)


def refit_16bit_remainder(
  cluster: ClusterSpec, profile: Profile, step_ms: float, fp32_ms: float, **predict_kwargs
) -> Profile:
  """``profile`` with its remainder refitted so that the replay of the uniform
  ``SIXTEEN_BIT_FIT_PRESET`` (all-bf16) plan on ``cluster`` predicts ``step_ms``, that plan's
  step measured there (as ``refit_remainder`` fits it to fp32), then its ``fp32_leg_scale`` so
  that the fp32 plan predicts ``fp32_ms`` (``_scale_to``; clipped at 0 as the quantized scale
  is, said in ``meta["fp32_leg_scale_clipped"]``). Records ``meta["sixteen_bit_fit_step_ms"]``.
  The all-bf16 plan has no fp32 leg, so the order is free of circles; fit the quantized scale
  after. ``predict_kwargs`` go to ``predict``."""
  draft = dataclasses.replace(profile.with_remainder(0.0), fp32_leg_scale=1.0)
  out = draft.with_remainder(_rest_to(cluster, draft, SIXTEEN_BIT_FIT_PRESET, step_ms, **predict_kwargs))
  scale, floor = _scale_to(cluster, out, "fp32_leg_scale", "fp32", fp32_ms, **predict_kwargs)
  meta = _with_clip(profile.meta, "sixteen_bit_fit_step_ms", step_ms, "fp32_leg_scale_clipped", floor)
  return dataclasses.replace(out, fp32_leg_scale=1.0 if scale is None else scale, meta=meta)


def _rest_to(cluster: ClusterSpec, draft: Profile, preset: str, step_ms: float, **predict_kwargs) -> float:
  """The remainder (ms) that brings the replay of the uniform ``preset`` plan on ``cluster``
  from that of ``draft`` (whose remainder is 0) to ``step_ms``."""
  plan = Plan(policies={g.name: PrecisionPolicy.uniform(preset) for g in cluster.groups})
  return step_ms - predict(cluster, {draft.device_type: draft}, plan, **predict_kwargs).step_ms


def refit_profile(
  cluster: ClusterSpec,
  profile: Profile,
  fp32_ms: float,
  quantized_ms: float | None = None,
  sixteen_bit_ms: float | None = None,
  **predict_kwargs,
) -> Profile:
  """``profile`` refitted to steps measured on ``cluster``: its remainder to the fp32 step
  (``refit_remainder``); given ``sixteen_bit_ms`` (the all-bf16 step), the remainder to that
  step and ``fp32_leg_scale`` to the fp32 one instead (``refit_16bit_remainder``); then, given
  ``quantized_ms`` (the all-int8 step), its ``quantized_leg_scale``
  (``refit_quantized_leg_scale``) on that remainder."""
  out = refit_remainder(cluster, profile, fp32_ms, **predict_kwargs)
  if sixteen_bit_ms is not None:
    out = refit_16bit_remainder(cluster, out, sixteen_bit_ms, fp32_ms, **predict_kwargs)
  if quantized_ms is not None:
    out = refit_quantized_leg_scale(cluster, out, quantized_ms, **predict_kwargs)
  return out


def fit_presets(profile: Profile) -> tuple[str, ...]:
  """The uniform presets whose steps ``profile`` is fitted to, so that predicting them is no
  test of the replay: fp32 (the remainder) and, once fitted, ``QUANTIZED_FIT_PRESET``
  (``refit_quantized_leg_scale``) and ``SIXTEEN_BIT_FIT_PRESET`` (``refit_16bit_remainder``),
  and the presets whose relayouts were measured in their own step
  (``steptrace.with_policy_step_relayouts``: all-fp16 on XLA:CPU)."""
  return (
    ("fp32",)
    + ((QUANTIZED_FIT_PRESET,) if "quantized_fit_step_ms" in profile.meta else ())
    + ((SIXTEEN_BIT_FIT_PRESET,) if "sixteen_bit_fit_step_ms" in profile.meta else ())
    + tuple(profile.meta.get("relayout_traced_presets", ()))
  )


def memory_fit_presets(profile: Profile) -> tuple[str, ...]:
  """The uniform presets whose XLA peaks ``profile``'s memory model is fitted to: fp32
  (``other_bytes``) and, where fitted, ``SIXTEEN_BIT_FIT_PRESET`` (``other_bytes_16bit``)."""
  return ("fp32",) + ((SIXTEEN_BIT_FIT_PRESET,) if "other_bytes_16bit" in profile.memory else ())


CALIBRATION_DEVICES = ("group", "one")
"""Where ``calibrate``'s fp32 steps were measured: on the group's devices alone, or on one of them."""


def calibrate(
  cluster: ClusterSpec,
  profiles: Mapping[str, Profile],
  fp32_step_ms: Mapping[str, float],
  devices: str = "group",
  **predict_kwargs,
) -> dict[str, Profile]:
  """``profiles`` (``{device type: Profile}``) with the profile of each group named in
  ``fp32_step_ms`` refitted (``refit_remainder``) to that group's measured step: the uniform
  fp32 policy run on that group's devices alone (``devices="group"``: its device count and
  all-reduce, its batch per device) or on one of its devices (``"one"``: the replay alone then
  predicts what changes with the device count). A group without a profile of its own is
  refitted from the one ``profile_for`` models for it. A device type's profile serves every
  group of that type, so two calibrated groups may not share a device type.
  ``predict_kwargs`` go to ``predict``.

  Measured (docs/results.md, LM on H100s, one process per GPU): ``"one"`` 4.5 % and 1.1 %
  mean error in two runs, ``"group"`` 11.5 % and 4.2 %; with one process for all GPUs the
  other way round (one process's host work per GPU is in the group's step only)."""
  if devices not in CALIBRATION_DEVICES:
    raise PlanError(
      f"calibration devices {devices!r} is not one of {CALIBRATION_DEVICES}. Fix: 'group' for an fp32 "
      "step measured on the group's devices, 'one' for one measured on one of them."
    )
  groups = {g.name: g for g in cluster.groups}
  out = dict(profiles)
  calibrated: dict[str, str] = {}  # device type -> group
  for name, ms in fp32_step_ms.items():
    if name not in groups:
      raise PlanError(
        f"calibration names group {name!r}, which the cluster does not have (groups: {sorted(groups)}). "
        "Fix: name one of those groups."
      )
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < float("inf"):
      raise PlanError(
        f"calibration of group {name!r}: the fp32 step must be a positive number of ms, got {ms!r}. "
        f"Fix: pass the median step measured on that group's devices, e.g. {name}=15.4."
      )
    device_type = groups[name].device_type
    if device_type in calibrated:
      raise PlanError(
        f"groups {calibrated[device_type]!r} and {name!r} are both {device_type} and share its profile, "
        "so only one of them can calibrate it. Fix: calibrate one of the two."
      )
    calibrated[device_type] = name
    alone = ClusterSpec((groups[name] if devices == "group" else dataclasses.replace(groups[name], count=1),))
    where = "that group's devices alone" if devices == "group" else "one of that group's devices"
    profile = profile_for(profiles, device_type)
    out[device_type] = refit_remainder(alone, profile, float(ms), **predict_kwargs)
    fp32 = Plan(policies={name: PrecisionPolicy.uniform("fp32")})
    ops = predict(alone, {device_type: profile.with_remainder(0.0)}, fp32, **predict_kwargs).step_ms
    fitted = predict(alone, {device_type: out[device_type]}, fp32, **predict_kwargs).step_ms
    if ms < 0.5 * ops or abs(fitted - ms) > 1e-3 * ms:
      raise PlanError(
        f"calibration of group {name!r}: its fp32 step of {ms} ms is less than half the {ops:.3g} ms its "
        f"ops and optimizer take in the replay of its {device_type} profile, or no remainder reproduces "
        f"it. Fix: check the value (the median fp32 step measured on {where}), or profile on an idle "
        "host of that type (inflated op timings cause this)."
      )
  return out
