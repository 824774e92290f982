"""Apply a precision policy to an unmodified ``flax.nnx`` model.

``quantize(nnx_module, policy)`` (``qsync_jax.quantize`` dispatches here) returns a
``QuantizedNnxModel``, an ``nnx.Module`` wrapping ``nnx_module`` (trained as the module itself,
with ``nnx.Optimizer`` and ``nnx.jit``); ``quantize(NnxModel, policy)``, what the trainer calls,
a ``QuantizedNnxFunctional`` with ``NnxModel``'s functional ``init`` / ``apply``. Each call hands
every quantizable module of a fresh copy of the module its quantized op, through the module's
own attribute where nnx has one (the dispatch table ``NNX_OP_HOOKS``):

===========================  ================================  ====================================
module                       op kind(s)                        hook
===========================  ================================  ====================================
``nnx.Linear``               ``dense``                         ``dot_general``
``nnx.LinearGeneral``        ``dense_general``                 ``dot_general`` (``dot_general_cls``)
``nnx.Conv``                 ``conv``                          ``conv_general_dilated``
``nnx.Einsum``               ``einsum``                        ``einsum_op``
``nnx.MultiHeadAttention``   ``attention_qk``, ``attention_pv``  ``attention_fn``
``nnx.Embed``                ``embed``, ``embed_attend``       (no hook: its lookup / attend)
===========================  ================================  ====================================

Names and rules are those of linen models: an op is ``"<path>:<kind>"`` with the module's path
in the nnx graph joined by ``/`` (``blocks/0/attn/query``; an attention module's projections are
its ``LinearGeneral`` children ``query``, ``key``, ``value``, ``out``); the policy's ordered
regex rules, first match wins, then ``__default__``. An op no rule matches keeps the module's
own function and runs bit-identical to the plain model. Each op runs under ``jax.named_scope``
of its path (as linen's module scopes name a step's instructions). Stochastic rounding draws a
fresh key per op call from ``apply(..., rngs={"qsync": key})`` (functional) or from the
``rngs`` given to ``quantize`` (the module).

An ``embed`` op is a lookup at every precision (``qsync_jax.ops.qembed``, as for linen), an
``embed_attend`` op a GEMM. ``nnx.Embed`` has no hook for them, so its copy in ``apply`` is
re-classed as a subclass (same attributes and variables) whose ``__call__`` / ``attend`` run
them, as the linen version re-implements ``nn.Embed``'s; an ``nnx.Embed`` subclass with its own
``__call__`` or ``attend`` is left alone (it calls no op qsync knows).

``nnx.MultiHeadAttention``'s ``attention_fn`` becomes ``quantized_attention``:
``nnx.dot_product_attention`` with its two products at their op policies (grouped-query
attention repeats the key and value heads); with neither product matched the module keeps its
own ``attention_fn``. Inside ``qsync_jax.ops.qattention.fused_attention()``, products both at one
16-bit float type run ``jax.nn.dot_product_attention`` as for linen (with nnx's default
``attention_fn``, no dropout, no ``is_causal``, no sown weights).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax import lax

from qsync_jax.errors import QsyncError
from qsync_jax.models.nnx_model import NnxModel, path_name
from qsync_jax.ops import qattention
from qsync_jax.ops.quant_ops import QUANTIZED_OP_OF_KIND, RNG_COLLECTION, OpInfo, Tap
from qsync_jax.policy import PrecisionPolicy, op_name
from qsync_jax.precision import OpPolicy


class _Ops:
  """One ``apply``'s ops: what each quantizable module called (``seen``) and its keys."""

  def __init__(
    self, policy: PrecisionPolicy, tap: Tap | None, key, listing: bool = False, key_fix: str | None = None
  ):
    """``listing``: record every op and its policy but run the module's own (float) ops;
    ``key_fix``: how to give a key, where an op needs one and ``key`` is None."""
    self.policy, self.tap, self.key, self.listing = policy, tap, key, listing
    self.key_fix = key_fix or f"pass rngs={{'{RNG_COLLECTION}': key}} to apply (a fresh key each step)"
    self.seen: dict[str, OpPolicy | None] = {}
    self.calls = 0

  def op(self, path: str, kind: str, runs_8bit: bool = True):
    """The quantized op for one call of ``path:kind`` (None: the module's own op);
    ``runs_8bit``: whether an 8-bit kernel runs it (``PrecisionPolicy.match``)."""
    name = op_name(path, kind)
    op_policy = self.policy.lookup(path, kind, runs_8bit)
    self.seen[name] = op_policy
    if op_policy is None or self.listing:
      return None

    def info_fn(lhs, rhs, rerun):
      return OpInfo(name, path, kind, tuple(lhs.shape), tuple(rhs.shape), op_policy, lhs, rhs, rerun)

    return QUANTIZED_OP_OF_KIND[kind](info_fn, op_policy, self._key(name, op_policy), self.tap)

  def _key(self, name: str, op_policy: OpPolicy):
    if not op_policy.needs_rng:
      return None
    if self.key is None and not op_policy.forward_needs_rng:
      return None  # the forward rounds to nearest; its gradient asks for a key (qsync_jax.ops.keys)
    if self.key is None:
      raise QsyncError(
        f"op {name!r} rounds its operands stochastically ({op_policy}) but no PRNG key was given. "
        f"Fix: {self.key_fix}."
      )
    self.calls += 1
    return jax.random.fold_in(self.key, self.calls)


