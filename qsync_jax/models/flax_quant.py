"""Apply a precision policy to an unmodified ``flax.linen`` model.

``quantize(model, policy)`` returns a ``QuantizedModel`` whose ``init`` / ``apply`` run the
model under a Flax method interceptor (``nn.intercept_methods``). For each quantizable
module call the interceptor looks the op up in the policy by its module path and kind, and
hands the module its quantized op through Flax's own hooks, one handler per module method
(the dispatch table ``LINEN_OP_HOOKS``):

===============================  ============================  ===========================
module                           op kind(s)                    hook
===============================  ============================  ===========================
``nn.Dense``                     ``dense``                     ``dot_general=``
``nn.DenseGeneral``              ``dense_general``             ``dot_general=``
``nn.Conv``                      ``conv``                      ``conv_general_dilated=``
``nn.MultiHeadDotProductAttention``  ``attention_qk``, ``attention_pv``  ``*_einsum_cls=``
``nn.Einsum``                    ``einsum``                    (no hook: its 4-line body)
``nn.Embed``                     ``embed``, ``embed_attend``   (no hook: its lookup/attend)
===============================  ============================  ===========================

An ``embed`` op stays a lookup at every precision (``qsync_jax.ops.qembed``: the gathered rows
rounded as the policy says, the table's gradient a scatter-add); ``embed_attend`` (a tied
output head, ``query · tableᵀ``) is a GEMM like a Dense layer's. A tap sees the lookup as the
product ``one_hot(ids) · table`` it equals (``lhs`` the one-hot, built only for the tap).

(The projections of an attention module are ``DenseGeneral`` children, named e.g.
``Block_0/attn/query``. Inside ``qsync_jax.ops.qattention.fused_attention()``, an attention whose
two products are at one 16-bit float type runs ``jax.nn.dot_product_attention`` through
Flax's ``attention_fn=`` hook instead.) The module is re-bound to its own scope with the hook set
(``module.clone(parent=module.scope, ...)``), so parameters, names and RNG streams are
those of the plain model. An op no rule matches is not touched: the plain model's code runs,
bit-identical. Stochastic rounding draws keys from the ``"qsync"`` RNG stream
(``apply(..., rngs={"qsync": key})``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qsync_jax.errors import QsyncError
from qsync_jax.ops import qattention
from qsync_jax.ops.quant_ops import (
  QUANTIZED_OP_OF_KIND,
  RNG_COLLECTION,
  OpInfo,
  QuantizedDotGeneral,
  QuantizedEinsum,
  QuantizedLookup,
  QuantizedOp,
  Tap,
)
from qsync_jax.policy import PrecisionPolicy, op_name
from qsync_jax.precision import OpPolicy


def module_path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.scope.path)


class _Interceptor:
  """The method interceptor: an intercepted call whose module and method ``LINEN_OP_HOOKS`` lists
  goes to that entry's handler, every other call runs as written. ``listing``: record every op
  and its policy but run the float ops (for ``ops()``)."""

  def __init__(self, policy: PrecisionPolicy, tap: Tap | None, listing: bool = False):
    self.policy, self.tap, self.listing = policy, tap, listing
    self.seen: dict[str, OpPolicy | None] = {}
    self.bridged: list[str] = []  # paths of nnx modules wrapped as linen ones (nnx.bridge.to_linen)

  def op(self, module: nn.Module, kind: str) -> QuantizedOp | None:
    """The quantized op of ``module``'s ``kind`` op under the policy (recorded in ``seen``); None:
    no rule matches it, or ``listing``."""
    path = module_path(module)
    name = op_name(path, kind)
    runs_8bit = getattr(module, "feature_group_count", 1) == 1  # a grouped conv has no 8-bit kernel
    op_policy = self.policy.lookup(path, kind, runs_8bit)
    self.seen[name] = op_policy
    if op_policy is None or self.listing:
      return None

    def info_fn(lhs, rhs, rerun):
      return OpInfo(name, path, kind, tuple(lhs.shape), tuple(rhs.shape), op_policy, lhs, rhs, rerun)

    return QUANTIZED_OP_OF_KIND[kind](info_fn, op_policy, self._key(module, name, op_policy), self.tap)

  def _key(self, module, name, op_policy):
    if not op_policy.needs_rng:
      return None
    if module.has_rng(RNG_COLLECTION):
      return module.make_rng(RNG_COLLECTION)
    if module.is_initializing():
      return jax.random.key(0)  # values at init do not depend on rounding noise
    if not op_policy.forward_needs_rng:
      return None  # the forward rounds to nearest; its gradient asks for a key (qsync_jax.ops.keys)
    raise QsyncError(
      f"op {name!r} rounds its operands stochastically ({op_policy}) but no PRNG key was given. "
      f"Fix: pass rngs={{'{RNG_COLLECTION}': key}} to apply (a fresh key each step)."
    )

  def __call__(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if type(module).__module__.startswith("flax.nnx.bridge"):
      self.bridged.append(module_path(module))
    call = _Call(module, method, next_fun, args, kwargs)
    for hook in LINEN_OP_HOOKS:
      if isinstance(module, hook.module_type) and method == hook.method:
        return hook.handler(self, call, *hook.kinds)
    return call.plain()


@dataclasses.dataclass(frozen=True)
class _Call:
  """One intercepted call: ``module.method(*args, **kwargs)``, run on by ``next_fun``."""

  module: nn.Module
  method: str
  next_fun: Callable
  args: tuple
  kwargs: dict

  def plain(self):
    """The call as the model wrote it."""
    return self.next_fun(*self.args, **self.kwargs)

  def rebound(self, **hooks):
    """The call on a clone of the module, bound to its own scope (same parameters, names and RNG
    streams), with ``hooks`` (Flax's own attributes) set."""
    clone = self.module.clone(parent=self.module.scope, **hooks)
    return getattr(clone, self.method)(*self.args, **self.kwargs)


def _dot_general_hook(ops: _Interceptor, call: _Call, kind: str):
  """``nn.Dense`` / ``nn.DenseGeneral``: the op as ``dot_general=``."""
  if isinstance(call.module.dot_general, QuantizedOp):
    return call.plain()
  op = ops.op(call.module, kind)
  return call.plain() if op is None else call.rebound(dot_general=op, dot_general_cls=None)


def _conv_hook(ops: _Interceptor, call: _Call, kind: str):
  """``nn.Conv`` with shared weights: the op as ``conv_general_dilated=``."""
  if not call.module.shared_weights or isinstance(call.module.conv_general_dilated, QuantizedOp):
    return call.plain()
  op = ops.op(call.module, kind)
  return call.plain() if op is None else call.rebound(conv_general_dilated=op, conv_general_dilated_cls=None)


def _attention_hook(ops: _Interceptor, call: _Call, qk_kind: str, pv_kind: str):
  """``nn.MultiHeadDotProductAttention``: its two products as ``*_einsum_cls=``, or, inside
  ``qattention.fused_attention()`` with both at one 16-bit float type, ``attention_fn=``."""
  module = call.module
  if getattr(module.qk_attn_weights_einsum_cls, "_qsync", False) or getattr(
    module.attention_fn, "_qsync", False
  ):
    return call.plain()
  qk, pv = ops.op(module, qk_kind), ops.op(module, pv_kind)
  if qk is None and pv is None:
    return call.plain()
  fused = qattention.fused_dtype(qk and qk.op_policy, pv and pv.op_policy)
  if fused is not None and module.attention_fn is nn.dot_product_attention and module.dropout_rate == 0:
    return call.rebound(attention_fn=qattention.attention_fn(fused))
  # Flax needs both einsums or neither: an unquantized one keeps jnp.einsum's numerics.
  return call.rebound(qk_attn_weights_einsum_cls=_factory(qk), attn_weights_value_einsum_cls=_factory(pv))


def _einsum_hook(ops: _Interceptor, call: _Call, kind: str):
  """``nn.Einsum``: no hook, so its body runs with the op (``_einsum_body``)."""
  op = ops.op(call.module, kind)
  return call.plain() if op is None else _einsum_body(call.module, op, *call.args, **call.kwargs)


def _embed_lookup_hook(ops: _Interceptor, call: _Call, kind: str):
  """``nn.Embed.__call__``: no hook, so its lookup runs as the op (``_embed_lookup``)."""
  op = ops.op(call.module, kind)
  return call.plain() if op is None else _embed_lookup(call.module, op, *call.args, **call.kwargs)


def _embed_attend_hook(ops: _Interceptor, call: _Call, kind: str):
  """``nn.Embed.attend``: no hook, so ``query · tableᵀ`` runs as the op (``_embed_attend``)."""
  op = ops.op(call.module, kind)
  return call.plain() if op is None else _embed_attend(call.module, op, *call.args, **call.kwargs)


@dataclasses.dataclass(frozen=True)
class OpHook:
  """Calls of ``module_type.method`` run ``handler(interceptor, call, *kinds)``: the module's op
  kinds, each at its op policy."""

  module_type: type
  method: str
  kinds: tuple[str, ...]
  handler: Callable[..., Any]


LINEN_OP_HOOKS: tuple[OpHook, ...] = (
  OpHook(nn.Dense, "__call__", ("dense",), _dot_general_hook),
  OpHook(nn.DenseGeneral, "__call__", ("dense_general",), _dot_general_hook),
  OpHook(nn.Conv, "__call__", ("conv",), _conv_hook),
  OpHook(nn.MultiHeadDotProductAttention, "__call__", ("attention_qk", "attention_pv"), _attention_hook),
  OpHook(nn.Einsum, "__call__", ("einsum",), _einsum_hook),
  OpHook(nn.Embed, "__call__", ("embed",), _embed_lookup_hook),
  OpHook(nn.Embed, "attend", ("embed_attend",), _embed_attend_hook),
)
"""The interceptor's dispatch table, one entry per quantizable module method (first match wins)."""


def _factory(op):
  """An ``*_einsum_cls`` for Flax: returns ``op``, or plain ``jnp.einsum`` when op is None."""

  def make():
    return jnp.einsum if op is None else op

  make._qsync = True
  return make


def _einsum_body(module: nn.Einsum, op: QuantizedEinsum, inputs, einsum_str=None):
  """``nn.Einsum.__call__`` with its einsum quantized (nn.Einsum has no dot_general hook)."""
  einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  bias = None
  if module.use_bias:
    bias_shape, broadcasted = module._get_bias_shape(einsum_str, inputs, kernel)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  y = op(einsum_str, inputs, kernel)
  if bias is not None:
    y = y + jnp.reshape(bias, broadcasted)
  return y


def _embed_lookup(module: nn.Embed, op: QuantizedLookup, inputs):
  """``nn.Embed.__call__`` with its lookup at the op's precisions (a gather, no GEMM)."""
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"Embed {module_path(module)!r}: input dtype {inputs.dtype} must be integer.")
  (table,) = module.promote_dtype(module.embedding, dtype=module.dtype, inexact=False)
  return op(table, inputs)


