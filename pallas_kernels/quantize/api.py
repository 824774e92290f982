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

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels._platform import ImplOverride, compiles, gpu_arch, on_gpu
from pallas_kernels.arch import arch_kernels
from pallas_kernels.quantize import kernel as _kernel
from pallas_kernels.quantize import pair_kernel as _pair_kernel
from pallas_kernels.quantize.config import QuantizeConfig
from pallas_kernels.quantize.noise import pair_noise, seed_words
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


def use_kernels(impl: str) -> bool:
  """Whether a call with ``impl`` runs the Pallas kernels: ``"pallas"``, or ``"auto"`` (after a
  ``use_impl`` block's choice) where ``kernels_run_here``."""
  if impl == "auto" and _override.current:
    impl = _override.current
  return impl == "pallas" or (impl == "auto" and kernels_run_here())


def _probe():
  """Lowers and compiles, on a tiny bf16 case, the per-row kernel and the kernel that writes an
  operand in both GEMM layouts (``quantize_both``)."""
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
  jax.jit(lambda v: _pallas(v, "int8", (1,), "nearest", None, None, None, None, False)).lower(x).compile()
  both = lambda v: _pallas_both(v, "int8", (1,), "nearest", None, (1,), None, False)  # noqa: E731
  return jax.jit(both).lower(x).compile()


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
  with jax.named_scope("quantize_absmax"):
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
    layout="transposed" if transpose else "same",
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
  if use_kernels(impl):
    try:
      return _pallas(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes, config, interpret)
    except NotImplementedError:
      pass
  return _reference(x, fmt, reduce_axes, rounding, key, in_scale, contract_axes)


def _other_perm(ndim: int, contract: tuple[int, ...]) -> tuple[int, ...]:
  """The layout of ``quantize_both``'s second copy: ``contract`` first (in increasing order),
  the other axes last — contraction-major for a GEMM that contracts those other axes."""
  rest = tuple(a for a in range(ndim) if a not in contract)
  return _moved_perm(ndim, rest)


def both_layout_view(x, contract: tuple[int, ...], what: str) -> tuple[int, int, str]:
  """``(rows, cols, contract_side)`` of the 2-D view a both-layout kernel takes of ``x``: the
  contracted axes ``contract`` a suffix (``"cols"``) or a prefix (``"rows"``) of a float tensor's axes;
  ``NotImplementedError`` naming ``what`` for anything else."""
  ndim, n = x.ndim, len(contract)
  if not jnp.issubdtype(x.dtype, jnp.floating) or not 0 < n < ndim:
    raise NotImplementedError(f"{what} kernel takes a float tensor with free and contracted axes")
  if contract == tuple(range(ndim - n, ndim)):
    k, contract_side = ndim - n, "cols"
  elif contract == tuple(range(n)):
    k, contract_side = n, "rows"
  else:
    raise NotImplementedError(f"contract_axes={contract} is neither a prefix nor a suffix")
  return math.prod(x.shape[:k]), math.prod(x.shape[k:]), contract_side


def _pallas_both(x, fmt, reduce_axes, rounding, key, contract, config, interpret):
  """The kernel path of ``quantize_both``: an XLA absmax, then one pass writing both copies;
  ``NotImplementedError`` for what it does not take."""
  ndim, shape = x.ndim, x.shape
  rows, cols, contract_side = both_layout_view(x, contract, "quantize_both")
  red = tuple(sorted(reduce_axes))
  if red == tuple(sorted(contract)):
    scale_axis = "rows" if contract_side == "cols" else "cols"  # per channel: along the free side
  elif len(red) == ndim:
    scale_axis = "cols"  # per tensor, broadcast
  else:
    raise NotImplementedError(f"reduce_axes={reduce_axes}: neither per channel nor per tensor")
  with jax.named_scope("quantize_absmax"):
    scale = absmax_scale(x, fmt, red)
  vector = jnp.broadcast_to(scale.reshape(-1), (rows if scale_axis == "rows" else cols,))
  seed = seed_words(key) if rounding == "stochastic" else None
  same, transposed = _kernel.quantize_tiled(
    x.reshape(rows, cols),
    fmt,
    vector,
    scale_axis=scale_axis,
    seed=seed,
    layout="both",
    config=config,
    interpret=interpret,
  )
  q_last, q_first = both_layout_split(same, transposed, shape, contract, contract_side)
  last, first = _moved_perm(ndim, contract), _other_perm(ndim, contract)
  return (q_last, jnp.transpose(scale, last)), (q_first, jnp.transpose(scale, first))


def both_layout_split(same, transposed, shape, contract, contract_side):
  """The two copies ``quantize_tiled(..., layout="both")`` writes of ``both_layout_view``'s 2-D view
  of an ``x`` of ``shape``, in ``x``'s axes: ``(q with the contraction last, q with it first)``,
  i.e. ``jnp.transpose(q, _moved_perm(...))`` and ``jnp.transpose(q, _other_perm(...))``."""
  last, first = _moved_perm(len(shape), contract), _other_perm(len(shape), contract)
  # the 2-D view's own layout is x's: contraction last when the contraction is its column side
  q_last, q_first = (same, transposed) if contract_side == "cols" else (transposed, same)
  return q_last.reshape(tuple(shape[a] for a in last)), q_first.reshape(tuple(shape[a] for a in first))


