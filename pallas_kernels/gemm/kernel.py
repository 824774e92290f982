"""Pallas (Triton backend) scaled GEMM: int8×int8→int32 or fp8×fp8→fp32, fused epilogue.

``scaled_matmul(a, b, a_scale, b_scale)`` computes, for 2-D operands,
``out[m, n] = (Σ_k A[m, k]·B[n, k]) · a_scale[m] · b_scale[n] (+ bias[n])`` in ``out_dtype``,
the 2-D case of ``reference.scaled_dot_general_reference``, with the dequantizing epilogue
(row × column scales, bias, cast) applied to the accumulator in registers: the int32 /
float32 accumulator never goes to memory.

Each operand comes in either layout, read in place (no transposed copy):
``a`` is ``[M, K]`` (``a_kmajor``) or ``[K, M]``; ``b`` is ``[N, K]`` (``b_kmajor``) or
``[K, N]``. The training GEMMs map onto these: forward X·W (a K-major, b ``[K, N]``), dlhs
dY·Wᵀ (both K-major), drhs Xᵀ·dY (a ``[K, M]``, b ``[K, N]``). On Hopper, 8-bit tensor-core
instructions read both operands contraction-major; other layouts compile to a slower path
(``docs/kernels.md``), so the api hands this kernel
K-major operands where it can.

e5m2×e4m3 (gradient GEMMs in fp8): the Pallas Triton lowering takes one element type per
``dot``, so mixed fp8 operands are widened in registers to float16 (exact for both
formats) and multiplied on the 16-bit tensor cores. Tiles must divide the problem:
``NotImplementedError`` otherwise (the api then uses XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._platform import out_struct
from pallas_kernels.gemm.config import GemmConfig, default_config

EIGHT_BIT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _grouped(pid, n_m: int, n_n: int, group_m: int):
  """``(pid_m, pid_n)`` of a 1-D program id, walking ``group_m`` tile rows at a time."""
  width = group_m * n_n
  group = pid // width
  first_m = group * group_m
  size = jnp.minimum(n_m - first_m, group_m)
  return first_m + (pid % width) % size, (pid % width) // size


def _kernel(*refs, a_kmajor, b_kmajor, block_k, n_k, acc_dtype, compute_dtype, has_bias):
  a_ref, b_ref, sa_ref, sb_ref, *rest = refs
  bias_ref = rest.pop(0) if has_bias else None
  (o_ref,) = rest
  bm, bn = o_ref.shape
  dims = (((1 if a_kmajor else 0,), (1 if b_kmajor else 0,)), ((), ()))

  def body(i, acc):
    ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    a = a_ref[:, ks] if a_kmajor else a_ref[ks, :]
    b = b_ref[:, ks] if b_kmajor else b_ref[ks, :]
    if compute_dtype is not None:
      a, b = a.astype(compute_dtype), b.astype(compute_dtype)
    return acc + lax.dot_general(a, b, dims, preferred_element_type=acc_dtype)

  acc = lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), acc_dtype))
  out = acc.astype(jnp.float32) * sa_ref[...][:, None]
  out = out * sb_ref[...][None, :]
  if has_bias:
    out = out + bias_ref[...].astype(jnp.float32)[None, :]
  o_ref[...] = out.astype(o_ref.dtype)


def _check(name: str, n: int, b: int) -> None:
  if b <= 0 or b & (b - 1) or n % b:
    raise NotImplementedError(
      f"scaled_matmul kernel: {name}={n} is not a multiple of the power-of-two block {b}; "
      "the api uses XLA for such shapes."
    )


@functools.partial(
  jax.jit, static_argnames=("a_kmajor", "b_kmajor", "out_dtype", "config", "interpret")
)  # traced and lowered once per distinct kernel of a step (its calls share one lowered function)
def scaled_matmul(
  a: jax.Array,
  b: jax.Array,
  a_scale: jax.Array,
  b_scale: jax.Array,
  *,
  a_kmajor: bool = True,
  b_kmajor: bool = True,
  bias: jax.Array | None = None,
  out_dtype=jnp.float32,
  config: GemmConfig | None = None,
  interpret: bool = False,
) -> jax.Array:
  """``[M, N]`` ``out_dtype``: scaled product of 8-bit ``a`` and ``b``; see the module doc.

  Args:
    a: ``[M, K]`` if ``a_kmajor`` else ``[K, M]``; int8, float8_e4m3fn or float8_e5m2.
    b: ``[N, K]`` if ``b_kmajor`` else ``[K, N]``; int8 with int8 ``a``, else fp8.
    a_scale, b_scale: float32 ``[M]`` and ``[N]``.
    bias: optional ``[N]``, added in float32 after scaling.
  """
  m, k = a.shape if a_kmajor else a.shape[::-1]
  n, k2 = b.shape if b_kmajor else b.shape[::-1]
  if k != k2:
    raise ValueError(f"a and b disagree on the contraction size: {k} vs {k2}.")
  if a.dtype not in EIGHT_BIT or b.dtype not in EIGHT_BIT:
    raise NotImplementedError(f"scaled_matmul takes 8-bit operands, got {a.dtype} and {b.dtype}")
  is_int = a.dtype == jnp.int8
  if is_int != (b.dtype == jnp.int8):
    raise ValueError(f"int8 pairs only with int8: got {a.dtype} and {b.dtype}.")
  if a_scale.shape != (m,) or b_scale.shape != (n,):
    raise ValueError(f"a_scale {a_scale.shape} and b_scale {b_scale.shape} must be ({m},) and ({n},).")
  cfg = config or default_config(m, n, k)
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  for name, size, block in (("M", m, bm), ("N", n, bn), ("K", k, bk)):
    _check(name, size, block)
  if min(bm, bn, bk) < 16:
    raise NotImplementedError(f"tiles below 16 ({bm}x{bn}x{bk}) do not map to tensor cores")
  n_m, n_n = m // bm, n // bn
  group_m = max(1, min(cfg.group_m, n_m))

  def mn(pid):
    return _grouped(pid, n_m, n_n, group_m)

  a_spec = (
    pl.BlockSpec((bm, k), lambda p: (mn(p)[0], 0))
    if a_kmajor
    else pl.BlockSpec((k, bm), lambda p: (0, mn(p)[0]))
  )
  b_spec = (
    pl.BlockSpec((bn, k), lambda p: (mn(p)[1], 0))
    if b_kmajor
    else pl.BlockSpec((k, bn), lambda p: (0, mn(p)[1]))
  )
  in_specs = [
    a_spec,
    b_spec,
    pl.BlockSpec((bm,), lambda p: (mn(p)[0],)),
    pl.BlockSpec((bn,), lambda p: (mn(p)[1],)),
  ]
  args = [a, b, a_scale.astype(jnp.float32), b_scale.astype(jnp.float32)]
  if bias is not None:
    if bias.shape != (n,):
      raise ValueError(f"bias of shape {bias.shape} must be ({n},).")
    in_specs.append(pl.BlockSpec((bn,), lambda p: (mn(p)[1],)))
    args.append(bias)
  compute_dtype = jnp.float16 if a.dtype != b.dtype else None
  kernel = functools.partial(
    _kernel,
    a_kmajor=a_kmajor,
    b_kmajor=b_kmajor,
    block_k=bk,
    n_k=k // bk,
    acc_dtype=jnp.int32 if is_int else jnp.float32,
    compute_dtype=compute_dtype,
    has_bias=bias is not None,
  )
  layout = ("t" if a_kmajor else "n") + ("t" if b_kmajor else "n")
  return pl.pallas_call(
    kernel,
    out_shape=out_struct((m, n), out_dtype, *args),
    grid=(n_m * n_n,),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((bm, bn), lambda p: mn(p)),
    compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    interpret=interpret,
    name=f"scaled_matmul_{jnp.dtype(a.dtype).name}_{layout}",
  )(*args)
