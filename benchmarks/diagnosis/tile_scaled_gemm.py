"""8-bit GEMMs with fine-grained scales (1×128 activation tiles, 128×128 weight blocks), quantized
on load or beforehand, against XLA bf16 and the library's per-channel path, on the GPU.

  python -m benchmarks.diagnosis.tile_scaled_gemm [--shapes qkv,up,down,head] [--precisions int8,fp8]
      [--reps 10] [--budget-s 240] [--no-sweep] [--cpu-smoke] [--out-jsonl PATH]

An experiment, not part of the library. ``Y[M, N] = X[M, K] · W[K, N]``, X an activation (bf16),
W a weight. Every kernel here is Pallas (Triton backend) with float32 accumulation and the K loop
in steps of ``TILE`` = 128; ``fmt`` is ``int8`` or ``e4m3`` (the ``fp8`` precision). Operands:

* W as ``quantize_weight_blocks`` makes it: codes ``qw [N, K]`` (contraction-major: Hopper's 8-bit
  MMA reads both operands K-major) and one scale per 128×128 block, ``sw [K/128, N/128]``;
  the kernels read it expanded along N (``expand_block_scales``, ``[K/128, N]``: a vector load per
  K step instead of an in-kernel repeat).
* X per 1×128 tile: ``quantize_tiles`` (one Pallas pass: bf16 read once, codes and scales
  written; no tensor-wide absmax) gives ``qx [M, K]`` and ``sx [K/128, M]`` (one scale per row
  and K tile, laid out K-tile-major so that a K step loads a contiguous vector, as DeepGEMM lays
  out its activation scales).

``block_scaled_matmul(..., variant=)``, equivalent to ``block_scaled_matmul_reference``::

    on_load:      qx, sx = quantize_tiles(x) inside the K loop, tile by tile (X given as bf16)
    tile_scaled:  qx, sx given
    for each K block i (128 columns):                    # on_load and tile_scaled
      p = qx[:, i] · qw[:, i]ᵀ                           # int32 (int8) / float32 (e4m3) MMA
      acc += float32(p) * (sx[i][:, None] * sw[i, n // 128][None, :])   # the fp32 promotion
    tile_rows:    qx, sx given; W per column (sw [N], the library's per-channel W): the promotion
                  is acc += float32(p) * sx[i][:, None]; acc * sw[None, :] once after the loop
    per_tensor:   acc = Σ_i qx[:, i] · qw[:, i]ᵀ; acc * sx[:, None] * sw[None, :] once after the loop
                  (sx [M], sw [N]: per-tensor scales broadcast, or the library's per-channel ones)
    y = acc.astype(out_dtype)

``quantize_tiles(x)`` is equivalent to ``quantize_tiles_reference``: per row and K tile
``s = max|x_tile| / qmax`` (1 where 0), codes ``round(x_tile * (1 / s))`` (half to even for int8,
the format's own rounding for e4m3, clipped to ``±qmax``).

The benchmark, per GEMM shape of the GPT at d 2048 and 8192 tokens (``SHAPES``) and per precision,
times with ``benchmarks.kernels.timeit`` (calls issued back to back, inputs rotated to overflow
L2; median and min-max of ``--reps`` samples): ``bf16`` (``x @ w``, bf16 out: the plain Flax
Dense; the baseline of every ratio), ``bf16_f32out`` (float32 accumulator out, then a cast),
``library_fwd`` (``qsync_jax.quantized_dot_general`` at the ``int8`` / ``fp8`` preset, forward:
per-channel absmax passes, ``quantize_both`` of X and W, the GEMM ``impl='auto'`` picks),
``library_gemm`` (that GEMM alone on per-channel codes), ``weight_blocks`` (W's block
quantization, jnp under XLA: in no other case), ``tile_quantize`` (X's one-pass tile quantizer
alone), and per block config (``CONFIGS``; the first for every case, the others as a sweep
while ``--budget-s`` lasts): ``on_load``, ``tile_scaled``, ``tile_quantize+tile_scaled`` (the two
launches from bf16 X; first config only), ``tile_scaled_convert`` (int8, first config only: the
block products converted to float32 by the hardware instruction instead of ``INT_TO_FLOAT``'s
``bits``), ``tile_rows`` and ``per_tensor``. Each case's first output is checked on its first
``CHECK_ROWS`` rows against the float product (``rel_err_float``) and, for the kernels here,
against its jnp reference on the device (``rel_err_reference``). Rows: ``ms`` (median),
``ratio`` = bf16 ms / case ms (above 1: faster than bf16), ``tflops``; appended to
``--out-jsonl`` (default ``benchmarks/results/tile_scaled_gemm.jsonl``) and, where ``$OUT`` is
set, to ``$OUT/tile_scaled_gemm.jsonl``; a table prints last. ``--budget-s`` (default 240 s on a
GPU) skips the cases that would start later. ``--cpu-smoke``: tiny shapes,
the kernels in interpret mode on the CPU, rows only to ``--out-jsonl`` / ``$OUT`` where given.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.common.result_rows import append_rows, result_row, results_path
from benchmarks.kernels import n_sets, timeit
from pallas_kernels.gemm import scaled_dot_general
from pallas_kernels.quantize.kernel import round_in_kernel
from pallas_kernels.quantize.reference import QFORMATS, quantize_reference, round_to_format, scale_from_absmax
from qsync_jax import OpPolicy, quantized_dot_general

TILE = 128
"""Length of an activation scale tile along K, side of a weight scale block, the K step."""
VARIANTS = ("on_load", "tile_scaled", "tile_rows", "per_tensor")
FORMATS = {"int8": "int8", "fp8": "e4m3"}
"""The storage format of X and W at each precision (the library's forward formats)."""
SHAPES = {  # (M, K, N): the GPT at d 2048, 8192 tokens
  "qkv": (8192, 2048, 6144),
  "up": (8192, 2048, 8192),
  "down": (8192, 8192, 2048),
  "head": (8192, 2048, 32768),
}
SMOKE_SHAPES = {"smoke": (128, 256, 256)}
QUANTIZERS = ("weight_blocks", "tile_quantize")
"""Cases that quantize only (no product): no ratio, no check; ``of_bf16`` = ms / bf16 ms."""
CHECK_ROWS = 256
"""Rows of X on which each case's output is checked against the float product and its reference."""
DIMS_NT = (((1,), (1,)), ((), ()))
RESULTS = results_path("tile_scaled_gemm")


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """One program's output tile (powers of two dividing M and N), Triton's warps and pipeline
  depth, and the output-tile rows walked together (grouped order, for L2 reuse)."""

  block_m: int = 128
  block_n: int = 256
  num_warps: int = 8
  num_stages: int = 3
  group_m: int = 8

  @property
  def name(self) -> str:
    return f"{self.block_m}x{self.block_n}_w{self.num_warps}_s{self.num_stages}"


CONFIGS = (
  TileConfig(128, 128, 8, 3),
  TileConfig(64, 256, 8, 3),
  TileConfig(128, 256, 8, 3),
  TileConfig(64, 128, 4, 3),
)
"""The first is every case's; the others are swept while the budget lasts. The promotion variants
hold two float32 tiles (the block product and the running sum): the first two configs keep both in
registers with 8 warps; 128×256 (the library's Triton default, ``per_tensor``'s natural tile) does not."""
SMOKE_CONFIGS = (TileConfig(64, 128, 4, 3), TileConfig(32, 64, 4, 3))
FIRST_CONFIG_ONLY = ("tile_quantize+tile_scaled", "tile_scaled_convert")
"""Cases timed at the first config only (the sweep times the three variants)."""
QUANTIZE_BLOCK_M = 64
"""Rows of one program of ``quantize_tiles`` (one 64×128 tile each)."""


# -- quantization: the jnp definitions -------------------------------------------------------


def _quantize_rows(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """``(codes, scale)`` of float32 ``x [..., r, c]``, one scale per row of its last axis; the
  arithmetic of every quantization here (the kernels run this function on their tiles)."""
  qmax = QFORMATS[fmt][1]
  scale = scale_from_absmax(jnp.max(jnp.abs(x), axis=-1), qmax)
  return x * (1.0 / scale)[..., None], scale


def quantize_tiles_reference(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """``(qx [M, K], sx [K/128, M])``: ``x [M, K]`` quantized per row and 128-column tile."""
  m, k = x.shape
  y, scale = _quantize_rows(x.astype(jnp.float32).reshape(m, k // TILE, TILE), fmt)
  return round_to_format(y, fmt, "nearest").reshape(m, k), scale.T


def quantize_weight_blocks(w: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """``(qw [N, K], sw [K/128, N/128])``: ``w [K, N]`` quantized per 128×128 block, the codes
  written contraction-major."""
  k, n = w.shape
  blocks = w.astype(jnp.float32).T.reshape(n // TILE, TILE, k // TILE, TILE).transpose(0, 2, 1, 3)
  flat = blocks.reshape(n // TILE, k // TILE, TILE * TILE)
  y, scale = _quantize_rows(flat, fmt)
  codes = round_to_format(y, fmt, "nearest").reshape(n // TILE, k // TILE, TILE, TILE)
  return codes.transpose(0, 2, 1, 3).reshape(n, k), scale.T


def expand_block_scales(sw: jax.Array) -> jax.Array:
  """``[K/128, N/128]`` block scales as ``[K/128, N]``: each repeated over its block's 128 columns."""
  return jnp.repeat(sw, TILE, axis=1)


def quantize_per_tensor(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """``(codes, scale [rows])``: ``x [rows, K]`` at one absmax scale (the library's quantizer),
  the scale broadcast to a vector for ``per_tensor``."""
  q, s = quantize_reference(x, fmt, (0, 1))
  return q, jnp.broadcast_to(s.reshape(()), (x.shape[0],))


def block_scaled_matmul_reference(qx, sx, qw, sw, *, variant: str, out_dtype=jnp.float32, x=None):
  """The jnp definition of ``block_scaled_matmul`` (see the module doc): ``on_load`` takes bf16
  ``x`` (``qx``, ``sx`` unused) and quantizes it by ``quantize_tiles_reference``; ``sw`` is
  ``[K/128, N/128]`` for ``on_load`` / ``tile_scaled`` and ``[N]`` for ``tile_rows`` and ``per_tensor``
  (whose ``sx`` is ``[M]``)."""
  if variant == "on_load":
    qx, sx = quantize_tiles_reference(x, _fmt_of(qw))
  acc_dtype = jnp.int32 if qw.dtype == jnp.int8 else jnp.float32
  m, k = qx.shape
  if variant == "per_tensor":
    acc = lax.dot_general(qx, qw, DIMS_NT, preferred_element_type=acc_dtype).astype(jnp.float32)
    return (acc * sx[:, None] * sw[None, :]).astype(out_dtype)
  acc = jnp.zeros((m, qw.shape[0]), jnp.float32)
  for i in range(k // TILE):
    ks = slice(i * TILE, (i + 1) * TILE)
    p = lax.dot_general(qx[:, ks], qw[:, ks], DIMS_NT, preferred_element_type=acc_dtype)
    if variant == "tile_rows":
      acc = acc + p.astype(jnp.float32) * sx[i][:, None]
    else:
      acc = acc + p.astype(jnp.float32) * (sx[i][:, None] * expand_block_scales(sw)[i][None, :])
  if variant == "tile_rows":
    acc = acc * sw[None, :]
  return acc.astype(out_dtype)


def _fmt_of(codes: jax.Array) -> str:
  return next(f for f, (dtype, *_) in QFORMATS.items() if jnp.dtype(dtype) == codes.dtype)


# -- the kernels ------------------------------------------------------------------------------


def _tiles_kernel(x_ref, q_ref, s_ref, *, fmt):
  y, scale = _quantize_rows(x_ref[...].astype(jnp.float32), fmt)
  q_ref[...] = round_in_kernel(y, fmt, None)
  s_ref[...] = scale[None, :]


@functools.partial(jax.jit, static_argnames=("fmt", "block_m", "interpret"))
def quantize_tiles(x: jax.Array, fmt: str, *, block_m: int = QUANTIZE_BLOCK_M, interpret: bool = False):
  """``(qx [M, K], sx [K/128, M])`` of ``x [M, K]``: ``quantize_tiles_reference`` in one pass,
  one program per ``block_m`` × 128 tile."""
  m, k = x.shape
  _check_blocks("quantize_tiles", {"M": (m, block_m), "K": (k, TILE)})
  return pl.pallas_call(
    functools.partial(_tiles_kernel, fmt=fmt),
    out_shape=(
      jax.ShapeDtypeStruct((m, k), QFORMATS[fmt][0]),
      jax.ShapeDtypeStruct((k // TILE, m), jnp.float32),
    ),
    grid=(m // block_m, k // TILE),
    in_specs=[pl.BlockSpec((block_m, TILE), lambda i, j: (i, j))],
    out_specs=(
      pl.BlockSpec((block_m, TILE), lambda i, j: (i, j)),
      pl.BlockSpec((1, block_m), lambda i, j: (j, i)),
    ),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name=f"quantize_tiles_{fmt}",
  )(x)


def _grouped(pid, n_m: int, n_n: int, group_m: int):
  """``(pid_m, pid_n)`` of a 1-D program id, walking ``group_m`` tile rows at a time."""
  width = group_m * n_n
  first_m = (pid // width) * group_m
  size = jnp.minimum(n_m - first_m, group_m)
  return first_m + (pid % width) % size, (pid % width) // size


_MAGIC = 12582912.0
_MAGIC_BITS = 0x4B400000
"""1.5·2²³ and its float32 bits: for an int32 ``p`` with ``|p| < 2²²``, ``bits(p + _MAGIC_BITS)`` is the
float32 ``_MAGIC + p``, so ``float32(p) = bitcast(p + _MAGIC_BITS) − _MAGIC`` exactly."""
INT_TO_FLOAT = ("bits", "convert")
"""How the int8 kernels turn a K block's int32 product into float32 for the promotion: ``bits`` (an
integer and a float add, exact as a block's ``|p| ≤ 128·127² < 2²²``) or ``convert`` (the hardware
conversion, which a GPU runs at a quarter of the float32 rate)."""


def _to_float32(p: jax.Array, int_to_float: str) -> jax.Array:
  if p.dtype == jnp.float32:
    return p
  if int_to_float == "bits":
    return lax.bitcast_convert_type(p + _MAGIC_BITS, jnp.float32) - _MAGIC
  return p.astype(jnp.float32)


def _gemm_kernel(*refs, variant, fmt, n_k, int_to_float):
  if variant == "on_load":
    x_ref, w_ref, sw_ref, o_ref = refs
    sx_ref = None
  else:
    x_ref, sx_ref, w_ref, sw_ref, o_ref = refs
  acc_dtype = jnp.int32 if fmt == "int8" else jnp.float32
  bm, bn = o_ref.shape

  def block_product(i):
    ks = pl.ds(pl.multiple_of(i * TILE, TILE), TILE)
    if variant == "on_load":
      y, sx = _quantize_rows(x_ref[:, ks].astype(jnp.float32), fmt)
      codes = round_in_kernel(y, fmt, None)
    else:
      codes, sx = x_ref[:, ks], None
    p = lax.dot_general(codes, w_ref[:, ks], DIMS_NT, preferred_element_type=acc_dtype)
    return p, sx

  if variant == "per_tensor":
    acc = lax.fori_loop(0, n_k, lambda i, acc: acc + block_product(i)[0], jnp.zeros((bm, bn), acc_dtype))
    out = acc.astype(jnp.float32) * sx_ref[...][:, None] * sw_ref[...][None, :]
  else:

    def body(i, acc):
      p, sx = block_product(i)
      if sx is None:
        sx = sx_ref[i, :]
      if variant == "tile_rows":
        return acc + _to_float32(p, int_to_float) * sx[:, None]
      return acc + _to_float32(p, int_to_float) * (sx[:, None] * sw_ref[i, :][None, :])

    out = lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.float32))
    if variant == "tile_rows":
      out = out * sw_ref[...][None, :]
  o_ref[...] = out.astype(o_ref.dtype)


def _check_blocks(kernel: str, sizes: dict) -> None:
  for name, (n, b) in sizes.items():
    if b <= 0 or b & (b - 1) or n % b:
      raise ValueError(
        f"{kernel}: {name}={n} is not a multiple of the power-of-two block {b}. Fix: pad {name}."
      )


@functools.partial(jax.jit, static_argnames=("variant", "config", "out_dtype", "int_to_float", "interpret"))
def block_scaled_matmul(
  x: jax.Array,
  sx: jax.Array | None,
  qw: jax.Array,
  sw: jax.Array,
  *,
  variant: str,
  config: TileConfig = CONFIGS[0],
  out_dtype=jnp.bfloat16,
  int_to_float: str = "bits",
  interpret: bool = False,
) -> jax.Array:
  """``[M, N]`` ``out_dtype``: ``block_scaled_matmul_reference`` (see the module doc) in one kernel;
  ``int_to_float``: how int8's block products become float32 (``INT_TO_FLOAT``; the same values).

  Args:
    x: ``on_load``: bf16 ``[M, K]`` (``sx`` None); else its codes ``[M, K]``.
    sx: ``tile_scaled`` / ``tile_rows``: ``[K/128, M]`` tile scales; ``per_tensor``: ``[M]``.
    qw: codes ``[N, K]``, the format of ``x``'s (int8 or e4m3).
    sw: ``on_load`` / ``tile_scaled``: ``[K/128, N]`` (``expand_block_scales``); ``tile_rows`` /
      ``per_tensor``: ``[N]``.
  """
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r} is not one of {VARIANTS}.")
  if int_to_float not in INT_TO_FLOAT:
    raise ValueError(f"int_to_float={int_to_float!r} is not one of {INT_TO_FLOAT}.")
  m, k = x.shape
  n = qw.shape[0]
  if qw.shape[1] != k:
    raise ValueError(f"x {x.shape} and qw {qw.shape} disagree on K. Fix: pass qw as [N, K].")
  fmt = _fmt_of(qw)
  bm, bn = config.block_m, config.block_n
  _check_blocks("block_scaled_matmul", {"M": (m, bm), "N": (n, bn), "K": (k, TILE)})
  n_m, n_n = m // bm, n // bn
  group_m = max(1, min(config.group_m, n_m))

  def mn(p):
    return _grouped(p, n_m, n_n, group_m)

  x_spec = pl.BlockSpec((bm, k), lambda p: (mn(p)[0], 0))
  w_spec = pl.BlockSpec((bn, k), lambda p: (mn(p)[1], 0))
  if variant == "per_tensor":
    sx_spec = pl.BlockSpec((bm,), lambda p: (mn(p)[0],))
  else:
    sx_spec = pl.BlockSpec((k // TILE, bm), lambda p: (0, mn(p)[0]))
  if variant in ("per_tensor", "tile_rows"):
    sw_spec = pl.BlockSpec((bn,), lambda p: (mn(p)[1],))
  else:
    sw_spec = pl.BlockSpec((k // TILE, bn), lambda p: (0, mn(p)[1]))
  if variant == "on_load":
    in_specs, args = [x_spec, w_spec, sw_spec], [x, qw, sw]
  else:
    in_specs, args = [x_spec, sx_spec, w_spec, sw_spec], [x, sx, qw, sw]
  return pl.pallas_call(
    functools.partial(_gemm_kernel, variant=variant, fmt=fmt, n_k=k // TILE, int_to_float=int_to_float),
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(n_m * n_n,),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((bm, bn), lambda p: mn(p)),
    compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name=f"block_scaled_matmul_{variant}_{fmt}",
  )(*args)


# -- the benchmark ----------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One benchmark run's settings and rows."""

  reps: int
  interpret: bool
  deadline: float
  device: str
  run_id: str
  outputs: list
  rows: list = dataclasses.field(default_factory=list)
  references: dict = dataclasses.field(default_factory=dict)
  """``{(shape name, precision): {variant: its reference's first rows}}``: the inputs of a shape
  and precision are the same in every pass (``make_operands``' seed)."""


def rel_err(a, b) -> float:
  """``‖a − b‖ / ‖b‖`` in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_operands(shape, precision: str | None, seed: int = 0) -> dict:
  """Device inputs of one shape and precision: ``w`` (bf16 ``[K, N]``, normal / √K) with its
  block, per-channel and per-tensor codes; ``sets``, each one bf16 ``x [M, K]`` (normal, each
  row's scale drawn from 0.1–10, as activations vary by token) with its tile, per-channel and
  per-tensor codes; as many sets as overflow L2 (``benchmarks.kernels.n_sets``). The same
  ``x`` and ``w`` at every precision; ``precision`` None: no codes."""
  m, k, n = shape
  key_w, key_x = jax.random.split(jax.random.key(seed))
  w = _normal(key_w, (k, n), k**-0.5, 0.0)
  xs = [_normal(jax.random.fold_in(key_x, i), (m, k), 1.0, 1.0) for i in range(n_sets(3 * m * k))]
  if precision is None:
    return {"w": w, "sets": [{"x": x} for x in xs]}
  fmt = FORMATS[precision]
  return {
    "fmt": fmt,
    "w": w,
    **_weight_codes(w, fmt),
    "sets": [{"x": x, **_activation_codes(x, fmt)} for x in xs],
  }


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, scale: float, row_spread: float) -> jax.Array:
  """bf16 normal ``shape`` times ``scale``, each row also times ``10 ** U(-row_spread, row_spread)``."""
  kv, kr = jax.random.split(key)
  rows = 10.0 ** jax.random.uniform(kr, (shape[0], 1), jnp.float32, -row_spread, row_spread)
  return (jax.random.normal(kv, shape, jnp.float32) * scale * rows).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames="fmt")
def _weight_codes(w, fmt: str) -> dict:
  qw, sw = quantize_weight_blocks(w, fmt)
  return {
    "qw": qw,
    "sw": sw,
    "sw_cols": expand_block_scales(sw),
    "channel_w": quantize_reference(w.T, fmt, (1,)),
    "column_w": _vector_scale(quantize_reference(w.T, fmt, (1,))),
    "tensor_w": quantize_per_tensor(w.T, fmt),
  }


def _vector_scale(quantized):
  """``(codes, scale [rows, 1])`` as ``(codes, scale [rows])``."""
  return quantized[0], quantized[1][:, 0]


@functools.partial(jax.jit, static_argnames="fmt")
def _activation_codes(x, fmt: str) -> dict:
  return {
    "tiles": quantize_tiles_reference(x, fmt),
    "channel": quantize_reference(x, fmt, (1,)),
    "tensor": quantize_per_tensor(x, fmt),
  }


def kernel_cases(precision: str, ops: dict, config: TileConfig, interpret: bool, sweep: bool) -> list[tuple]:
  """``(case, config name, jitted fn, arg sets, reference variant)`` of the kernels here at
  ``config``, ``on_load`` first (``FIRST_CONFIG_ONLY`` not in a sweep; ``tile_scaled_convert``:
  int8's block products converted to float32 by the hardware instruction)."""
  fmt, sets, qw, sw = ops["fmt"], ops["sets"], ops["qw"], ops["sw_cols"]
  kw = {"config": config, "out_dtype": jnp.bfloat16, "interpret": interpret}
  qw_t, sw_t = ops["tensor_w"]

  def from_bf16(x, qw, sw):
    return block_scaled_matmul(
      *quantize_tiles(x, fmt, interpret=interpret), qw, sw, variant="tile_scaled", **kw
    )

  cases = [
    (
      "on_load",
      "on_load",
      jax.jit(lambda x, qw, sw: block_scaled_matmul(x, None, qw, sw, variant="on_load", **kw)),
      [(s["x"], qw, sw) for s in sets],
    ),
    (
      "tile_scaled",
      "tile_scaled",
      jax.jit(functools.partial(block_scaled_matmul, variant="tile_scaled", **kw)),
      [(*s["tiles"], qw, sw) for s in sets],
    ),
    ("tile_quantize+tile_scaled", "on_load", jax.jit(from_bf16), [(s["x"], qw, sw) for s in sets]),
    (
      "tile_scaled_convert",
      "tile_scaled",
      jax.jit(functools.partial(block_scaled_matmul, variant="tile_scaled", int_to_float="convert", **kw)),
      [(*s["tiles"], qw, sw) for s in sets],
    ),
    (
      "tile_rows",
      "tile_rows",
      jax.jit(functools.partial(block_scaled_matmul, variant="tile_rows", **kw)),
      [(*s["tiles"], *ops["column_w"]) for s in sets],
    ),
    (
      "per_tensor",
      "per_tensor",
      jax.jit(functools.partial(block_scaled_matmul, variant="per_tensor", **kw)),
      [(*s["tensor"], qw_t, sw_t) for s in sets],
    ),
  ]
  return [
    (f"{precision}/{c}", config.name, f, a, ref)
    for c, ref, f, a in cases
    if not (sweep and c in FIRST_CONFIG_ONLY) and not (fmt != "int8" and c == "tile_scaled_convert")
  ]


def other_cases(precision: str, ops: dict, interpret: bool) -> list[tuple]:
  """The library's forward and GEMM, W's block quantization and X's tile quantizer."""
  fmt, sets = ops["fmt"], ops["sets"]
  policy = OpPolicy.preset(precision)
  dims_nn = (((1,), (0,)), ((), ()))
  library_fwd = jax.jit(lambda x, w: quantized_dot_general(x, w, dims_nn, policy, out_dtype=jnp.bfloat16))
  library_gemm = jax.jit(lambda qx, sx, qw, sw: scaled_dot_general(qx, qw, sx, sw, DIMS_NT, jnp.bfloat16))
  qw_c, sw_c = ops["channel_w"]
  return [
    (f"{precision}/library_fwd", "", library_fwd, [(s["x"], ops["w"]) for s in sets], None),
    (f"{precision}/library_gemm", "", library_gemm, [(*s["channel"], qw_c, sw_c) for s in sets], None),
    (
      f"{precision}/weight_blocks",
      "",
      jax.jit(functools.partial(quantize_weight_blocks, fmt=fmt)),
      [(ops["w"],)],
      None,
    ),
    (
      f"{precision}/tile_quantize",
      f"bm{QUANTIZE_BLOCK_M}",
      jax.jit(functools.partial(quantize_tiles, fmt=fmt, interpret=interpret)),
      [(s["x"],) for s in sets],
      None,
    ),
  ]


def bf16_cases(shape, seed: int = 0) -> tuple[list[tuple], dict]:
  """``x @ w`` in bf16 (the plain Dense) and with a float32 accumulator out, then a cast."""
  ops = make_operands(shape, None, seed)
  sets = [(s["x"], ops["w"]) for s in ops["sets"]]
  f32out = jax.jit(
    lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(
      jnp.bfloat16
    )
  )
  return [("bf16", "", jax.jit(lambda x, w: x @ w), sets, None), ("bf16_f32out", "", f32out, sets, None)], ops


def check(out, args, case: str, variant, ops: dict, references: dict) -> dict:
  """The first ``CHECK_ROWS`` rows of a case's output against the float product and, for a
  kernel here, against its jnp reference (computed once per variant: ``references``)."""
  first = ops["sets"][0]
  x = first["x"][:CHECK_ROWS]
  if case.endswith(QUANTIZERS):
    return {}
  got = np.asarray(out[:CHECK_ROWS].astype(jnp.float32))
  exact = np.asarray(x.astype(jnp.float32) @ ops["w"].astype(jnp.float32))
  extra = {"rel_err_float": rel_err(got, exact)}
  if variant is not None:
    if variant not in references:
      if variant == "per_tensor":
        qx, sx = first["tensor"]
        qw, sw = ops["tensor_w"]
        args_ref = (qx[:CHECK_ROWS], sx[:CHECK_ROWS], qw, sw)
      elif variant == "tile_rows":
        qx, sx = first["tiles"]
        args_ref = (qx[:CHECK_ROWS], sx[:, :CHECK_ROWS], *ops["column_w"])
      else:
        qx, sx = first["tiles"]
        args_ref = (qx[:CHECK_ROWS], sx[:, :CHECK_ROWS], ops["qw"], ops["sw"])
      ref = block_scaled_matmul_reference(*args_ref, variant=variant, x=x)
      references[variant] = np.asarray(ref.astype(jnp.bfloat16).astype(jnp.float32))
    extra["rel_err_reference"] = rel_err(got, references[variant])
  return extra


def time_case(run: Run, shape_name: str, shape, case: tuple, ops: dict, references: dict, bf16_ms) -> dict:
  """One case timed and checked: its row (``skipped`` past the deadline, ``failed`` with why)."""
  name, config, fn, arg_sets, variant = case
  m, k, n = shape
  tags = {"run": run.run_id, "shape": f"{m}x{k}x{n}", "config": config}
  full = f"{shape_name}/{name}"
  if time.perf_counter() > run.deadline:
    return result_row("tile_scaled_gemm", full, "skipped", None, None, run.device, reason="budget", **tags)
  try:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*arg_sets[0]))
    first_s = time.perf_counter() - t0
    extra = check(out, arg_sets[0], name, variant, ops, references)
    del out
    med, lo, hi = timeit(fn, arg_sets, run.reps)
  except Exception as e:  # noqa: BLE001 - a case that fails is reported, the others still run
    traceback.print_exception(e, limit=4)
    reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return result_row("tile_scaled_gemm", full, "failed", None, None, run.device, reason=reason, **tags)
  ms = med * 1e3
  is_gemm = not name.endswith(QUANTIZERS)
  if is_gemm:
    extra["tflops"] = 2 * m * k * n / med / 1e12
  elif bf16_ms:
    extra["of_bf16"] = ms / bf16_ms  # a quantizer's time as a fraction of the bf16 product's
  if name.endswith("library_gemm"):
    extra["ran"] = _ran(fn, arg_sets[0])
  return result_row(
    "tile_scaled_gemm",
    full,
    "ms",
    ms,
    bf16_ms if is_gemm else None,
    run.device,
    ratio=bf16_ms / ms if bf16_ms and is_gemm else None,
    ms_min=lo * 1e3,
    ms_max=hi * 1e3,
    first_call_s=first_s,
    sets=len(arg_sets),
    **extra,
    **tags,
  )


def _ran(fn, args) -> str:
  """Which GEMM a jitted call runs: a Mosaic GPU or Triton kernel, or XLA's."""
  hlo = fn.lower(*args).as_text()
  return "mosaic_gpu" if "mosaic_gpu" in hlo else "triton" if "triton" in hlo else "xla"


def record(run: Run, row: dict) -> None:
  run.rows.append(row)
  for path in run.outputs:
    append_rows(path, [row])
  print(table_line(row), flush=True)


def table_line(r: dict) -> str:
  if r["metric"] != "ms":
    return f"{r['case']:44s} {r.get('config', ''):16s} {r['metric']}: {r.get('reason', '')}"
  ratio = f"{r['ratio']:6.2f}" if r.get("ratio") else f"{'-':>6s}"
  tflops = f"{r['tflops']:8.1f}" if r.get("tflops") else f"{'-':>8s}"
  errs = " ".join(f"{r[e]:.4f}" if e in r else "     -" for e in ("rel_err_float", "rel_err_reference"))
  spread = f"[{r['ms_min']:.3f}-{r['ms_max']:.3f}]"
  note = r.get("ran", "") or (f"{r['of_bf16']:.3f} of bf16" if "of_bf16" in r else "")
  return f"{r['case']:44s} {r['config']:16s} {r['value']:8.3f} {spread:>17s} {ratio} {tflops} {errs} {note}"


def table(rows) -> str:
  head = (
    f"{'case':44s} {'config':16s} {'ms':>8s} {'[min-max]':>17s} {'xbf16':>6s} {'TFLOP/s':>8s} "
    f"{'err_f':>6s} {'err_r':>6s}"
  )
  return "\n".join([head] + [table_line(r) for r in rows])


def parse_shapes(text: str, named: dict) -> dict:
  shapes = {}
  for item in (s.strip() for s in text.split(",") if s.strip()):
    if item in named:
      shapes[item] = named[item]
      continue
    parts = item.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
      raise SystemExit(
        f"--shapes {text!r}: {item!r} is neither one of {sorted(named)} nor MxKxN. Fix: e.g. --shapes qkv,8192x2048x4096."
      )
    shapes[item] = tuple(int(p) for p in parts)
  if not shapes:
    raise SystemExit(f"--shapes {text!r} names no shape. Fix: e.g. --shapes {','.join(named)}.")
  for name, (m, k, n) in shapes.items():
    if k % TILE or m % 128 or n % 256 or k & (k - 1):
      raise SystemExit(
        f"--shapes: {name} = {m}x{k}x{n} does not fit the kernels' tiles (M a multiple of 128, N of 256, "
        "K a power of two from 128). Fix: pick such a shape."
      )
  return shapes


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.diagnosis.tile_scaled_gemm", description=__doc__.splitlines()[0]
  )
  ap.add_argument("--shapes", default=None, help=f"names of {list(SHAPES)} or MxKxN, comma-separated")
  ap.add_argument("--precisions", default="int8,fp8", help=f"comma-separated, of {list(FORMATS)}")
  ap.add_argument("--reps", type=int, default=None, help="samples per case (default 10; 2 with --cpu-smoke)")
  ap.add_argument(
    "--budget-s", type=float, default=None, help="later cases are skipped (default 240 on a GPU)"
  )
  ap.add_argument("--no-sweep", action="store_true", help="only the first block config")
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, the kernels interpreted on the CPU")
  ap.add_argument("--out-jsonl", default=None, help=f"default {RESULTS} (none with --cpu-smoke)")
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  if args.cpu_smoke:
    jax.config.update("jax_platforms", "cpu")
  elif jax.default_backend() != "gpu":
    raise SystemExit("tile_scaled_gemm times GPU kernels. Fix: run it on a GPU, or pass --cpu-smoke.")
  precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
  if not precisions or any(p not in FORMATS for p in precisions):
    raise SystemExit(f"--precisions {args.precisions!r}: use some of {list(FORMATS)}, comma-separated.")
  smoke = args.cpu_smoke
  shapes = parse_shapes(args.shapes, SHAPES) if args.shapes else (SMOKE_SHAPES if smoke else SHAPES)
  configs = SMOKE_CONFIGS if smoke else CONFIGS
  budget = args.budget_s if args.budget_s is not None else (float("inf") if smoke else 240.0)
  out = args.out_jsonl or (None if smoke else RESULTS)
  outputs = [
    p for p in (out, os.environ.get("OUT") and os.path.join(os.environ["OUT"], "tile_scaled_gemm.jsonl")) if p
  ]
  device = jax.devices()[0].device_kind
  run = Run(
    args.reps or (2 if smoke else 10),
    smoke,
    t_start + budget,
    device,
    f"tile-{time.strftime('%Y%m%d-%H%M%S')}",
    outputs,
  )
  print(
    f"run {run.run_id} on {jax.default_backend()} ({device}), jax {jax.__version__}, budget {budget} s",
    flush=True,
  )
  print(table([]), flush=True)
  bf16_ms = {}
  passes = [(configs[0], False)] + ([] if args.no_sweep else [(c, True) for c in configs[1:]])
  for config, sweep in passes:
    for shape_name, shape in shapes.items():
      if time.perf_counter() > run.deadline:
        break
      if not sweep:
        cases, ops = bf16_cases(shape)
        for case in cases:
          record(run, time_case(run, shape_name, shape, case, ops, {}, None))
        bf16_ms[shape_name] = next(r["value"] for r in run.rows if r["case"] == f"{shape_name}/bf16")
        del ops
      for precision in precisions:
        if time.perf_counter() > run.deadline:
          break
        ops = make_operands(shape, precision)
        cases = kernel_cases(precision, ops, config, run.interpret, sweep)
        if not sweep:
          cases = other_cases(precision, ops, run.interpret) + cases
        references = run.references.setdefault((shape_name, precision), {})
        for case in cases:
          record(run, time_case(run, shape_name, shape, case, ops, references, bf16_ms.get(shape_name)))
        del ops, cases
  print(f"\n{table(run.rows)}\n[{time.perf_counter() - t_start:.0f} s]", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
