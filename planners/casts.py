"""Cast models: ``ms = a·numel + b`` per cast type, measured on standalone jitted casts or
modeled from the catalog (roofline). A ``Profile`` keeps one per cast type
(``planners.profiler``); the replay charges the conversions no profiled leg contains
(``planners.graph.cast_ms``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantize import dequantize, quantize
from planners import catalog, step
from qsync_jax.precision import QUANTIZED_PRECISIONS
from qsync_jax.qdot import FLOAT_DTYPES, qformat

CAST_TYPES = (
  "fp32->bf16",
  "fp32->fp16",
  "fp32->int8",
  "fp32->fp8",
  "fp32->int8:sr",
  "fp32->fp8:sr",
  "bf16->fp32",
  "fp16->fp32",
  "int8->fp32",
  "fp8->fp32",
)


@dataclasses.dataclass(frozen=True)
class CastModel:
  """``ms = a · numel + b`` for one cast type; ``rel_error`` is the RMS relative fit error."""

  a: float
  b: float
  rel_error: float
  source: str = "measured"

  def ms(self, numel: float) -> float:
    return self.a * numel + self.b


def fit_cast_model(numels: Sequence[float], times_ms: Sequence[float], source: str = "measured") -> CastModel:
  """Least-squares ``ms = a·numel + b`` and its relative RMS error."""
  x, y = np.asarray(numels, np.float64), np.asarray(times_ms, np.float64)
  design = np.stack([x, np.ones_like(x)], axis=1)
  (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
  rel = np.sqrt(np.mean(((design @ np.array([a, b]) - y) / y) ** 2))
  return CastModel(float(a), float(b), float(rel), source)


def _cast_fn(cast_type: str):
  src, dst = cast_type.split("->")
  dst, _, sr = dst.partition(":")
  if dst in QUANTIZED_PRECISIONS:  # two passes: absmax, then scale and round
    fmt = qformat(dst, bool(sr))  # stochastic rounding is for gradients (e5m2 in fp8)
    key = jax.random.key(0) if sr else None
    rounding = "stochastic" if sr else "nearest"
    return lambda x: quantize(x, fmt, tuple(range(x.ndim)), rounding, key), jnp.float32
  if src in QUANTIZED_PRECISIONS:
    dtype = jnp.int8 if src == "int8" else jnp.float8_e4m3fn
    scale = jnp.ones((1,), jnp.float32)
    return lambda x: dequantize(x, scale), dtype
  src_dtype = FLOAT_DTYPES.get(src, jnp.float32)
  dst_dtype = FLOAT_DTYPES.get(dst, jnp.float32)
  return lambda x: x.astype(dst_dtype), src_dtype


def cast_precisions(cast_type: str) -> tuple[str, str]:
  """``(source, destination)`` precision of a cast type such as ``"fp32->int8:sr"``."""
  src, dst = cast_type.split(":")[0].split("->")
  return src, dst


def measure_casts(
  sizes=(2**14, 2**16, 2**18, 2**20), repeats=10, overhead=0.0, clock="wall", precisions=None
) -> dict[str, CastModel]:
  """A fitted ``CastModel`` per cast type (those between ``precisions``, default all), from
  standalone jitted casts of ``sizes`` elements."""
  models = {}
  for cast_type in CAST_TYPES:
    if precisions is not None and not set(cast_precisions(cast_type)) <= {"fp32", *precisions}:
      continue
    fn, dtype = _cast_fn(cast_type)
    f = jax.jit(fn)
    times = []
    for size in sizes:
      x = jax.random.normal(jax.random.key(size), (size,), jnp.float32).astype(dtype)
      times.append(max(step.timed_ms(lambda f=f, x=x: f(x), repeats, clock=clock)[0] - overhead, 1e-4))
    models[cast_type] = fit_cast_model(sizes, times)
  return models


def modeled_cast(spec: catalog.DeviceSpec, cast_type: str) -> CastModel:
  """Roofline cast model: bytes read + written over bandwidth, plus one launch."""
  src, dst = cast_precisions(cast_type)
  nbytes = (
    catalog.BYTES[src] + catalog.BYTES[dst] + (catalog.BYTES[src] if dst in QUANTIZED_PRECISIONS else 0)
  )
  return CastModel(
    nbytes / (spec.mem_bw_gbps * 1e9 * spec.derate) * 1e3, spec.launch_us * 1e-3, 0.0, "modeled"
  )
