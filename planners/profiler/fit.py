"""Every fitted quantity of a profile, in one place.

* ``fit_cast_model`` — a cast's ``ms = a·numel + b``, least squares over standalone casts;
* ``fit_remainder`` — ``remainder_ms``: the measured step of the uniform fit preset
  (``fit_preset``) minus what the replay of that plan predicts without a remainder (negative
  where standalone op timings exceed their cost inside the fused step);
* ``fit_memory`` — ``other_bytes``: XLA's peak of the compiled fp32 step minus what the memory
  model accounts for, and ``other_bytes_16bit`` likewise on the all-bf16 step;
* ``fit_fixed_share`` — ``fixed_share``: the share of the modeled compute that does not grow
  with the batch, fitted to measured steps at two batches or more (the fit step at the profiled
  batch and at half of it; a training run's points, ``planners.calibrate``);
* ``fit_profile`` — all three, from the measurements a profile's ``meta`` records.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from planners.predictor.memory_model import memory_bytes
from planners.predictor.replay import one_device_compute_ms, predict
from planners.profile import CastModel, GroupCost, Profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import PRESETS, OpPolicy

SIXTEEN_BIT_PRESET = "bf16"
"""The uniform 16-bit preset: the remainder's fit step where profiled, and the step whose XLA
peak fits ``other_bytes_16bit``."""


def fit_preset(precisions: Sequence[str]) -> str:
  """The uniform preset whose step fits the remainder: ``SIXTEEN_BIT_PRESET`` where profiled,
  else fp32."""
  return SIXTEEN_BIT_PRESET if SIXTEEN_BIT_PRESET in precisions else "fp32"


def fit_cast_model(numels: Sequence[float], times_ms: Sequence[float], source: str = "measured") -> CastModel:
  """Least-squares ``ms = a·numel + b`` and its relative RMS error."""
  x, y = np.asarray(numels, np.float64), np.asarray(times_ms, np.float64)
  design = np.stack([x, np.ones_like(x)], axis=1)
  (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
  rel = np.sqrt(np.mean(((design @ np.array([a, b]) - y) / y) ** 2))
  return CastModel(float(a), float(b), float(rel), source)


def one_device(profile: Profile) -> ClusterSpec:
  """The cluster a profile's own fits replay on: one device of its type at its batch."""
  return ClusterSpec.uniform(profile.device_type, 1, profile.batch_per_device, memory_gb=1e3)


def fit_remainder(
  profile: Profile, preset: str, step_ms: float, cluster: ClusterSpec | None = None, **predict_kwargs
) -> Profile:
  """``profile`` with the remainder that makes the replay of the uniform ``preset`` plan on
  ``cluster`` (default ``one_device``; its groups all of the profile's device type) predict
  ``step_ms``, that plan's measured step. Fitted on a cluster it also carries what the op
  timings do not see there (host work per device, collectives slowed by the compute beside
  them) as time added alike to every plan. ``predict_kwargs`` go to ``predict``."""
  cluster = cluster or one_device(profile)
  draft = profile.with_remainder(0.0)
  plan = Plan(policies={g.name: PrecisionPolicy.uniform(preset) for g in cluster.groups})
  return profile.with_remainder(
    step_ms - predict(cluster, {draft.device_type: draft}, plan, **predict_kwargs).step_ms
  )


def fitted_other_bytes(profile: Profile, peak_bytes: int, preset: str) -> int:
  """The memory correction at which the memory model of ``profile`` predicts ``peak_bytes`` for
  the uniform ``preset`` plan on one device at the profiled batch: ``other_bytes`` for fp32,
  ``other_bytes_16bit`` for ``SIXTEEN_BIT_PRESET`` (whose activations are all 16-bit, so that
  correction alone applies)."""
  key = "other_bytes" if preset == "fp32" else "other_bytes_16bit"
  draft = dataclasses.replace(profile, memory={**profile.memory, key: 0})
  policies = {o.name: PRESETS[preset] for o in profile.ops}
  return int(peak_bytes - memory_bytes(GroupCost("local", draft, policies, profile.batch_per_device)))