def _embed_attend(module: nn.Embed, op: QuantizedDotGeneral, query):
  """``nn.Embed.attend``: ``query · tableᵀ`` at the op's precisions."""
  query, table = module.promote_dtype(query, module.embedding, dtype=module.dtype)
  return op(query, table, (((query.ndim - 1,), (1,)), ((), ())))


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
  """A Flax model run under a precision policy. Mirrors ``nn.Module.init`` / ``apply``."""

  model: nn.Module
  policy: PrecisionPolicy
  tap: Tap | None = None

  def _run(self, fn, *args, check: bool = True, **kwargs):
    interceptor = _Interceptor(self.policy, self.tap, listing=not check)
    with nn.intercept_methods(interceptor):
      out = fn(*args, **kwargs)
    if check:
      self.policy.check_quantizes_some(interceptor.seen, _bridge_hint(interceptor.bridged))
      if kwargs.get("method") is None:  # the whole model ran: a rule that matched nothing matches nothing
        self.policy.warn_unused_rules(interceptor.seen)
    return out, interceptor.seen

  def init(self, rngs, *args, **kwargs):
    """``model.init`` under the policy; refuses a policy that would quantize none of its ops, and
    warns (``QsyncWarning``) of a rule that matches none."""
    return self._run(self.model.init, rngs, *args, **kwargs)[0]

  def apply(self, variables, *args, **kwargs):
    """``model.apply`` under the policy; refuses a policy that would quantize none of its ops, and
    warns (``QsyncWarning``) of a rule that matches none (where the whole model runs: no
    ``method``)."""
    return self._run(self.model.apply, variables, *args, **kwargs)[0]

  def ops(self, variables, *args, **kwargs) -> dict[str, OpPolicy | None]:
    """Every quantizable op the model calls (``"path:kind"``) → its op policy (None = float).

    Traces the float ``apply`` abstractly (``jax.eval_shape``): nothing is computed, and an op
    its policy cannot run (a grouped convolution at int8) is listed all the same.
    """
    seen = {}

    def run(v, *a):
      out, s = self._run(self.model.apply, v, *a, check=False, **kwargs)
      seen.update(s)
      return out

    jax.eval_shape(run, variables, *args)
    return seen

  def unused_rules(self, variables, *args, **kwargs):
    return self.policy.unused_rules(self.ops(variables, *args, **kwargs))