def _no_out_sharding(path: str, out_sharding) -> None:
  if out_sharding is not None:
    raise QsyncError(
      f"module {path!r} was called with out_sharding={out_sharding!r}, which quantized ops do not "
      "take. Fix: call it without out_sharding, or keep it in float with a rule whose policy is fp32."
    )


@dataclasses.dataclass(frozen=True)
class _DotHook:
  """``dot_general`` of an ``nnx.Linear`` / ``LinearGeneral``."""

  ops: _Ops
  path: str
  kind: str
  own: Callable[[], Callable]  # the module's own dot_general (LinearGeneral may build it per call)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, out_sharding=None, **kwargs):
    with jax.named_scope(self.path):
      op = self.ops.op(self.path, self.kind)
      if op is None:
        return self.own()(
          lhs, rhs, dimension_numbers, precision=precision, out_sharding=out_sharding, **kwargs
        )
      _no_out_sharding(self.path, out_sharding)
      return op(lhs, rhs, dimension_numbers, **kwargs)


@dataclasses.dataclass(frozen=True)
class _ConvHook:
  """``conv_general_dilated`` of an ``nnx.Conv``."""

  ops: _Ops
  path: str
  own: Callable
  runs_8bit: bool  # ungrouped (a grouped convolution has no 8-bit kernel)

  def __call__(self, *args, out_sharding=None, **kwargs):
    with jax.named_scope(self.path):
      op = self.ops.op(self.path, "conv", self.runs_8bit)
      if op is None:
        return self.own(*args, out_sharding=out_sharding, **kwargs)
      _no_out_sharding(self.path, out_sharding)
      return op(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _EinsumHook:
  """``einsum_op`` of an ``nnx.Einsum``."""

  ops: _Ops
  path: str
  own: Callable

  def __call__(self, subscripts, lhs, rhs, out_sharding=None, **kwargs):
    with jax.named_scope(self.path):
      op = self.ops.op(self.path, "einsum")
      if op is None:
        return self.own(subscripts, lhs, rhs, out_sharding=out_sharding, **kwargs)
      _no_out_sharding(self.path, out_sharding)
      return op(subscripts, lhs, rhs, **kwargs)


@dataclasses.dataclass(frozen=True)
class _AttentionHook:
  """``attention_fn`` of an ``nnx.MultiHeadAttention``."""

  ops: _Ops
  path: str
  own: Callable

  def __call__(self, query, key, value, **kwargs):
    with jax.named_scope(self.path):
      qk = self.ops.op(self.path, "attention_qk")
      pv = self.ops.op(self.path, "attention_pv")
      if qk is None and pv is None:
        return self.own(query, key, value, **kwargs)
      fused = qattention.fused_dtype(qk and qk.op_policy, pv and pv.op_policy)
      plain = (
        self.own is nnx.dot_product_attention and not kwargs.get("module") and not kwargs.get("is_causal")
      )
      if fused is not None and plain and kwargs.get("dropout_rate", 0.0) == 0.0:
        return qattention.attention_fn(fused)(query, key, value, kwargs.get("bias"), kwargs.get("mask"))
      return quantized_attention(query, key, value, qk=qk or jnp.einsum, pv=pv or jnp.einsum, **kwargs)


def quantized_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  broadcast_dropout: bool = True,
  dropout_rng=None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype=None,
  precision=None,
  module=None,
  promote_dtype=dtypes.promote_dtype,
  is_causal: bool = False,
  *,
  qk: Callable,
  pv: Callable,
):
  """``nnx.dot_product_attention`` with its products as ``qk(subscripts, q, k)`` and
  ``pv(subscripts, weights, v)``. Equivalent to::

      w = softmax(mask(qk("...qhd,...khd->...hqk", q / sqrt(d), k) + bias))  # then dropout
      out = pv("...hqk,...khd->...qhd", w, v)
  """
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  dtype = query.dtype
  if key.shape[-2] != query.shape[-2]:  # grouped-query attention: one key/value head per group
    repeats = query.shape[-2] // key.shape[-2]
    key, value = jnp.repeat(key, repeats, axis=-2), jnp.repeat(value, repeats, axis=-2)
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  einsum_kwargs = {"precision": precision} if qk is jnp.einsum else {}
  weights = qk("...qhd,...khd->...hqk", query, key, **einsum_kwargs)
  if bias is not None:
    weights = weights + bias
  if mask is not None or is_causal:
    masks = [m for m in [mask] if m is not None]
    if is_causal:
      t, s = weights.shape[-2:]
      causal = jnp.tril(jnp.ones((t, s), dtype=dtype))
      masks.append(jnp.broadcast_to(causal, mask.shape if mask is not None else weights.shape))
    combined = nnx.combine_masks(*masks, dtype=dtype)
    weights = jnp.where(combined, weights, jnp.finfo(dtype).min)
  weights = jax.nn.softmax(weights).astype(dtype)
  if module:
    module.sow(nnx.Intermediate, "attention_weights", weights)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = (1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
  einsum_kwargs = {"precision": precision} if pv is jnp.einsum else {}
  return pv("...hqk,...khd->...qhd", weights, value, **einsum_kwargs)


def _embed_lookup(self, inputs, out_sharding=None):
  """``nnx.Embed.__call__`` with its lookup at the op's policy (``QuantizedLookup``: a gather, as
  the linen version's); the module's own lookup when no rule matches."""
  ops, path = self._qsync_ops, self._qsync_path
  with jax.named_scope(path):
    op = ops.op(path, "embed")
    if op is None:
      return nnx.Embed.__call__(self, inputs, out_sharding=out_sharding)
    _no_out_sharding(path, out_sharding)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embed {path!r}: input dtype {inputs.dtype} must be integer.")
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return op(table, inputs)


def _embed_attend(self, query, out_sharding=None):
  """``nnx.Embed.attend``: ``query · tableᵀ`` at the op's policy; the module's own when no rule
  matches."""
  ops, path = self._qsync_ops, self._qsync_path
  with jax.named_scope(path):
    op = ops.op(path, "embed_attend")
    if op is None:
      return nnx.Embed.attend(self, query, out_sharding=out_sharding)
    _no_out_sharding(path, out_sharding)
    query, table = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
    return op(query, table, (((query.ndim - 1,), (1,)), ((), ())))


@functools.cache
def _hooked_embed_class(cls: type) -> type:
  """``cls`` (``nnx.Embed`` or a subclass keeping its lookup and attend) with them quantized."""
  return type(f"Hooked{cls.__name__}", (cls,), {"__call__": _embed_lookup, "attend": _embed_attend})


def _hook_linear(m: nnx.Linear, ops: _Ops, path: str) -> None:
  m.dot_general = _DotHook(ops, path, "dense", lambda fn=m.dot_general: fn)


def _hook_linear_general(m: nnx.LinearGeneral, ops: _Ops, path: str) -> None:
  cls, fn = m.dot_general_cls, m.dot_general
  own = cls if cls is not None else (lambda fn=fn: fn if fn is not None else lax.dot_general)
  m.dot_general, m.dot_general_cls = _DotHook(ops, path, "dense_general", own), None


def _hook_conv(m: nnx.Conv, ops: _Ops, path: str) -> None:
  m.conv_general_dilated = _ConvHook(ops, path, m.conv_general_dilated, m.feature_group_count == 1)


def _hook_einsum(m: nnx.Einsum, ops: _Ops, path: str) -> None:
  m.einsum_op = _EinsumHook(ops, path, m.einsum_op)


def _hook_embed(m: nnx.Embed, ops: _Ops, path: str) -> None:
  m.__class__ = _hooked_embed_class(type(m))
  m._qsync_ops, m._qsync_path = ops, path


def _hook_attention(m: nnx.MultiHeadAttention, ops: _Ops, path: str) -> None:
  m.attention_fn = _AttentionHook(ops, path, m.attention_fn)


@dataclasses.dataclass(frozen=True)
class NnxOpHook:
  """A module of ``module_type`` may call ops of ``kinds``; ``install(module, ops, path)`` hands
  it their quantized versions through its own attribute."""

  module_type: type
  kinds: tuple[str, ...]
  install: Callable[[Any, _Ops, str], None]


NNX_OP_HOOKS: tuple[NnxOpHook, ...] = (
  NnxOpHook(nnx.Linear, ("dense",), _hook_linear),
  NnxOpHook(nnx.LinearGeneral, ("dense_general",), _hook_linear_general),
  NnxOpHook(nnx.Conv, ("conv",), _hook_conv),
  NnxOpHook(nnx.Einsum, ("einsum",), _hook_einsum),
  NnxOpHook(nnx.Embed, ("embed", "embed_attend"), _hook_embed),
  NnxOpHook(nnx.MultiHeadAttention, ("attention_qk", "attention_pv"), _hook_attention),
)
"""The quantizable nnx module types, the op kinds each may call and how each gets its hook (first
match wins)."""


def hook_of(module) -> NnxOpHook | None:
  """``module``'s entry of ``NNX_OP_HOOKS`` (None for an ``nnx.Embed`` subclass with its own
  lookup or attend: qsync would replace them, so it leaves such a module alone)."""
  if isinstance(module, nnx.Embed) and (
    type(module).__call__ is not nnx.Embed.__call__ or type(module).attend is not nnx.Embed.attend
  ):
    return None
  return next((hook for hook in NNX_OP_HOOKS if isinstance(module, hook.module_type)), None)


def kinds_of(module) -> tuple[str, ...]:
  """The op kinds ``module`` may call (none where ``hook_of`` has no entry)."""
  hook = hook_of(module)
  return () if hook is None else hook.kinds


def quantizable_modules(module: nnx.Module) -> list[tuple[str, nnx.Module]]:
  """``(path, module)`` of every quantizable module of the graph (a shared module once)."""
  return [(path_name(p), m) for p, m in nnx.iter_graph(module) if kinds_of(m)]


def install(module: nnx.Module, ops: _Ops) -> None:
  """Hands every quantizable module of ``module`` (a throwaway copy) its hook."""
  for path, m in quantizable_modules(module):
    hook_of(m).install(m, ops, path)


@dataclasses.dataclass(frozen=True)
class QuantizedNnxFunctional:
  """An nnx model run under a precision policy, as a pure function of its variables: the
  interface of ``QuantizedModel`` (what the trainer, the profiler and the indicator call)."""

  model: NnxModel
  policy: PrecisionPolicy
  tap: Tap | None = None

  def _call(self, variables, args, kwargs, listing=False) -> tuple[Any, dict[str, OpPolicy | None]]:
    kwargs = dict(kwargs)
    rngs, mutable = dict(kwargs.pop("rngs", None) or {}), kwargs.pop("mutable", False)
    ops = _Ops(self.policy, self.tap, rngs.get(RNG_COLLECTION), listing)
    out = self.model.call(
      variables, args, kwargs, rngs=rngs, mutable=mutable, prepare=lambda module, _: install(module, ops)
    )
    return out, ops.seen

  def init(self, rngs=None, *args, **kwargs):
    return self.model.init(rngs, *args, **kwargs)

  def apply(self, variables, *args, **kwargs):
    return self._call(variables, args, kwargs)[0]

  def ops(self, variables, *args, **kwargs) -> dict[str, OpPolicy | None]:
    """Every quantizable op the model calls (``"path:kind"``) → its op policy (None = float).

    Traces the float ``apply`` abstractly (``jax.eval_shape``): nothing is computed, and an op
    its policy cannot run (a grouped convolution at int8) is listed all the same.
    """
    seen = {}

    def run(v, *a):
      out, s = self._call(v, a, kwargs, listing=True)
      seen.update(s)
      return out

    jax.eval_shape(run, variables, *args)
    return seen

  def unused_rules(self, variables, *args, **kwargs):
    return self.policy.unused_rules(self.ops(variables, *args, **kwargs))


MODULE_KEY_FIX = f"build it with rngs: qsync_jax.quantize(model, policy, rngs=nnx.Rngs({RNG_COLLECTION}=0))"


class QuantizedNnxModel(nnx.Module):
  """An ``nnx.Module`` that calls ``module`` with its quantizable ops at ``policy``: what
  ``qsync_jax.quantize`` returns for an nnx module. Train it as any nnx module::

      qmodel = qsync_jax.quantize(model, "int8", rngs=nnx.Rngs(qsync=0))
      optimizer = nnx.Optimizer(qmodel, optax.adam(1e-3), wrt=nnx.Param)

      @nnx.jit
      def step(qmodel, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(x, train=True), y))(qmodel)
        optimizer.update(qmodel, grads)
        return loss

  ``qmodel(*inputs, **kwargs)`` is ``module(*inputs, **kwargs)`` with the hooks of the module
  docstring installed on a copy of ``module`` (same variables); the variables the call changes
  (batch statistics, RNG counts) are written back into ``module``. ``module`` is the model given,
  not a copy: its variables are the quantized model's (training ``qmodel`` trains it, and it
  runs as the float model whenever it is called itself). Stochastic rounding draws one key per
  call from the ``qsync`` stream of ``rngs`` (or its default stream), then one per op; a policy
  that rounds to nearest needs no ``rngs``.

  The functional view of ``QuantizedNnxFunctional`` is kept, over ``module``'s variables as they
  are when it is called: ``init(None)`` returns them and ``apply(variables, *inputs, rngs=...)``,
  ``ops`` and ``unused_rules`` run as for a linen ``QuantizedModel``.
  """

  def __init__(self, module: nnx.Module, policy: PrecisionPolicy, tap: Tap | None = None, rngs=None):
    if rngs is not None and not (
      isinstance(rngs, nnx.Rngs) and (RNG_COLLECTION in rngs or "default" in rngs)
    ):
      raise QsyncError(
        f"quantize's rngs={rngs!r} is not an nnx.Rngs with a {RNG_COLLECTION!r} or default stream. "
        f"Fix: {MODULE_KEY_FIX}."
      )
    self.module = module
    self.policy = policy
    self.tap = tap
    self.rngs = rngs

  def __call__(self, *args, **kwargs):
    key = None if self.rngs is None else self.rngs[RNG_COLLECTION]()
    copy = nnx.merge(*nnx.split(self.module))
    install(copy, _Ops(self.policy, self.tap, key, key_fix=MODULE_KEY_FIX))
    out = copy(*args, **kwargs)
    nnx.update(self.module, nnx.state(copy))
    return out

  def functional(self) -> QuantizedNnxFunctional:
    """The functional view, over ``module`` as it is now."""
    return QuantizedNnxFunctional(NnxModel.of(self.module), self.policy, self.tap)

  def init(self, rngs=None, *args, **kwargs):
    return self.functional().init(rngs, *args, **kwargs)

  def apply(self, variables, *args, **kwargs):
    return self.functional().apply(variables, *args, **kwargs)

  def ops(self, variables, *args, **kwargs) -> dict[str, OpPolicy | None]:
    return self.functional().ops(variables, *args, **kwargs)

  def unused_rules(self, variables, *args, **kwargs):
    return self.functional().unused_rules(variables, *args, **kwargs)


def quantize_nnx(model, policy: PrecisionPolicy, tap: Tap | None = None, rngs=None):
  """``model`` under ``policy``: a ``QuantizedNnxModel`` for an ``nnx.Module``, a
  ``QuantizedNnxFunctional`` for an ``NnxModel``. Refuses a policy that would quantize none of
  its ops, and a model already quantized; warns (``QsyncWarning``) of a rule that matches none of
  the ops its modules can call."""
  if isinstance(model, QuantizedNnxModel):
    raise QsyncError(
      "the model is already quantized (a QuantizedNnxModel). Fix: quantize its float module, "
      "qmodel.module, with the policy wanted (or pass that module to a Task: the trainer applies the plan's)."
    )
  functional = NnxModel.of(model) if isinstance(model, nnx.Module) else model
  candidates = [op_name(path, k) for path, m in quantizable_modules(functional.module()) for k in kinds_of(m)]
  policy.check_quantizes_some(candidates, _bridge_hint(functional))
  policy.warn_unused_rules(candidates)
  if isinstance(model, nnx.Module):
    return QuantizedNnxModel(model, policy, tap, rngs)
  if rngs is not None:
    raise QsyncError(
      "quantize's rngs is for an nnx.Module; a functional model takes its key per call. "
      f"Fix: drop rngs and pass apply(..., rngs={{{RNG_COLLECTION!r}: key}})."
    )
  return QuantizedNnxFunctional(model, policy, tap)


def _bridge_hint(model: NnxModel) -> str:
  """What to do when the policy finds nothing: nnx modules holding linen ones hide their ops."""
  bridged = [path_name(p) for p, m in nnx.iter_graph(model.module()) if isinstance(m, nnx.bridge.ToNNX)]
  if bridged:
    return (
      f"the model wraps linen modules with nnx.bridge.ToNNX at {bridged}, whose ops qsync cannot see. "
      "Fix: quantize the linen module itself, or write it in nnx."
    )
  return ""
