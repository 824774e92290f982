"""Picks the implementation of quantize: the Pallas kernels on a GPU, the jnp reference elsewhere.

``quantize(x, fmt, reduce_axes, rounding, key)`` is ``reference.quantize_reference`` (same
arguments, same result layout) with two optional extras the training GEMMs use:

* ``in_scale``: ``x`` is a quantized value, re-quantized as ``x * in_scale`` (no float copy).
* ``contract_axes``: return ``qvalue`` and ``scale`` with these axes moved last (in this
  order), i.e. laid out contraction-major for the GEMM that reads them. The kernels write
  that layout directly; the reference path lets XLA transpose.

On a GPU whose architecture runs the Pallas kernels (``pallas_kernels.arch.KERNELS``: Triton
needs sm80 or newer) the kernels take 2-D-flattenable cases: scales per row (``reduce_axes`` a suffix
of the axes), per column (a prefix) or per tensor; other cases, and any shape a kernel
cannot tile, run the reference. Stochastic rounding draws the same numbers in both: a
counter-based hash of the element's index seeded from ``key`` (``noise.uniform_noise``;
the kernels compute it in-kernel).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels._platform import ImplOverride, compiles, gpu_arch, on_gpu
from pallas_kernels.arch import arch_kernels
from pallas_kernels.quantize import kernel as _kernel
from pallas_kernels.quantize import pair_kernel as _pair_kernel
from pallas_kernels.quantize.config import QuantizeConfig
from pallas_kernels.quantize.noise import seed_words
from pallas_kernels.quantize.reference import (
  QFORMATS,
  absmax_scale,
  dequantize_reference,
  quantize_reference,
)

IMPLS = ("auto", "pallas", "reference")

_override = ImplOverride(IMPLS)
use_impl = _override.use
"""``with use_impl("reference"): ...``: calls traced in the block use that implementation."""


def kernels_run_here() -> bool:
  """Whether ``impl='auto'`` runs the Pallas kernels: on a GPU whose architecture's entry of
  ``pallas_kernels.arch.KERNELS`` names them (and, where no test ran them there, a tiny
  instance compiles)."""
  if not on_gpu():
    return False
  arch = gpu_arch()
  entry = arch_kernels(arch) if arch else None
  if entry is None or entry.quantize != "pallas":
    return False
  return "pallas" in entry.tested or compiles("pallas quantize", arch, _probe)


def _probe():
  """Lowers and compiles the quantize kernel on a tiny bf16 case."""
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
  return jax.jit(lambda v: _pallas(v, "int8", (1,), "nearest", None, None, None, None, False)).lower(x).compile()


def _normalize_axes(axes, ndim: int, name: str) -> tuple[int, ...]:
  try:
    out = tuple(int(a) + ndim if int(a) < 0 else int(a) for a in axes)
  except TypeError:
    raise ValueError(f"{name}={axes!r} must be a sequence of axis indices.") from None
  if any(a < 0 or a >= ndim for a in out) or len(set(out)) != len(out):
    raise ValueError(f"{name}={tuple(axes)!r} must be distinct axes of an array of rank {ndim}.")
  return out


def _moved_perm(ndim: int, contract: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(a for a in range(ndim) if a not in contract) + tuple(contract)


def _validate(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes, impl):
  if not hasattr(x, "ndim"):
    raise ValueError(f"x must be an array, got {type(x).__name__}.")
  if fmt not in QFORMATS:
    raise ValueError(f"fmt={fmt!r} is not one of {sorted(QFORMATS)}.")
  if rounding not in ("nearest", "stochastic"):
    raise ValueError(f"rounding={rounding!r} must be 'nearest' or 'stochastic'.")
  if rounding == "stochastic" and key is None:
    raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...).")
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}.")
  reduce_axes = _normalize_axes(reduce_axes, x.ndim, "reduce_axes")
  if contract_axes is not None:
    contract_axes = _normalize_axes(contract_axes, x.ndim, "contract_axes")
  if in_scale is not None:
    if getattr(in_scale, "ndim", None) != x.ndim or any(
      s not in (1, d) for s, d in zip(in_scale.shape, x.shape)
    ):
      raise ValueError(
        f"in_scale of shape {getattr(in_scale, 'shape', None)} must have x's rank {x.ndim} and "
        f"broadcast against x's shape {x.shape}."
      )
  return reduce_axes, contract_axes


def _reference(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes):
  qvalue, scale = quantize_reference(x, fmt, reduce_axes, rounding, key, in_scale)
  if contract_axes is not None:
    perm = _moved_perm(x.ndim, contract_axes)
    qvalue, scale = jnp.transpose(qvalue, perm), jnp.transpose(scale, perm)
  return qvalue, scale


def _side_vector(in_scale, k: int, shape, side: str):
  """``in_scale`` as the float32 vector of one side ('rows' or 'cols') of the 2-D view split at
  axis ``k``; raises ``NotImplementedError`` if it varies along the other side."""
  ndim = len(shape)
  own = range(k) if side == "rows" else range(k, ndim)
  if any(s != 1 and a not in own for a, s in enumerate(in_scale.shape)):
    raise NotImplementedError(f"in_scale varies off the {side} side of the 2-D view")
  target = tuple(shape[a] if a in own else 1 for a in range(ndim))
  return jnp.broadcast_to(in_scale.astype(jnp.float32), target).reshape(math.prod(target))


def _in_scale_vector(in_scale, k: int, shape):
  """``(vector, 'rows'|'cols')`` for a 2-D view split at axis ``k``, or raises."""
  if in_scale is None:
    return None, None
  for side in ("cols", "rows"):
    try:
      return _side_vector(in_scale, k, shape, side), side
    except NotImplementedError:
      pass
  raise NotImplementedError("in_scale varies along both sides of the 2-D view")


def _pallas(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes, config, interpret):
  """The kernel path; raises ``NotImplementedError`` for what the kernels do not take."""
  ndim, shape = x.ndim, x.shape
  red = tuple(sorted(reduce_axes))
  if ndim == 0 or not red:
    raise NotImplementedError("quantize kernel needs at least one reduced axis")
  if not (jnp.issubdtype(x.dtype, jnp.floating) or in_scale is not None):
    raise NotImplementedError(f"quantize kernel takes float input (or in_scale), got {x.dtype}")
  n = len(red)
  if red == tuple(range(ndim - n, ndim)) and n < ndim:
    mode, k = "rows", ndim - n
  elif red == tuple(range(n)) and n < ndim:
    mode, k = "cols", n
  elif n == ndim:
    mode, k = "tensor", None
  else:
    raise NotImplementedError(f"reduce_axes={reduce_axes} is neither a prefix nor a suffix")

  # Where the 2-D view is split, and whether the output is its transpose.
  contract = None if contract_axes is None else tuple(contract_axes)
  transpose = False
  if contract is not None and contract != tuple(range(ndim - len(contract), ndim)):
    if contract != tuple(range(len(contract))):
      raise NotImplementedError(f"contract_axes={contract} is neither a prefix nor a suffix")
    transpose = True
    if mode == "rows":
      raise NotImplementedError("per-row scales with a leading contraction")
    k = len(contract) if mode == "tensor" else k
    if mode == "cols" and k != len(contract):
      raise NotImplementedError("contract_axes differ from reduce_axes")
  if k is None:
    k = max(ndim - 1, 1) if ndim > 1 else 0
  rows, cols = math.prod(shape[:k]), math.prod(shape[k:])
  x2 = x.reshape(rows, cols)
  in_vec, in_axis = _in_scale_vector(in_scale, k, shape)
  seed = seed_words(key) if rounding == "stochastic" else None
  scale_shape = tuple(1 if a in red else d for a, d in enumerate(shape))

  if mode == "rows":
    q2, s = _kernel.quantize_rows(
      x2, fmt, in_scale=in_vec, in_scale_axis=in_axis, seed=seed, config=config, interpret=interpret
    )
    return q2.reshape(shape), s.reshape(scale_shape)

  # Known scale: an XLA reduction for the absmax, then one kernel pass.
  value = x if in_scale is None else dequantize_reference(x, in_scale)
  scale = absmax_scale(value, fmt, red)
  scale_cols = jnp.broadcast_to(scale.reshape(-1) if mode == "cols" else scale.reshape(1), (cols,))
  q2 = _kernel.quantize_tiled(
    x2,
    fmt,
    scale_cols,
    in_scale=in_vec,
    in_scale_axis=in_axis,
    seed=seed,
    transpose=transpose,
    config=config,
    interpret=interpret,
  )
  if transpose:
    perm = _moved_perm(ndim, contract)
    return q2.reshape(tuple(shape[a] for a in perm)), jnp.transpose(scale, perm)
  return q2.reshape(shape), scale


def quantize(
  x,
  fmt,
  reduce_axes,
  rounding="nearest",
  key=None,
  *,
  in_scale=None,
  contract_axes: Sequence[int] | None = None,
  impl: str = "auto",
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """``(qvalue, scale)`` with ``x ≈ qvalue * scale``; see ``reference.quantize_reference``.

  Args:
    x, fmt, reduce_axes, rounding, key: as for ``quantize_reference``.
    in_scale: ``x`` is a quantized value and ``x * in_scale`` is quantized.
    contract_axes: move these axes last in ``qvalue`` and ``scale`` (contraction-major).
    impl: 'auto' (the kernels on a GPU where they apply, else the reference), 'pallas'
      (the kernels wherever they apply, e.g. on the CPU with ``interpret=True``) or
      'reference'.
    config: the kernels' block sizes (default: ``config.default_config``).
    interpret: run the Pallas kernels in interpret mode (CPU tests).
  """
  reduce_axes, contract_axes = _validate(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes, impl)
  if impl == "auto" and _override.current:
    impl = _override.current
  use_kernel = impl == "pallas" or (impl == "auto" and kernels_run_here())
  if use_kernel:
    try:
      return _pallas(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes, config, interpret)
    except NotImplementedError:
      pass
  return _reference(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes)


def _pallas_pair(x, fmt, split, rounding, keys, in_scales, config, interpret):
  """The two-pass kernel path of ``quantize_pair``; raises ``NotImplementedError`` for what
  it does not take."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise NotImplementedError(f"quantize_pair kernel takes float input, got {x.dtype}")
  shape = x.shape
  head, tail = tuple(shape[:split]), tuple(shape[split:])
  rows, cols = math.prod(head), math.prod(tail)
  col_in = (
    jnp.ones((cols,), jnp.float32)
    if in_scales[0] is None
    else _side_vector(in_scales[0], split, shape, "cols")
  )
  row_in = (
    jnp.ones((rows,), jnp.float32)
    if in_scales[1] is None
    else _side_vector(in_scales[1], split, shape, "rows")
  )
  x2 = x.reshape(rows, cols)
  row_scale, col_scale = _pair_kernel.pair_scales(x2, fmt, col_in, row_in, config=config, interpret=interpret)
  seeds = None
  if rounding == "stochastic":
    seeds = jnp.concatenate([seed_words(keys[0]), seed_words(keys[1])])
  q_rows, q_cols = _pair_kernel.pair_quantize(
    x2, fmt, col_in, row_in, row_scale, col_scale, seeds=seeds, config=config, interpret=interpret
  )
  ones_head, ones_tail = (1,) * len(head), (1,) * len(tail)
  return (
    (q_rows.reshape(shape), row_scale.reshape(head + ones_tail)),
    (q_cols.reshape(tail + head), col_scale.reshape(tail + ones_head)),
  )


