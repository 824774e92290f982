"""Pallas (Triton backend) kernels that quantize one 2-D tensor two ways in two passes.

A product's output gradient ``x = dY [R, C]`` feeds both gradient GEMMs: ``dX = dY·Wᵀ``
reads it quantized per row (absmax over C, with W's per-column scale folded in), ``dW =
Xᵀ·dY`` per column and transposed to ``[C, R]`` (absmax over R, with X's per-row scale
folded in). Quantized one after the other that takes four reads of ``x``; these two
launches take two, for both copies:

* ``pair_scales``: each ``[br, bc]`` tile's row absmaxes of ``x * col_in`` and column
  absmaxes of ``x * row_in``, as partial maxima that XLA reduces (a ``1/bc`` and ``1/br``
  sized pass);
* ``pair_quantize``: each tile rounded twice, written as a tile of the row copy ``[R, C]``
  and, transposed in registers, of the column copy ``[C, R]``.

Equivalent to ``reference.quantize_reference(x * col_in[None, :], fmt, (1,), rounding,
noise=a)`` and ``quantize_reference(x * row_in[:, None], fmt, (0,), rounding, noise=b)`` with
the second transposed, where ``a, b = noise.pair_noise(key, x.shape)``: stochastic rounding
hashes each element's row-major index of ``x`` once and rounds the row copy with the hash's
high 16 bits, the column copy with its low 16 bits (``noise.pair_uniforms``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._platform import out_struct
from pallas_kernels.quantize.config import QuantizeConfig, default_config
from pallas_kernels.quantize.kernel import block_absmax, check_tile, program_absmax_spec, round_in_kernel
from pallas_kernels.quantize.noise import element_index, pair_uniforms
from pallas_kernels.quantize.reference import QFORMATS, scale_from_absmax


def _absmax_kernel(x_ref, col_in_ref, row_in_ref, row_part_ref, col_part_ref):
  v = x_ref[...].astype(jnp.float32)
  row_part_ref[...] = jnp.max(jnp.abs(v * col_in_ref[...][None, :]), axis=1)
  col_part_ref[...] = jnp.max(jnp.abs(v * row_in_ref[...][:, None]), axis=0)


def _tile_specs(br: int, bc: int):
  """BlockSpecs of ``x``'s tile, ``col_in``'s and ``row_in``'s pieces on the (i, j) grid."""
  return [
    pl.BlockSpec((br, bc), lambda i, j: (i, j)),
    pl.BlockSpec((bc,), lambda i, j: (j,)),
    pl.BlockSpec((br,), lambda i, j: (i,)),
  ]


def _params(cfg: QuantizeConfig):
  return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("fmt", "config", "interpret"))
