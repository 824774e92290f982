"""Quantization at a given per-tensor scale, with the input's absmax as a side output.

Delayed (amax-history) scaling takes a tensor's scale from earlier steps' amaxes, so the scale
is known before the tensor is read, and the tensor's own amax is only needed for the steps
after. These are ``api.quantize_both`` and ``api.quantize_pair`` with the scale given instead of
computed: on a GPU one kernel pass reads the tensor once, writes the codes and each program's
tile absmax (``kernel.quantize_tiled`` / ``pair_kernel.pair_quantize`` with ``with_absmax``),
and a reduction of those ``[n_programs]`` partials gives the amax; no separate absmax pass
over the tensor. Values beyond a scale's range saturate at the format's largest code.
Elsewhere (and for what the kernels do not take) the jnp reference
``reference.quantize_at_scale`` computes the same codes and amax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import api
from pallas_kernels.quantize import kernel as _kernel
from pallas_kernels.quantize import pair_kernel as _pair_kernel
from pallas_kernels.quantize.config import QuantizeConfig
from pallas_kernels.quantize.noise import pair_noise, seed_words
from pallas_kernels.quantize.reference import quantize_at_scale


def _tensor_scale(scale, name: str) -> jax.Array:
  """``scale`` as a float32 scalar, or a ``ValueError`` naming it."""
  if getattr(scale, "size", None) != 1:
    raise ValueError(
      f"{name} of shape {getattr(scale, 'shape', None)} must hold one value (a per-tensor scale). "
      "Fix: pass e.g. jnp.max(history) / qmax."
    )
  return jnp.asarray(scale, jnp.float32).reshape(())


def _pallas_both_at(x, fmt, scale, rounding, key, contract, config, interpret):
  """The kernel path of ``quantize_both_at``; ``NotImplementedError`` for what it does not take."""
  rows, cols, contract_side = api.both_layout_view(x, contract, "quantize_both_at")
  same, transposed, amax = _kernel.quantize_tiled(
    x.reshape(rows, cols),
    fmt,
    jnp.broadcast_to(scale, (cols,)),
    seed=seed_words(key) if rounding == "stochastic" else None,
    layout="both",
    with_absmax=True,
    config=config,
    interpret=interpret,
  )
  return (*api.both_layout_split(same, transposed, x.shape, contract, contract_side), amax)


def quantize_both_at(
  x,
  fmt,
  scale,
  rounding="nearest",
  key=None,
  *,
  contract_axes: Sequence[int],
  impl: str = "auto",
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """``quantize_both`` at a given per-tensor ``scale`` (one value), with ``max|x|``:
  ``((q, s), (q_other, s), amax)``. Equivalent to::

    q, amax = quantize_at_scale(x, fmt, scale, rounding, key)
    s = scale as float32 of shape (1,) * x.ndim
    ((transpose(q, last), s), (transpose(q, first), s), amax)   # last, first: as quantize_both

  On a GPU (``impl``, ``config``, ``interpret`` as for ``api.quantize``) one kernel pass reads
  ``x`` and writes both copies and the per-tile absmaxes; elsewhere, the reference.
  """
  contract = tuple(contract_axes)
  _, contract = api._validate(x, fmt, tuple(range(x.ndim)), rounding, key, None, contract, impl)
  s = _tensor_scale(scale, "scale")
  out = None
  if api.use_kernels(impl):
    try:
      out = _pallas_both_at(x, fmt, s, rounding, key, contract, config, interpret)
    except NotImplementedError:
      pass
  if out is None:
    q, amax = quantize_at_scale(x, fmt, s, rounding, key)
    last, first = api._moved_perm(x.ndim, contract), api._other_perm(x.ndim, contract)
    out = jnp.transpose(q, last), jnp.transpose(q, first), amax
  s_nd = s.reshape((1,) * x.ndim)
  return (out[0], s_nd), (out[1], s_nd), out[2]


def _pallas_pair_at(x, fmt, split, scales, rounding, key, in_scales, config, interpret):
  """The kernel path of ``quantize_pair_at``; ``NotImplementedError`` for what it does not take."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise NotImplementedError(f"quantize_pair_at kernel takes float input, got {x.dtype}")
  shape = x.shape
  rows, cols = math.prod(shape[:split]), math.prod(shape[split:])
  ones = jnp.ones((), jnp.float32)
  col_in = jnp.broadcast_to(ones, (cols,))
  row_in = jnp.broadcast_to(ones, (rows,))
  if in_scales[0] is not None:
    col_in = api._side_vector(in_scales[0], split, shape, "cols")
  if in_scales[1] is not None:
    row_in = api._side_vector(in_scales[1], split, shape, "rows")
  q_rows, q_cols, amax_rows, amax_cols = _pair_kernel.pair_quantize(
    x.reshape(rows, cols),
    fmt,
    col_in,
    row_in,
    jnp.broadcast_to(scales[0], (rows,)),
    jnp.broadcast_to(scales[1], (cols,)),
    seeds=seed_words(key) if rounding == "stochastic" else None,
    with_absmax=True,
    config=config,
    interpret=interpret,
  )
  return q_rows.reshape(shape), q_cols.reshape(shape[split:] + shape[:split]), (amax_rows, amax_cols)


