"""Pallas (Mosaic GPU backend) 8-bit GEMM for Hopper: warp-specialized TMA + wgmma, fused epilogue.

``scaled_matmul_nt(a, b, a_scale, b_scale, out_dtype)`` is equivalent to this jnp code::

    acc = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=acc_dtype)
    out = (acc.astype(jnp.float32) * a_scale[:, None] * b_scale[None, :]).astype(out_dtype)

for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (both contraction-major: the layout Hopper's 8-bit
wgmma reads), int8×int8 (``acc_dtype`` int32) or e4m3×e4m3 / e5m2×e4m3 / e4m3×e5m2 (float32; the mixed pairs
need jax ≥ 0.11), with
``a_scale`` ``[M]`` and ``b_scale`` ``[N]`` float32 — the 2-D "NT" case of
``reference.scaled_dot_general_reference``.

Schedule (after JAX's ``hopper_matmul_mgpu`` example): a persistent grid of one CTA per SM
walks the output tiles in a planar snake; in each CTA a memory warpgroup streams
``[tile, tile_k]`` blocks of both operands through shared memory with TMA
(``max_concurrent_steps`` buffers), and two compute warpgroups each accumulate a
``tile_m × tile_n`` tile with asynchronous wgmma. The epilogue converts the accumulator in
registers, multiplies by the row and column scales and stores ``out_dtype``
through shared memory with TMA: the accumulator never reaches global memory.

Shapes must be multiples of the CTA tile (``NotImplementedError`` otherwise; the api then
uses XLA). GPU only (sm_90): Mosaic GPU has no CPU lowering, and jax 0.10's GPU interpret
mode cannot run the epilogue's layout-typed loads, so CPU tests trace the kernel and GPU tests
(``gpu`` marker) run it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._platform import varying_like
from pallas_kernels.gemm.config import HopperConfig, default_hopper_config

FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _check(m: int, n: int, k: int, config: HopperConfig) -> None:
  for name, size, tile in (("M", m, config.tile_m), ("N", n, 2 * config.tile_n), ("K", k, config.tile_k)):
    if size % tile:
      raise NotImplementedError(
        f"hopper scaled_matmul_nt: {name}={size} is not a multiple of the tile {tile}; the api uses XLA."
      )


def _kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, config: HopperConfig):
  acc_dtype = jnp.int32 if a_gmem.dtype == jnp.int8 else jnp.float32
  m, k = a_gmem.shape
  n = b_gmem.shape[0]
  tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
  cta_n = 2 * tn
  m_iters, n_iters, k_iters = m // tm, n // cta_n, k // tk
  swizzle = plgpu.find_swizzle(tk * 8)  # 8-bit operands: one byte an element
  transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
  out_dtype = out_gmem.dtype
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  out_swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(out_dtype).itemsize * 8)
  out_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
  out_transforms = (plgpu.TilingTransform((8, out_elems)), plgpu.SwizzleTransform(out_swizzle))

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=40,
      in_specs=[
        plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
        plgpu.BlockSpec((cta_n, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=compute_context,
    )

  ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)

  @functools.partial(
    pl.run_scoped,
    allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
    out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), out_dtype, transforms=out_transforms),
    collective_axes="wg",
  )
  def _scope(allocs, out_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
    def _tile(info):
      (lin,) = info.index
      mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, config.grid_tile_width)
      m_slice = pl.ds(mi * tm, tm)
      n_slice = pl.ds(ni * cta_n, cta_n)
      wg_n = pl.ds(wg * tn, tn)

      def compute_context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), acc_dtype))
        def _acc(acc_ref):
          run(acc_ref)
          acc = acc_ref[...].astype(jnp.float32)
          col_slice = pl.ds(ni * cta_n + wg * tn, tn)
          # the scales in the accumulator's row / column layout (the index argument: jax 0.10
          # requires it, 0.11 deprecates it in favour of ``ref.at[...]``)
          row = plgpu.load(sa_gmem, m_slice, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
          col = plgpu.load(sb_gmem, col_slice, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
          acc = acc * lax.broadcast_in_dim(row, (tm, tn), [0])
          out = (acc * lax.broadcast_in_dim(col, (tm, tn), [1])).astype(out_dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for i in range(tm // epi_m):
            for j in range(tn // epi_n):
              slot = (i * (tn // epi_n) + j) % 2
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)
              out_smem[wg, slot] = out[i * epi_m : (i + 1) * epi_m, j * epi_n : (j + 1) * epi_n]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                out_gmem.at[m_slice, n_slice]
                .at[:, wg_n]
                .at[pl.ds(i * epi_m, epi_m), pl.ds(j * epi_n, epi_n)],
              )

      def mma(idxs, a_smem, b_smem, acc_ref):
        del idxs
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem.at[wg_n], (1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref

      pipeline(mma, compute_context)(a_gmem.at[m_slice, :], b_gmem.at[n_slice, :], allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _supported(a_dtype, b_dtype) -> bool:
  """int8×int8, e4m3×e4m3, and from jax 0.11 (mixed-type wgmma) e5m2×e4m3 and e4m3×e5m2."""
  a_dtype, b_dtype = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
  if a_dtype == jnp.int8:
    return b_dtype == jnp.int8
  e4m3 = jnp.dtype(jnp.float8_e4m3fn)
  if a_dtype not in FP8 or b_dtype not in FP8 or e4m3 not in (a_dtype, b_dtype):
    return False
  return a_dtype == b_dtype or jax.__version_info__ >= (0, 11)


@functools.partial(
  jax.jit, static_argnames=("out_dtype", "config")
)  # traced, lowered once per distinct kernel
def scaled_matmul_nt(a, b, a_scale, b_scale, out_dtype=jnp.bfloat16, config: HopperConfig | None = None):
  """See the module docstring. ``NotImplementedError`` for shapes or types it cannot take."""
  if not _supported(a.dtype, b.dtype):
    raise NotImplementedError(
      f"hopper scaled_matmul_nt takes int8×int8 or fp8 pairs with an e4m3 operand (mixed from jax 0.11), "
      f"got {a.dtype}×{b.dtype}."
    )
  (m, k), (n, k2) = a.shape, b.shape
  if k != k2:
    raise ValueError(f"a {a.shape} and b {b.shape} must share their last (contraction) axis.")
  config = config or default_hopper_config(m, n, out_dtype)
  _check(m, n, k, config)
  # one CTA per SM (off a GPU, where the kernel is only traced, an H100's 132)
  num_sms = jax.devices()[0].core_count if jax.devices()[0].platform == "gpu" else 132
  a_scale, b_scale = a_scale.astype(jnp.float32), b_scale.astype(jnp.float32)
  f = plgpu.kernel(
    functools.partial(_kernel, config=config),
    out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(num_sms,),
    grid_names=("cluster_grid",),
    num_threads=3,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return varying_like(f(a, b, a_scale, b_scale), a, b, a_scale, b_scale)