def quantize_both(
  x,
  fmt,
  reduce_axes,
  rounding="nearest",
  key=None,
  *,
  contract_axes: Sequence[int],
  impl: str = "auto",
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """One quantization of ``x`` in the two layouts its two GEMMs read: ``((q, scale), (q_other,
  scale_other))``. Equivalent to::

    q, scale = quantize_reference(x, fmt, reduce_axes, rounding, key)
    last = (axes not in contract_axes) + contract_axes      # contraction last
    first = contract_axes (increasing) + (the other axes)   # the other axes last
    ((transpose(q, last), transpose(scale, last)), (transpose(q, first), transpose(scale, first)))

  An 8-bit forward product ``Y = X·W`` reads ``q``; the weight gradient ``Xᵀ·dY`` contracts X's
  other axes and reads ``q_other``, which the forward keeps as its residual. On a GPU (``impl``,
  ``config``, ``interpret`` as for ``quantize``) the scale is an XLA reduction and one kernel
  pass reads ``x`` once and writes both copies (``kernel.quantize_tiled(layout='both')``); where
  the kernel does not apply (the contraction neither a prefix nor a suffix of the axes, scales
  neither per channel over the contraction nor per tensor) XLA transposes the reference.
  """
  contract = tuple(contract_axes)
  reduce_axes, contract = _validate(x, fmt, reduce_axes, rounding, key, None, contract, impl)
  if use_kernels(impl):
    try:
      return _pallas_both(x, fmt, reduce_axes, rounding, key, contract, config, interpret)
    except NotImplementedError:
      pass
  q, scale = quantize_reference(x, fmt, reduce_axes, rounding, key)
  last, first = _moved_perm(x.ndim, contract), _other_perm(x.ndim, contract)
  return (
    (jnp.transpose(q, last), jnp.transpose(scale, last)),
    (jnp.transpose(q, first), jnp.transpose(scale, first)),
  )


def _pallas_pair(x, fmt, split, rounding, key, in_scales, config, interpret):
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
  seeds = seed_words(key) if rounding == "stochastic" else None
  q_rows, q_cols = _pair_kernel.pair_quantize(
    x2, fmt, col_in, row_in, row_scale, col_scale, seeds=seeds, config=config, interpret=interpret
  )
  ones_head, ones_tail = (1,) * len(head), (1,) * len(tail)
  return (
    (q_rows.reshape(shape), row_scale.reshape(head + ones_tail)),
    (q_cols.reshape(tail + head), col_scale.reshape(tail + ones_head)),
  )


def _reference_pair(x, fmt, split, rounding, key, in_scales):
  noise_rows = noise_cols = None
  if rounding == "stochastic":
    noise_rows, noise_cols = pair_noise(key, x.shape)
  head, tail = tuple(range(split)), tuple(range(split, x.ndim))
  out = []
  for axes, noise, in_scale in ((tail, noise_rows, in_scales[0]), (head, noise_cols, in_scales[1])):
    q, s = quantize_reference(x, fmt, axes, rounding, key, in_scale, noise)
    perm = _moved_perm(x.ndim, axes)
    out.append((jnp.transpose(q, perm), jnp.transpose(s, perm)))
  return tuple(out)


def quantize_pair(
  x,
  fmt,
  split: int,
  rounding="nearest",
  key=None,
  *,
  in_scales=(None, None),
  impl: str = "auto",
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """``x`` quantized per row and per column of its 2-D view at axis ``split``, each copy laid
  out contraction-major. Equivalent to::

    head, tail = tuple(range(split)), tuple(range(split, x.ndim))
    a, b = noise.pair_noise(key, x.shape) if rounding == "stochastic" else (None, None)
    q, s = quantize_reference(x, fmt, tail, rounding, in_scale=in_scales[0], noise=a)  # per row
    q2, s2 = quantize_reference(x, fmt, head, rounding, in_scale=in_scales[1], noise=b)  # per column
    ((q, s), (moved(q2), moved(s2)))   # moved: the head axes last

  That is how the two gradient GEMMs of a product read its output gradient. Stochastic
  rounding draws both copies' numbers from one hash per element (``noise.pair_noise``).
  Where ``in_scales[0]`` varies only along the tail axes and ``in_scales[1]`` only along the
  head axes, the kernels (``impl`` and ``interpret`` as for ``quantize``) make both copies in
  two passes over ``x`` (``pair_kernel``) instead of four.
  """
  if not hasattr(x, "ndim") or not 0 < split < x.ndim:
    raise ValueError(f"split={split!r} must be an axis 1..ndim-1 of x (rank {getattr(x, 'ndim', None)}).")
  head, tail = tuple(range(split)), tuple(range(split, x.ndim))
  for in_scale, axes in ((in_scales[0], tail), (in_scales[1], head)):
    _validate(x, fmt, axes, rounding, key, in_scale, axes, impl)
  if use_kernels(impl):
    try:
      return _pallas_pair(x, fmt, split, rounding, key, in_scales, config, interpret)
    except NotImplementedError:
      pass
  return _reference_pair(x, fmt, split, rounding, key, in_scales)


def dequantize(qvalue, scale, dtype=None):
  """``qvalue * scale`` in ``dtype`` (float32 by default); XLA fuses it into its consumer."""
  return dequantize_reference(qvalue, scale, jnp.float32 if dtype is None else dtype)


__all__ = ["quantize", "quantize_both", "quantize_pair", "dequantize", "IMPLS"]