def _bridge_hint(bridged: list[str]) -> str:
  if not bridged:
    return ""
  return (
    f"The model wraps nnx modules as linen ones (nnx.bridge.to_linen) at {bridged}, whose ops the "
    "linen interceptor cannot see. Fix: quantize the nnx module directly: "
    "qsync_jax.quantize(MyNnxModel(..., rngs=nnx.Rngs(0)), policy)."
  )


def quantize(
  model: nn.Module, policy: PrecisionPolicy | Any, tap: Tap | None = None, rngs=None
) -> QuantizedModel:
  """Runs ``model`` under ``policy`` (a PrecisionPolicy, its JSON object, or a preset name).

  ``model`` is a ``flax.linen`` module, or a ``flax.nnx`` module, which gets an ``nnx.Module``
  back (``qsync_jax.models.nnx_quant.QuantizedNnxModel``: called, trained with ``nnx.Optimizer``
  and ``nnx.jit`` as the module itself, with this functional interface too); ``rngs``
  (``nnx.Rngs``, nnx only) draws its stochastic rounding keys. A linen model takes them per call:
  ``apply(..., rngs={"qsync": key})``.

  Examples:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> qmodel = quantize(nn.Dense(4), "int8_fwd")
    >>> x = jnp.ones((2, 3))
    >>> params = qmodel.init(jax.random.key(0), x)
    >>> qmodel.apply(params, x).shape
    (2, 4)
  """
  if isinstance(policy, str):
    policy = PrecisionPolicy.uniform(policy)
  elif not isinstance(policy, PrecisionPolicy):
    policy = PrecisionPolicy.from_json(policy)
  from flax import nnx  # flax.nnx loads on first use

  from qsync_jax.models.nnx_model import NnxModel

  if isinstance(model, (nnx.Module, NnxModel)):
    from qsync_jax.models.nnx_quant import quantize_nnx

    return quantize_nnx(model, policy, tap, rngs)
  if not isinstance(model, nn.Module):
    raise TypeError(
      f"quantize() takes a flax.linen or flax.nnx Module, got {type(model).__name__}. "
      "Fix: pass the model object (e.g. MyModel(...)), not its variables or a function."
    )
  if rngs is not None:
    raise QsyncError(
      "quantize's rngs is for flax.nnx modules; a linen model takes its stochastic rounding key per call. "
      "Fix: drop rngs and pass apply(..., rngs={'qsync': key})."
    )
  return QuantizedModel(model, policy, tap)