def quantize_pair_at(
  x,
  fmt,
  split: int,
  scales,
  rounding="nearest",
  key=None,
  *,
  in_scales=(None, None),
  impl: str = "auto",
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """``quantize_pair`` at given per-tensor scales ``scales = (row copy's, column copy's)``, with
  each copy's input absmax: ``((q, s0), (q2, s1), (amax0, amax1))``. Equivalent to::

    a, b = noise.pair_noise(key, x.shape) if rounding == "stochastic" else (None, None)
    q, amax0 = quantize_at_scale(x, fmt, scales[0], rounding, in_scale=in_scales[0], noise=a)
    q2, amax1 = quantize_at_scale(x, fmt, scales[1], rounding, in_scale=in_scales[1], noise=b)
    ((q, s0), (moved(q2), s1), (amax0, amax1))   # moved: the head axes last; s*: shape (1,) * ndim

  On a GPU (``impl``, ``config``, ``interpret`` as for ``api.quantize``), where ``in_scales[0]``
  varies only along the tail axes and ``in_scales[1]`` only along the head ones, one kernel pass
  reads ``x`` and writes both copies and the per-tile absmaxes of both inputs.
  """
  if not hasattr(x, "ndim") or not 0 < split < x.ndim:
    raise ValueError(f"split={split!r} must be an axis 1..ndim-1 of x (rank {getattr(x, 'ndim', None)}).")
  head, tail = tuple(range(split)), tuple(range(split, x.ndim))
  for in_scale, axes in ((in_scales[0], tail), (in_scales[1], head)):
    api._validate(x, fmt, axes, rounding, key, in_scale, axes, impl)
  s = tuple(_tensor_scale(v, f"scales[{i}]") for i, v in enumerate(scales))
  out = None
  if api.use_kernels(impl):
    try:
      out = _pallas_pair_at(x, fmt, split, s, rounding, key, in_scales, config, interpret)
    except NotImplementedError:
      pass
  if out is None:
    noises = pair_noise(key, x.shape) if rounding == "stochastic" else (None, None)
    q0, amax0 = quantize_at_scale(x, fmt, s[0], rounding, None, in_scales[0], noises[0])
    q1, amax1 = quantize_at_scale(x, fmt, s[1], rounding, None, in_scales[1], noises[1])
    out = q0, jnp.transpose(q1, tail + head), (amax0, amax1)
  ones = (1,) * x.ndim
  return (out[0], s[0].reshape(ones)), (out[1], s[1].reshape(ones)), out[2]


__all__ = ["quantize_both_at", "quantize_pair_at"]
