"""Convolutions in the dimension order of XLA:CPU's fast kernels, inside nested computations too.

XLA:CPU runs a convolution with its library kernels (Eigen, YNNPACK) only in the canonical
dimension order — input (batch, spatial…, feature), kernel (spatial…, in, out), output (batch,
spatial…, feature). Its ``ConvCanonicalization`` pass writes any other convolution as transposes
around a canonical one, but it visits only the entry computation: a convolution inside a nested
computation — a ``lax.switch`` branch (the hybrid step's per-device policy), a ``lax.scan`` body
(its micro-steps) — in another order runs in XLA's elemental loop emitter, 10–250× slower. JAX's
autodiff emits the gradient convolutions in other orders (the weight gradient contracts over the
batch), so a convnet's backward inside a branch ran at the loop emitter's speed.

``canonical_convs(fn)`` is ``fn`` re-traced with every non-canonical ``conv_general_dilated``
written as that pass writes it: transposes to the canonical order, the same convolution
(strides, padding, dilations, groups, precision unchanged), a transpose back — equal values. It
walks into ``jit`` calls and ``custom_jvp`` functions (inlined: nothing differentiates the result)
and ``scan``/``cond``/``while`` bodies (rebuilt with ``lax``); other nested jaxprs stay as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
from jax import lax
from jax.extend.core import Literal

INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}
"""Call primitives whose body is evaluated in place (primitive name → the param holding it)."""


def canonical_dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
  """``(lhs, rhs, out)`` specs of the canonical order for ``ndim``-dimensional operands:
  NHWC / HWIO / NHWC for ``ndim == 4``."""
  spatial = tuple(range(1, ndim - 1))
  return lax.ConvDimensionNumbers(
    lhs_spec=(0, ndim - 1, *spatial),
    rhs_spec=(ndim - 1, ndim - 2, *range(ndim - 2)),
    out_spec=(0, ndim - 1, *spatial),
  )


def canonical_convs(fn: Callable) -> Callable:
  """``fn`` with every convolution in the canonical dimension order (module doc); equivalent to
  ``fn``. Traces ``fn`` once per call (inside the caller's trace: call it under ``jit``)."""

  def rewritten(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return rewritten


def _eval(jaxpr, consts, args) -> list:
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for eqn in jaxpr.eqns:
    outs = _eval_eqn(eqn, [read(v) for v in eqn.invars])
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, invals) -> list:
  name, params = eqn.primitive.name, eqn.params
  if name == "conv_general_dilated":
    return [_canonical_conv(eqn.primitive, *invals, **params)]
  if name in INLINED:
    body = params[INLINED[name]]
    return _eval(getattr(body, "jaxpr", body), getattr(body, "consts", ()), invals)
  if name == "scan":
    return _scan(invals, **params)
  if name == "cond":
    branches = [_as_fn(b) for b in params["branches"]]
    return lax.switch(invals[0], branches, *invals[1:])
  if name == "while":
    return _while(invals, **params)
  bound = eqn.primitive.get_bind_params(params)  # (subfuns, params) on older jax versions
  subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
  with eqn.ctx.manager if hasattr(eqn, "ctx") else contextlib.nullcontext():
    out = eqn.primitive.bind(*subfuns, *invals, **bound)
  return list(out) if eqn.primitive.multiple_results else [out]


def _as_fn(closed) -> Callable:
  return lambda *args: _eval(closed.jaxpr, closed.consts, args)


def _scan(invals, *, jaxpr, num_consts, num_carry, length, reverse, unroll, **_):
  consts, init, xs = (
    invals[:num_consts],
    invals[num_consts : num_consts + num_carry],
    invals[num_consts + num_carry :],
  )

  def body(carry, x):
    out = _eval(jaxpr.jaxpr, jaxpr.consts, [*consts, *carry, *x])
    return out[:num_carry], out[num_carry:]

  carry, ys = lax.scan(body, init, xs, length=length, reverse=reverse, unroll=unroll)
  return [*carry, *ys]


def _while(invals, *, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts, **_):
  cond_consts, body_consts = invals[:cond_nconsts], invals[cond_nconsts : cond_nconsts + body_nconsts]
  init = invals[cond_nconsts + body_nconsts :]

  def cond(carry):
    return _eval(cond_jaxpr.jaxpr, cond_jaxpr.consts, [*cond_consts, *carry])[0]

  def body(carry):
    return _eval(body_jaxpr.jaxpr, body_jaxpr.consts, [*body_consts, *carry])

  return lax.while_loop(cond, body, list(init))


def _canonical_conv(primitive, lhs, rhs, *, dimension_numbers, **params):
  """``primitive.bind(lhs, rhs, ...)`` computed as transposes around the canonical convolution."""
  ndim = lhs.ndim
  canonical = canonical_dimension_numbers(ndim)
  if tuple(dimension_numbers) == tuple(canonical):
    return primitive.bind(lhs, rhs, dimension_numbers=dimension_numbers, **params)
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  lhs = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
  rhs = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
  out = primitive.bind(lhs, rhs, dimension_numbers=canonical, **params)
  # canonical axis of each original output axis: batch 0, spatial k at 1 + k, feature last
  back = [0] * ndim
  back[out_spec[0]], back[out_spec[1]] = 0, ndim - 1
  for k, axis in enumerate(out_spec[2:]):
    back[axis] = 1 + k
  return lax.transpose(out, tuple(back))