def quantize_pair(
  x,
  fmt,
  split: int,
  rounding="nearest",
  keys=(None, None),
  *,
  in_scales=(None, None),
  impl: str = "auto",
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """``x`` quantized per row and per column of its 2-D view at axis ``split``, each copy laid
  out contraction-major. Equivalent to::

    head, tail = tuple(range(split)), tuple(range(split, x.ndim))
    (quantize(x, fmt, tail, rounding, keys[0], in_scale=in_scales[0], contract_axes=tail),
     quantize(x, fmt, head, rounding, keys[1], in_scale=in_scales[1], contract_axes=head))

  That is how the two gradient GEMMs of a product read its output gradient. Where
  ``in_scales[0]`` varies only along the tail axes and ``in_scales[1]`` only along the head
  axes, the kernels (``impl`` and ``interpret`` as for ``quantize``) make both copies in two
  passes over ``x`` (``pair_kernel``) instead of four.
  """
  if not hasattr(x, "ndim") or not 0 < split < x.ndim:
    raise ValueError(f"split={split!r} must be an axis 1..ndim-1 of x (rank {getattr(x, 'ndim', None)}).")
  head, tail = tuple(range(split)), tuple(range(split, x.ndim))
  for key, in_scale, axes in ((keys[0], in_scales[0], tail), (keys[1], in_scales[1], head)):
    _validate(x, fmt, axes, rounding, key, in_scale, axes, impl)
  if impl == "auto" and _override.current:
    impl = _override.current
  if impl == "pallas" or (impl == "auto" and kernels_run_here()):
    try:
      return _pallas_pair(x, fmt, split, rounding, keys, in_scales, config, interpret)
    except NotImplementedError:
      pass
  one = functools.partial(quantize, x, fmt, rounding=rounding, impl=impl, config=config, interpret=interpret)
  return (
    one(tail, key=keys[0], in_scale=in_scales[0], contract_axes=tail),
    one(head, key=keys[1], in_scale=in_scales[1], contract_axes=head),
  )


def dequantize(qvalue, scale, dtype=None):
  """``qvalue * scale`` in ``dtype`` (float32 by default); XLA fuses it into its consumer."""
  return dequantize_reference(qvalue, scale, jnp.float32 if dtype is None else dtype)


__all__ = ["quantize", "quantize_pair", "dequantize", "IMPLS"]
