"""Pallas (Triton backend) kernels for absmax quantization of a 2-D view ``[rows, cols]``.

Two kernels, each ``interpret``-able on the CPU:

* ``quantize_rows``: one scale per row (absmax over the contiguous axis), fused into one
  launch: each program reads its rows once to find the absmax, then again (from L2) to
  scale, round and store. One pass over HBM where the scale is not known beforehand.
* ``quantize_tiled``: the scale is known (one per column, per row, or one for the tensor,
  computed by an XLA reduction beforehand); one pass over the tensor writing the int8/fp8
  copy, its transpose ``[cols, rows]``, or both, so that each GEMM consuming it reads its
  contraction axis contiguously (Hopper's 8-bit tensor cores need that layout).

Both can re-quantize a quantized input (``in_scale``: the value is ``x * in_scale``) and
round stochastically with random numbers made in-kernel: a counter-based hash of
(seed, element index), ``noise.hash_uniform``, so the stream depends on the element, never
on the tiling, and is the reference's (``noise.uniform_noise``). A kernel that cannot take a shape raises ``NotImplementedError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._platform import out_struct
from pallas_kernels.quantize.config import QuantizeConfig, default_config
from pallas_kernels.quantize.noise import element_index, hash_uniform
from pallas_kernels.quantize.reference import QFORMATS, scale_from_absmax

# -- in-kernel random numbers: ``noise`` (shared with the reference) ----------------------

# -- rounding (the same arithmetic as ``reference.round_to_format``) -----------------------


def _fp8_ulp(y: jax.Array, mantissa_bits: int, min_exp: int):
  """``(ulp, 1/ulp)``: spacing of the fp8 grid at ``|y|``, exact, from float32 bits."""
  e = lax.bitcast_convert_type(jnp.abs(y), jnp.int32) >> 23  # biased exponent of |y|
  e = jnp.maximum(e, min_exp + 127) - mantissa_bits
  ulp = lax.bitcast_convert_type(e << 23, jnp.float32)
  inv_ulp = lax.bitcast_convert_type((254 - e) << 23, jnp.float32)
  return ulp, inv_ulp


_MAGIC = 12582912.0  # 1.5 * 2**23: float32 t + _MAGIC lies in [2**23, 2**24), whose spacing is 1
_MAGIC_BITS = 0x4B400000  # the bits of _MAGIC: bits(t + _MAGIC) - _MAGIC_BITS is that integer


def int8_codes(y: jax.Array, noise: jax.Array | None) -> jax.Array:
  """int8 codes of scaled float32 ``y``: ``clip(round(y), -127, 127)`` (half to even) or, with
  ``noise``, ``clip(floor(y + noise), -127, 127)``, as ``reference.round_to_format`` computes them.

  Adding ``1.5 * 2**23`` rounds a float32 of magnitude below ``2**22`` to an integer, half to
  even, and the sum's bits hold that integer: no float-to-integer conversion and, for nearest
  rounding, no ``floor`` — instructions that run at a quarter of the float rate on a GPU and
  bound these kernels (stochastic rounding keeps one ``floor``). Inputs are first clipped to
  ±128, which changes no code (anything beyond ±127.5 ends at ±127).
  """
  t = jnp.minimum(jnp.maximum(y if noise is None else y + noise, -128.0), 128.0)
  if noise is not None:
    t = jnp.floor(t)
  n = lax.bitcast_convert_type(t + _MAGIC, jnp.int32) - _MAGIC_BITS
  return jnp.minimum(jnp.maximum(n, -127), 127).astype(jnp.int8)


def round_in_kernel(y: jax.Array, fmt: str, noise: jax.Array | None) -> jax.Array:
  """Rounds scaled float32 ``y`` to ``fmt`` (nearest-even, or stochastic with ``noise``)."""
  dtype, qmax, mantissa_bits, min_exp = QFORMATS[fmt]
  if fmt == "int8":
    return int8_codes(y, noise)
  if noise is not None:
    ulp, inv_ulp = _fp8_ulp(y, mantissa_bits, min_exp)
    lower = jnp.floor(y * inv_ulp) * ulp
    y = jnp.where(noise < (y - lower) * inv_ulp, lower + ulp, lower)
  return jnp.minimum(jnp.maximum(y, -qmax), qmax).astype(dtype)


def _noise(seed_ref, rows, cols, n_cols):
  return hash_uniform(seed_ref[0], seed_ref[1], element_index(rows, cols, n_cols))


def check_tile(rows: int, cols: int, cfg: QuantizeConfig) -> None:
  for name, n, b in (("rows", rows, cfg.block_rows), ("cols", cols, cfg.block_cols)):
    if b <= 0 or b & (b - 1) or n % b:
      raise NotImplementedError(
        f"quantize kernel: {name}={n} is not a multiple of the power-of-two block {b}; "
        "the api falls back to the jnp reference for such shapes."
      )


# -- per-row scales, fused absmax -----------------------------------------------------------


def _rows_kernel(*refs, fmt, stochastic, in_kind, n_cols, bc, br):
  x_ref, *refs = refs
  in_ref = refs.pop(0) if in_kind else None
  seed_ref = refs.pop(0) if stochastic else None
  q_ref, s_ref = refs
  row0 = pl.program_id(0) * br
  n_chunks = n_cols // bc
  in_rows = in_ref[...][:, None] if in_kind == "rows" else None

  def value(j):
    v = x_ref[:, pl.ds(j * bc, bc)].astype(jnp.float32)
    if in_kind == "rows":
      v = v * in_rows
    elif in_kind == "cols":
      v = v * in_ref[pl.ds(j * bc, bc)][None, :]
    return v

  def absmax(j, m):
    return jnp.maximum(m, jnp.max(jnp.abs(value(j)), axis=1))

  amax = lax.fori_loop(0, n_chunks, absmax, jnp.zeros((br,), jnp.float32))
  scale = scale_from_absmax(amax, QFORMATS[fmt][1])
  s_ref[...] = scale

  def write(j, carry):
    y = value(j) / scale[:, None]
    noise = None
    if stochastic:
      rows = row0 + lax.broadcasted_iota(jnp.int32, (br, bc), 0)
      cols = j * bc + lax.broadcasted_iota(jnp.int32, (br, bc), 1)
      noise = _noise(seed_ref, rows, cols, n_cols)
    q_ref[:, pl.ds(j * bc, bc)] = round_in_kernel(y, fmt, noise)
    return carry

  lax.fori_loop(0, n_chunks, write, 0)


_STATIC = ("fmt", "in_scale_axis", "config", "interpret")
"""The launchers are jitted on their static arguments: a step that quantizes many tensors of one
shape traces and lowers each distinct kernel once (its calls share one lowered function)."""


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_rows(
  x: jax.Array,
  fmt: str,
  *,
  in_scale: jax.Array | None = None,
  in_scale_axis: str | None = None,
  seed: jax.Array | None = None,
  config: QuantizeConfig | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """``(qvalue [R, C], scale [R])``: one absmax scale per row of the 2-D ``x``.

  ``in_scale`` (float32, ``[R]`` if ``in_scale_axis == 'rows'`` else ``[C]``) multiplies
  ``x`` first; ``seed`` (2 uint32 words) turns on stochastic rounding.
  """
  rows, cols = x.shape
  cfg = config or default_config(rows, cols, "rows")
  check_tile(rows, cols, cfg)
  br, bc = cfg.block_rows, cfg.block_cols
  in_kind = in_scale_axis if in_scale is not None else None
  in_specs = [pl.BlockSpec((br, cols), lambda i: (i, 0))]
  args = [x]
  if in_kind == "rows":
    in_specs.append(pl.BlockSpec((br,), lambda i: (i,)))
    args.append(in_scale)
  elif in_kind == "cols":
    in_specs.append(pl.BlockSpec((cols,), lambda i: (0,)))
    args.append(in_scale)
  elif in_kind is not None:
    raise ValueError(f"in_scale_axis={in_scale_axis!r} must be 'rows' or 'cols'.")
  if seed is not None:
    in_specs.append(pl.BlockSpec((2,), lambda i: (0,)))
    args.append(seed)
  kernel = functools.partial(
    _rows_kernel, fmt=fmt, stochastic=seed is not None, in_kind=in_kind, n_cols=cols, bc=bc, br=br
  )
  return pl.pallas_call(
    kernel,
    out_shape=(
      out_struct((rows, cols), QFORMATS[fmt][0], *args),
      out_struct((rows,), jnp.float32, *args),
    ),
    grid=(rows // br,),
    in_specs=in_specs,
    out_specs=(pl.BlockSpec((br, cols), lambda i: (i, 0)), pl.BlockSpec((br,), lambda i: (i,))),
    compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
    interpret=interpret,
    name=f"quantize_rows_{fmt}",
  )(*args)


# -- known scale, one pass, the tensor and/or its transpose --------------------------------

LAYOUTS = ("same", "transposed", "both")
"""What ``quantize_tiled`` writes: ``[R, C]``, ``[C, R]``, or both from one read."""


def _tiled_kernel(*refs, fmt, stochastic, in_kind, scale_axis, layout, with_absmax, n_cols, br, bc):
  x_ref, *refs = refs
  amax_ref = refs.pop() if with_absmax else None
  in_ref = refs.pop(0) if in_kind else None
  scale_ref = refs.pop(0)
  seed_ref = refs.pop(0) if stochastic else None
  v = x_ref[...].astype(jnp.float32)
  if in_kind == "rows":
    v = v * in_ref[...][:, None]
  elif in_kind == "cols":
    v = v * in_ref[...][None, :]
  if with_absmax:
    amax_ref[...] = block_absmax(v)
  y = v / (scale_ref[...][:, None] if scale_axis == "rows" else scale_ref[...][None, :])
  noise = None
  if stochastic:
    rows = pl.program_id(0) * br + lax.broadcasted_iota(jnp.int32, (br, bc), 0)
    cols = pl.program_id(1) * bc + lax.broadcasted_iota(jnp.int32, (br, bc), 1)
    noise = _noise(seed_ref, rows, cols, n_cols)
  q = round_in_kernel(y, fmt, noise)
  if layout == "both":
    refs[0][...] = q
    refs[1][...] = q.T
  else:
    refs[0][...] = q.T if layout == "transposed" else q


def block_absmax(v: jax.Array) -> jax.Array:
  """``max|v|`` of a 2-D tile as a ``[1]`` float32 array: one program's entry of a kernel's
  ``[n_programs]`` side output, which the launcher reduces with ``jnp.max``."""
  return jnp.max(jnp.max(jnp.abs(v), axis=1), axis=0).reshape(1)


def program_absmax_spec(n_j: int):
  """The ``[1]`` block of program ``(i, j)`` in a ``[n_i * n_j]`` array of per-program absmaxes."""
  return pl.BlockSpec((1,), lambda i, j: (i * n_j + j,))


@functools.partial(jax.jit, static_argnames=(*_STATIC, "scale_axis", "layout", "with_absmax"))
def quantize_tiled(
  x: jax.Array,
  fmt: str,
  scale: jax.Array,
  *,
  scale_axis: str = "cols",
  in_scale: jax.Array | None = None,
  in_scale_axis: str | None = None,
  seed: jax.Array | None = None,
  layout: str = "same",
  with_absmax: bool = False,
  config: QuantizeConfig | None = None,
  interpret: bool = False,
):
  """``round(x * in_scale / scale)`` of the 2-D ``x`` with a known scale per column
  (``scale`` ``[C]``, ``scale_axis='cols'``) or per row (``[R]``, ``'rows'``); values beyond
  the scale's range saturate at the format's largest code.

  Returns ``[R, C]`` (``layout='same'``), ``[C, R]`` (``'transposed'``, each tile transposed
  in registers) or the pair ``([R, C], [C, R])`` (``'both'``: one read of ``x`` writes the
  operand and its transpose, as the two GEMMs that contract different axes of it read them).
  ``with_absmax``: one more output, the float32 scalar ``max|x * in_scale|`` (each program
  writes its tile's absmax, the launcher reduces those), e.g. the next delayed scale's amax.
  """
  rows, cols = x.shape
  cfg = config or default_config(rows, cols, "tiled")
  check_tile(rows, cols, cfg)
  if layout not in LAYOUTS or scale_axis not in ("rows", "cols"):
    raise ValueError(
      f"layout={layout!r} must be one of {LAYOUTS}, scale_axis={scale_axis!r} 'rows' or 'cols'."
    )
  br, bc = cfg.block_rows, cfg.block_cols
  in_kind = in_scale_axis if in_scale is not None else None
  in_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
  args = [x]
  if in_kind == "rows":
    in_specs.append(pl.BlockSpec((br,), lambda i, j: (i,)))
    args.append(in_scale)
  elif in_kind == "cols":
    in_specs.append(pl.BlockSpec((bc,), lambda i, j: (j,)))
    args.append(in_scale)
  elif in_kind is not None:
    raise ValueError(f"in_scale_axis={in_scale_axis!r} must be 'rows' or 'cols'.")
  if scale_axis == "rows":
    in_specs.append(pl.BlockSpec((br,), lambda i, j: (i,)))
  else:
    in_specs.append(pl.BlockSpec((bc,), lambda i, j: (j,)))
  args.append(scale)
  if seed is not None:
    in_specs.append(pl.BlockSpec((2,), lambda i, j: (0,)))
    args.append(seed)
  dtype = QFORMATS[fmt][0]
  same = (out_struct((rows, cols), dtype, *args), pl.BlockSpec((br, bc), lambda i, j: (i, j)))
  transposed = (out_struct((cols, rows), dtype, *args), pl.BlockSpec((bc, br), lambda i, j: (j, i)))
  outs = {"same": [same], "transposed": [transposed], "both": [same, transposed]}[layout]
  n_i, n_j = rows // br, cols // bc
  if with_absmax:
    outs.append((out_struct((n_i * n_j,), jnp.float32, *args), program_absmax_spec(n_j)))
  kernel = functools.partial(
    _tiled_kernel,
    fmt=fmt,
    stochastic=seed is not None,
    in_kind=in_kind,
    scale_axis=scale_axis,
    layout=layout,
    with_absmax=with_absmax,
    n_cols=cols,
    br=br,
    bc=bc,
  )
  suffix = {"same": "", "transposed": "_t", "both": "_both"}[layout]
  out = pl.pallas_call(
    kernel,
    out_shape=tuple(o[0] for o in outs),
    grid=(n_i, n_j),
    in_specs=in_specs,
    out_specs=tuple(o[1] for o in outs),
    compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
    interpret=interpret,
    name=f"quantize_tiled_{fmt}{suffix}{'_amax' if with_absmax else ''}",
  )(*args)
  out = tuple(out)
  if with_absmax:
    out = (*out[:-1], jnp.max(out[-1]))
  return out if len(out) > 1 else out[0]