def pair_scales(
  x: jax.Array,
  fmt: str,
  col_in: jax.Array,
  row_in: jax.Array,
  *,
  config: QuantizeConfig | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """``(row_scale [R], col_scale [C])``: the absmax scales of ``x * col_in[None, :]`` per
  row and of ``x * row_in[:, None]`` per column (``scale_from_absmax``), ``x`` read once."""
  rows, cols = x.shape
  cfg = config or default_config(rows, cols, "tiled")
  check_tile(rows, cols, cfg)
  br, bc = cfg.block_rows, cfg.block_cols
  n_i, n_j = rows // br, cols // bc
  row_part, col_part = pl.pallas_call(
    _absmax_kernel,
    out_shape=(
      out_struct((n_j * rows,), jnp.float32, x, col_in, row_in),
      out_struct((n_i * cols,), jnp.float32, x, col_in, row_in),
    ),
    grid=(n_i, n_j),
    in_specs=_tile_specs(br, bc),
    # partial maxima laid out [n_j, R] and [n_i, C]
    out_specs=(
      pl.BlockSpec((br,), lambda i, j: (j * n_i + i,)),
      pl.BlockSpec((bc,), lambda i, j: (i * n_j + j,)),
    ),
    compiler_params=_params(cfg),
    interpret=interpret,
    name="quantize_pair_absmax",
  )(x, col_in, row_in)
  qmax = QFORMATS[fmt][1]
  row_amax = jnp.max(row_part.reshape(n_j, rows), axis=0)
  col_amax = jnp.max(col_part.reshape(n_i, cols), axis=0)
  return scale_from_absmax(row_amax, qmax), scale_from_absmax(col_amax, qmax)


def _quantize_kernel(*refs, fmt, stochastic, with_absmax, n_cols, br, bc):
  x_ref, col_in_ref, row_in_ref, row_scale_ref, col_scale_ref, *refs = refs
  seed_ref = refs.pop(0) if stochastic else None
  q_rows_ref, q_cols_ref, *amax_refs = refs
  v = x_ref[...].astype(jnp.float32)
  v_rows = v * col_in_ref[...][None, :]
  v_cols = v * row_in_ref[...][:, None]
  if with_absmax:
    amax_refs[0][...] = block_absmax(v_rows)
    amax_refs[1][...] = block_absmax(v_cols)
  y_rows = v_rows / row_scale_ref[...][:, None]
  y_cols = v_cols / col_scale_ref[...][None, :]
  noise_rows = noise_cols = None
  if stochastic:
    rows = pl.program_id(0) * br + jax.lax.broadcasted_iota(jnp.int32, (br, bc), 0)
    cols = pl.program_id(1) * bc + jax.lax.broadcasted_iota(jnp.int32, (br, bc), 1)
    noise_rows, noise_cols = pair_uniforms(seed_ref[0], seed_ref[1], element_index(rows, cols, n_cols))
  q_rows_ref[...] = round_in_kernel(y_rows, fmt, noise_rows)
  q_cols_ref[...] = round_in_kernel(y_cols, fmt, noise_cols).T


@functools.partial(jax.jit, static_argnames=("fmt", "with_absmax", "config", "interpret"))
def pair_quantize(
  x: jax.Array,
  fmt: str,
  col_in: jax.Array,
  row_in: jax.Array,
  row_scale: jax.Array,
  col_scale: jax.Array,
  *,
  seeds: jax.Array | None = None,
  with_absmax: bool = False,
  config: QuantizeConfig | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, ...]:
  """``(q_rows [R, C], q_cols [C, R])``: ``round(x * col_in[None, :] / row_scale[:, None])``
  and the transpose of ``round(x * row_in[:, None] / col_scale[None, :])``, ``x`` read once;
  values beyond a scale's range saturate at the format's largest code.

  ``seeds`` (2 uint32 words, ``noise.seed_words``) turns on stochastic rounding.
  ``with_absmax``: two more outputs, the float32 scalars ``max|x * col_in[None, :]|`` and
  ``max|x * row_in[:, None]|`` (the two copies' inputs; each program writes its tile's, the
  launcher reduces them), e.g. the amaxes behind the next delayed scales.
  """
  rows, cols = x.shape
  cfg = config or default_config(rows, cols, "tiled")
  check_tile(rows, cols, cfg)
  br, bc = cfg.block_rows, cfg.block_cols
  args = [x, col_in, row_in, row_scale, col_scale]
  in_specs = _tile_specs(br, bc) + [
    pl.BlockSpec((br,), lambda i, j: (i,)),
    pl.BlockSpec((bc,), lambda i, j: (j,)),
  ]
  if seeds is not None:
    in_specs.append(pl.BlockSpec((2,), lambda i, j: (0,)))
    args.append(seeds)
  dtype = QFORMATS[fmt][0]
  n_i, n_j = rows // br, cols // bc
  out_shape = [out_struct((rows, cols), dtype, *args), out_struct((cols, rows), dtype, *args)]
  out_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j)), pl.BlockSpec((bc, br), lambda i, j: (j, i))]
  if with_absmax:
    out_shape += [out_struct((n_i * n_j,), jnp.float32, *args)] * 2
    out_specs += [program_absmax_spec(n_j)] * 2
  kernel = functools.partial(
    _quantize_kernel,
    fmt=fmt,
    stochastic=seeds is not None,
    with_absmax=with_absmax,
    n_cols=cols,
    br=br,
    bc=bc,
  )
  out = pl.pallas_call(
    kernel,
    out_shape=tuple(out_shape),
    grid=(n_i, n_j),
    in_specs=in_specs,
    out_specs=tuple(out_specs),
    compiler_params=_params(cfg),
    interpret=interpret,
    name=f"quantize_pair_{fmt}{'_amax' if with_absmax else ''}",
  )(*args)
  if with_absmax:
    return (*out[:2], jnp.max(out[2]), jnp.max(out[3]))
  return out
