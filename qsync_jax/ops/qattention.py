"""Fused attention for attention products whose policy is one 16-bit float type.

By default on a GPU (while a step is traced; ``with fused_attention(False):`` opts out,
``with fused_attention():`` opts in on any backend), an ``nn.MultiHeadDotProductAttention``
whose two products (``attention_qk``, ``attention_pv``) both run every leg at one 16-bit float type (bf16 or fp16), without dropout and with Flax's
default ``attention_fn``, computes its attention with ``jax.nn.dot_product_attention``
(cuDNN's fused kernel on a GPU, XLA's einsums elsewhere) on query, key and value cast to that
type, instead of Flax's two einsums around a softmax: ``softmax(q·kᵀ/√d + mask) · v`` with
both products at that type, the logits and the softmax in float32 (Flax's code keeps them in
the products' output type) and the probabilities rounded to the 16-bit type for the second
product. Inside ``with fused_attention(False):`` attention runs Flax's own code.

Attention products at int8 / fp8 (or mixed legs) are quantized einsums
(``qsync_jax.ops.qdot.quantized_einsum``) either way.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from qsync_jax.ops.qdot import FLOAT_DTYPES
from qsync_jax.precision import OpPolicy

_ENABLED: list[bool | None] = [None]  # None: on a GPU only (``jax.default_backend()``)


@contextlib.contextmanager
def fused_attention(enabled: bool | None = True):
  """Attention ops traced inside the block use the fused kernel where their policy allows
  (``enabled``), Flax's own attention (``enabled=False``), or the default outside any block
  (``None``): fused on a GPU, Flax's own elsewhere (where fusing gains nothing, and XLA:CPU has
  no fp16 product with float32 results)."""
  previous = _ENABLED[0]
  _ENABLED[0] = enabled
  try:
    yield
  finally:
    _ENABLED[0] = previous


def fused_dtype(qk: OpPolicy | None, pv: OpPolicy | None):
  """The 16-bit type both products run every leg at, if fused attention is on; else None."""
  enabled = _ENABLED[0] if _ENABLED[0] is not None else jax.default_backend() == "gpu"
  if not enabled or qk is None or pv is None:
    return None
  p = qk.fwd
  if p not in FLOAT_DTYPES or {qk.dlhs, qk.drhs, pv.fwd, pv.dlhs, pv.drhs} != {p}:
    return None
  return FLOAT_DTYPES[p]


def default_implementation() -> str:
  """``"cudnn"`` on a GPU, ``"xla"`` elsewhere."""
  return "cudnn" if jax.default_backend() == "gpu" else "xla"


def attention_fn(dtype, implementation: str | None = None):
  """A Flax ``attention_fn`` computing attention with ``jax.nn.dot_product_attention`` on
  operands cast to ``dtype``; its result has the query's dtype."""
  implementation = implementation or default_implementation()

  def attend(query, key, value, bias=None, mask=None):
    out_dtype = query.dtype
    q, k, v = (x.astype(dtype) for x in (query, key, value))
    if bias is not None:
      bias = bias.astype(dtype)
    if mask is not None:
      mask = mask.astype(jnp.bool_)
    with jax.numpy_dtype_promotion("standard"):  # jax.nn's code promotes bf16 with float32
      out = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation=implementation)
    return out.astype(out_dtype)

  attend._qsync = True
  return attend
