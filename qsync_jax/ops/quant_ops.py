"""The quantized ops Flax's hooks run, for linen (``qsync_jax.models.flax_quant``) and nnx
(``qsync_jax.models.nnx_quant``) alike: callables that run one op call at an op policy
(``qsync_jax.ops.qdot`` / ``qconv`` / ``qembed``) and hand it, with its operands, to a ``Tap``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qsync_jax.errors import PolicyError
from qsync_jax.ops.qconv import is_native, quantized_conv_general_dilated
from qsync_jax.ops.qdot import quantized_dot_general, quantized_einsum
from qsync_jax.ops.qembed import quantized_embed_lookup
from qsync_jax.precision import OpPolicy

RNG_COLLECTION = "qsync"


@dataclasses.dataclass(frozen=True)
class OpInfo:
  """What a tap learns about an op call: its name, kind, module path and operand shapes.

  ``lhs`` / ``rhs`` are the call's operands (X and W; Q and K, or P and V for attention) and
  ``rerun(op_policy, lhs, rhs)`` computes the same op (same dimension numbers, strides...) on
  other operands and/or at another op policy; ``op_policy=None`` runs the plain float op
  (``lax.dot_general`` / ``lax.conv_general_dilated``, differentiable to any order). Probes
  and indicators use them; they take no part in equality or hashing.
  """

  name: str
  path: str
  kind: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  op_policy: OpPolicy
  lhs: Any = dataclasses.field(default=None, compare=False, repr=False)
  rhs: Any = dataclasses.field(default=None, compare=False, repr=False)
  rerun: Callable[..., jax.Array] | None = dataclasses.field(default=None, compare=False, repr=False)


Tap = Callable[[OpInfo, jax.Array], jax.Array]
"""Called with every quantized op's output; returns the (possibly changed) output."""


class QuantizedOp:
  """Base of the callables handed to Flax hooks; marks a module as already quantized."""

  def __init__(self, info_fn, op_policy: OpPolicy, key, tap: Tap | None):
    self.info_fn, self.op_policy, self.key, self.tap = info_fn, op_policy, key, tap

  def _tapped(self, lhs, rhs, out, rerun=None):
    if self.tap is None:
      return out
    return self.tap(self.info_fn(lhs, rhs, rerun), out)


class QuantizedDotGeneral(QuantizedOp):
  """A ``dot_general`` for Flax's ``dot_general=`` hook."""

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision  # the op policy decides the precision of each leg
    out = quantized_dot_general(lhs, rhs, dimension_numbers, self.op_policy, self.key, preferred_element_type)

    def rerun(op_policy, lhs, rhs, key=None):
      if op_policy is None:
        return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
      return quantized_dot_general(lhs, rhs, dimension_numbers, op_policy, key, preferred_element_type)

    return self._tapped(lhs, rhs, out, rerun)


class QuantizedConv(QuantizedOp):
  """A ``conv_general_dilated`` for Flax's ``conv_general_dilated=`` hook."""

  def __call__(
    self,
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
  ):
    del precision
    if batch_group_count != 1:
      raise ValueError(f"batch_group_count={batch_group_count} is not supported by quantized convs.")
    if feature_group_count != 1 and not is_native(self.op_policy):
      info = self.info_fn(lhs, rhs, None)
      raise PolicyError(
        f"op {info.name!r} is a grouped convolution (feature_group_count={feature_group_count}), which "
        f"runs only uniform float policies (fp32, tf32, bf16 or fp16 on every leg), not {self.op_policy}. "
        f'Fix: keep it in float with a rule before the others, e.g. {{"path": "{re.escape(info.path)}", '
        '"kind": "conv", "policy": "fp32"}.'
      )
    conv_args = (window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count)

    def rerun(op_policy, lhs, rhs, key=None):
      if op_policy is None:
        return lax.conv_general_dilated(lhs, rhs, *conv_args, preferred_element_type=preferred_element_type)
      return quantized_conv_general_dilated(
        lhs, rhs, *conv_args, op_policy=op_policy, key=key, out_dtype=preferred_element_type
      )

    out = rerun(self.op_policy, lhs, rhs, self.key)
    return self._tapped(lhs, rhs, out, rerun)


class QuantizedEinsum(QuantizedOp):
  """An ``einsum(subscripts, a, b)`` for attention's ``*_einsum_cls`` hooks."""

  def __call__(self, subscripts, lhs, rhs, **kwargs):
    kwargs.pop("precision", None)
    out_dtype = kwargs.pop("preferred_element_type", None)
    out = quantized_einsum(subscripts, lhs, rhs, self.op_policy, self.key, out_dtype)

    def rerun(op_policy, lhs, rhs, key=None):
      if op_policy is None:
        return jnp.einsum(subscripts, lhs, rhs, preferred_element_type=out_dtype)
      return quantized_einsum(subscripts, lhs, rhs, op_policy, key, out_dtype)

    return self._tapped(lhs, rhs, out, rerun)


class QuantizedLookup(QuantizedOp):
  """An embedding lookup ``table[ids]`` at the op policy (``quantized_embed_lookup``)."""

  def __call__(self, table, ids):
    out = quantized_embed_lookup(table, ids, self.op_policy, self.key)
    if self.tap is None:
      return out
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype)
    dims = (((one_hot.ndim - 1,), (0,)), ((), ()))

    def rerun(op_policy, lhs, rhs, key=None):
      if op_policy is None:
        return lax.dot_general(lhs, rhs, dims)
      return quantized_dot_general(lhs, rhs, dims, op_policy, key)

    return self._tapped(one_hot, table, out, rerun)


QUANTIZED_OP_OF_KIND: dict[str, type[QuantizedOp]] = {
  "dense": QuantizedDotGeneral,
  "dense_general": QuantizedDotGeneral,
  "conv": QuantizedConv,
  "einsum": QuantizedEinsum,
  "embed": QuantizedLookup,
  "embed_attend": QuantizedDotGeneral,
  "attention_qk": QuantizedEinsum,
  "attention_pv": QuantizedEinsum,
}
"""The quantized op that runs each op kind (``qsync_jax.policy.OP_KINDS``), for linen and nnx."""
