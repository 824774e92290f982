"""Embedding lookup at an op policy's precisions: a gather, never a GEMM.

``quantized_embed_lookup(table, ids, op_policy, key)`` computes what the product
``one_hot(ids) · table`` computes through ``quantized_dot_general`` under ``op_policy``, but as
``jnp.take(table, ids, axis=0)`` (the lookup of plain ``nn.Embed``) whose gathered rows are
rounded as the policy says, and whose gradient is the plain scatter-add into the table:

* forward (``op_policy.fwd``): fp32 / tf32 — the rows as they are; bf16 / fp16 — the rows
  rounded to that type (and back to the table's dtype); int8 / fp8 — the rows quantized with
  the *table's* scales (``per_channel``: one per feature, the absmax over the vocabulary, as
  the GEMM's right operand is scaled; ``per_tensor``: one for the table) and dequantized.
  The one-hot operand is exact at every precision, so these are the GEMM's values (up to the
  float rounding of its scale epilogue).
* gradient to the table (``op_policy.drhs``): the output gradient rounded likewise (int8 /
  fp8: scales per feature over all looked-up rows, or one per tensor; ``grad_rounding``;
  fp8 gradients are e5m2), then scatter-added into the table, as ``jnp.take``'s transpose.
* ``op_policy.dlhs`` has nothing to do: the ids are integers.

A lookup whose rounding is a no-op (fp32 legs, or 16-bit legs on a table already stored in
that type) is exactly ``jnp.take``: the program of the plain model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.quantize.noise import stream_keys
from pallas_kernels.quantize.reference import absmax_scale, round_to_format
from qsync_jax.ops.keys import check_backward_key, check_forward_key
from qsync_jax.ops.qdot import FLOAT_DTYPES, qformat
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy


def fake_quantize(
  x: jax.Array,
  precision: str,
  reduce_axes: Sequence[int],
  rounding: str = "nearest",
  key: jax.Array | None = None,
  *,
  is_grad: bool = False,
  scale: jax.Array | None = None,
) -> jax.Array:
  """``x`` rounded to ``precision`` and back, in ``x``'s dtype.

  Float precisions cast (fp32 / tf32: unchanged). int8 / fp8: ``dequantize(quantize(x))``
  with the absmax scale over ``reduce_axes`` (or the given ``scale``, broadcastable to
  ``x``), in the format ``qdot.qformat(precision, is_grad)``. Elementwise: XLA fuses it into
  the producer and the consumer.
  """
  if precision in FLOAT_DTYPES:
    return x.astype(FLOAT_DTYPES[precision]).astype(x.dtype)
  if precision not in QUANTIZED_PRECISIONS:
    return x
  fmt = qformat(precision, is_grad)
  if scale is None:
    scale = absmax_scale(x, fmt, reduce_axes)
  q = round_to_format(x.astype(jnp.float32) / scale, fmt, rounding, key)
  return (q.astype(jnp.float32) * scale).astype(x.dtype)


def _rounds(precision: str, dtype) -> bool:
  """Whether rounding a ``dtype`` array to ``precision`` can change it."""
  if precision in QUANTIZED_PRECISIONS:
    return True
  return precision in FLOAT_DTYPES and jnp.dtype(FLOAT_DTYPES[precision]) != jnp.dtype(dtype)


def _scale_axes(ndim: int, granularity: str) -> tuple[int, ...]:
  """Reduced axes of a ``[..., features]`` array's scale: all but the features (per
  channel), or all (per tensor)."""
  return tuple(range(ndim)) if granularity == "per_tensor" else tuple(range(ndim - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rounded_rows(rows, table_scale, op_policy: OpPolicy, keys):
  fwd_key, _ = keys
  if not _rounds(op_policy.fwd, rows.dtype):
    return rows
  return fake_quantize(rows, op_policy.fwd, (), op_policy.rounding, fwd_key, scale=table_scale)


def _rounded_rows_fwd(rows, table_scale, op_policy, keys):
  return _rounded_rows(rows, table_scale, op_policy, keys), keys


def _rounded_rows_bwd(op_policy, keys, g):
  _, grad_key = keys
  check_backward_key(op_policy, grad_key)
  if _rounds(op_policy.drhs, g.dtype):
    axes = _scale_axes(g.ndim, op_policy.granularity)
    g = fake_quantize(g, op_policy.drhs, axes, op_policy.grad_rounding, grad_key, is_grad=True)
  return g, None, None


_rounded_rows.defvjp(_rounded_rows_fwd, _rounded_rows_bwd)


def quantized_embed_lookup(
  table: jax.Array, ids: jax.Array, op_policy: OpPolicy, key: jax.Array | None = None
) -> jax.Array:
  """``table[ids]`` at ``op_policy``'s precisions; see the module docstring.

  Args:
    table: ``[num_embeddings, features]``, in the dtype the lookup returns.
    ids: integer array of any shape.
    op_policy: ``fwd`` rounds the looked-up rows, ``drhs`` the table's gradient.
    key: PRNG key, required when ``op_policy`` rounds stochastically.
  """
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"embedding lookup: ids dtype {ids.dtype} must be integer.")
  check_forward_key(op_policy, key)
  rows = jnp.take(table, ids, axis=0)
  if not (_rounds(op_policy.fwd, table.dtype) or _rounds(op_policy.drhs, table.dtype)):
    return rows  # plain nn.Embed's program
  table_scale = None
  if op_policy.fwd in QUANTIZED_PRECISIONS:
    fmt = qformat(op_policy.fwd, False)
    table_scale = jax.lax.stop_gradient(
      absmax_scale(table, fmt, _scale_axes(table.ndim, op_policy.granularity))
    )
  keys = tuple(stream_keys(key, 2))
  return _rounded_rows(rows, table_scale, op_policy, keys)