def fit_memory(profile: Profile, fp32_peak: int | None, sixteen_bit_peak: int | None = None) -> Profile:
  """``profile`` with ``other_bytes`` fitted to ``fp32_peak`` (0 without a peak) and, given
  ``sixteen_bit_peak``, ``other_bytes_16bit`` to it (``fitted_other_bytes``)."""
  memory = {k: v for k, v in profile.memory.items() if k != "other_bytes_16bit"}
  out = dataclasses.replace(profile, memory={**memory, "other_bytes": 0})
  if fp32_peak is not None:
    out = dataclasses.replace(
      out, memory={**memory, "other_bytes": fitted_other_bytes(out, fp32_peak, "fp32")}
    )
  if sixteen_bit_peak is not None:
    sixteen = fitted_other_bytes(out, sixteen_bit_peak, SIXTEEN_BIT_PRESET)
    out = dataclasses.replace(out, memory={**out.memory, "other_bytes_16bit": sixteen})
  return out


def fit_fixed_share(
  profile: Profile,
  policies: Mapping[str, OpPolicy | None],
  points: Mapping[int, float],
  group: str = "local",
) -> float:
  """The fixed share ``f`` (``Profile.fixed_share``) of ``profile`` at ``policies`` under which
  the modeled compute of one device (``one_device_compute_ms``) grows with the batch as the
  measured ``{per-device batch: ms}`` ``points`` (two batches or more) do: the model at a fixed
  share ``f`` is a line ``A(f) + B(f)·b`` (both linear in ``f``), and ``f`` makes ``A(f) / B(f)``
  the ratio ``α / β`` of the least-squares line ``α + β·b`` through the points (the level is
  the remainder's or the calibration scale's); 0 where the points grow faster than linearly.
  Where they do not grow with the batch, or grow less than a share below 1 allows (noise, a
  device time-sliced with another job), they say nothing the model can hold: ``profile``'s own
  share is kept (a share of 1 would price every batch alike)."""

  def line(share: float) -> tuple[float, float]:
    prof, p = dataclasses.replace(profile, fixed_share=share), profile.batch_per_device
    at_p, at_2p = (one_device_compute_ms(GroupCost(group, prof, policies, b)) for b in (p, 2 * p))
    slope = (at_2p - at_p) / p
    return at_p - slope * p, slope

  xs = sorted(points)
  if len(xs) < 2:
    raise ValueError(f"fit_fixed_share needs points at two batches or more, got {dict(points)}.")
  mean_x = sum(xs) / len(xs)
  mean_y = sum(points[b] for b in xs) / len(xs)
  beta = sum((b - mean_x) * (points[b] - mean_y) for b in xs) / sum((b - mean_x) ** 2 for b in xs)
  if beta <= 0:
    return profile.fixed_share
  rho = (mean_y - beta * mean_x) / beta
  (a0, b0), (a1, b1) = line(0.0), line(1.0)
  den = (a1 - a0) - rho * (b1 - b0)
  share = (rho * b0 - a0) / den if den else math.inf
  return max(0.0, share) if share < 1.0 else profile.fixed_share


def fit_profile(profile: Profile) -> Profile:
  """``profile`` with its remainder, memory corrections and fixed share fitted to the
  measurements its meta records: ``fit_preset`` and ``fit_step_ms`` (the median of the fit
  step's round medians), ``fp32_xla_peak_bytes`` and, where compiled, ``bf16_xla_peak_bytes``;
  where timed, ``fit_step_small_ms`` at ``fit_small_batch`` (else the fixed share is 0)."""
  meta = profile.meta
  # the remainder is fitted at the profiled batch, where the fixed share changes nothing
  out = fit_remainder(profile, meta["fit_preset"], meta["fit_step_ms"])
  fixed = 0.0
  if "fit_step_small_ms" in meta:
    policies = PrecisionPolicy.uniform(meta["fit_preset"]).resolve(out.op_names)
    points = {out.batch_per_device: meta["fit_step_ms"], meta["fit_small_batch"]: meta["fit_step_small_ms"]}
    fixed = fit_fixed_share(out, policies, points)
  out = dataclasses.replace(out, fixed_share=fixed)
  return fit_memory(out, meta.get("fp32_xla_peak_bytes"), meta.get("bf16_xla_peak_bytes"))
