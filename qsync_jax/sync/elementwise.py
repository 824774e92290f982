"""Whether an optax optimizer may run on flat shards of the params and mean the same update.

A sharded optimizer update (the hybrid step's ``optimizer_update="sharded"``, QSDP) runs
``optimizer.update`` on each device's flat 1-D shard of every param leaf. That equals the update
on the whole tree only when the update is *elementwise*: every output element depends on the
same element of the gradient, the state and the params (sgd, momentum, adam, adamw, adagrad,
rmsprop, lion…). ``check_elementwise_optimizer`` traces the update abstractly (``jax.make_jaxpr``
over ``jax.ShapeDtypeStruct``: nothing runs) twice — on the params' shapes and on the flat
shard shapes — and refuses, with a ``QsyncError`` naming the fix:

* an update holding an operation that reads across the elements of the params, gradients or
  their state (``REDUCING``: sums, maxima, norms, sorts, cumulative ops, contracting dots, slicing
  and gathers; a schedule's arithmetic on the step count does not count), e.g.
  ``optax.clip_by_global_norm``, LAMB/LARS trust ratios, Adafactor's factored moments;
* an update whose operations differ between the two traces other than by shape operations
  (``SHAPE_OPS``), e.g. a weight-decay mask chosen from a leaf's rank
  (``adamw(mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))``), which sees only vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from qsync_jax.errors import QsyncError

REDUCING = frozenset(
  {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "reduce",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "top_k",
    "conv_general_dilated",
    "gather",
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter_mul",
    "scatter_min",
    "scatter_max",
    "dynamic_slice",
    "dynamic_update_slice",
    "slice",
    "concatenate",
    "pad",
    "rev",
    "iota",
  }
)
"""Primitives whose output element reads other elements (or their position) of an input;
``dot_general`` counts when it contracts a dimension."""

SHAPE_OPS = frozenset(
  {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "copy", "copy_p"}
)
"""Primitives that only move or repeat elements: left out when the two traces are compared."""


def update_primitives(optimizer, params) -> list[tuple[str, bool]]:
  """``(primitive name, reads the params' elements)`` of every operation of
  ``optimizer.update(params, optimizer.init(params), params)`` traced on ``params``' shapes, nested
  jaxprs flattened, in order. An operation reads the params' elements when an operand derives
  from an array input (a gradient, param or state leaf of rank ≥ 1); a learning-rate schedule's
  arithmetic on the step count does not. A contracting ``dot_general`` is named
  ``"dot_general(contracting)"``."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
  with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with int counts
    state = jax.eval_shape(optimizer.init, abstract)
    jaxpr = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(abstract, state, abstract)
  out: list[tuple[str, bool]] = []
  _walk(jaxpr.jaxpr, [len(v.aval.shape) > 0 for v in jaxpr.jaxpr.invars], out)
  return out


def _walk(jaxpr, from_arrays: Sequence[bool], out: list) -> list[bool]:
  """Appends ``jaxpr``'s operations to ``out`` (see ``update_primitives``); ``from_arrays``: which
  inputs derive from array inputs. Returns the same for its outputs."""
  derived = dict(zip(jaxpr.invars, from_arrays))

  def reads(v) -> bool:
    return not isinstance(v, Literal) and derived.get(v, False)

  for eqn in jaxpr.eqns:
    ins = [reads(v) for v in eqn.invars]
    inner = [
      getattr(sub, "jaxpr", sub)
      for value in eqn.params.values()
      for sub in (value if isinstance(value, (list, tuple)) else (value,))
    ]
    inner = [j for j in inner if hasattr(j, "eqns")]
    if len(inner) == 1 and len(inner[0].invars) == len(ins):  # a call (jit, custom_jvp…): its body
      outs = _walk(inner[0], ins, out)
    else:  # control flow: every input may reach every output
      for j in inner:
        _walk(j, [any(ins)] * len(j.invars), out)
      if not inner:
        name = eqn.primitive.name
        if name == "dot_general" and any(eqn.params["dimension_numbers"][0]):
          name = "dot_general(contracting)"
        out.append((name, any(ins)))
      outs = [any(ins)] * len(eqn.outvars)
    derived.update(zip(eqn.outvars, outs))
  return [reads(v) for v in jaxpr.outvars]


def check_elementwise_optimizer(
  optimizer, params, shard_sizes: Sequence[int], *, where: str, fix: str, step_clips: bool = False
) -> None:
  """``QsyncError`` unless ``optimizer``'s update on flat shards of ``shard_sizes[j]`` elements of
  ``params``' leaf ``j`` (in ``jax.tree.leaves`` order) computes what its update on ``params``
  computes (module doc). ``params``: arrays, tracers or ``ShapeDtypeStruct``s; ``where`` names
  the sharded update (e.g. ``"optimizer_update='sharded'"``), ``fix`` the way out besides
  removing the offending transformation; ``step_clips``: the error names the step's own
  ``clip_norm`` as the replacement of ``optax.clip_by_global_norm``."""
  leaves, treedef = jax.tree.flatten(params)
  flat = jax.tree.unflatten(
    treedef,
    [jax.ShapeDtypeStruct((int(m),), jnp.result_type(x)) for x, m in zip(leaves, shard_sizes)],
  )
  whole, shards = update_primitives(optimizer, params), update_primitives(optimizer, flat)
  reducing = sorted({p for p, on_arrays in whole + shards if on_arrays and _reads_across(p)})
  if reducing:
    clip = (
      "clip with the step's clip_norm= (Trainer(clip_norm=...), qsync train --clip-norm), which takes the "
      "norm over the whole gradient, instead of optax.clip_by_global_norm; "
      if step_clips
      else ""
    )
    raise QsyncError(
      f"optimizer: its update reads across array elements ({', '.join(reducing)}), so with {where} — "
      "each device updating flat 1-D shards of every param leaf — it would compute something other "
      "than the update of the whole tree (optax.clip_by_global_norm would clip by a shard's norm; "
      f"LAMB/LARS trust ratios and Adafactor's factored moments would see a shard). Fix: {clip}use an "
      f"elementwise optimizer (sgd, momentum, adam, adamw…), or {fix}."
    )
  if [p for p, _ in whole if p not in SHAPE_OPS] != [p for p, _ in shards if p not in SHAPE_OPS]:
    raise QsyncError(
      f"optimizer: its update on flat 1-D shards runs other operations than on the params' shapes, so "
      f"with {where} — each device updating flat shards of every param leaf — it would compute "
      "something else (e.g. a weight-decay mask chosen from a leaf's rank, "
      "mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), sees only vectors). Fix: give the mask as "
      f"a fixed tree of booleans (or a function of the parameter names), or {fix}."
    )


def _reads_across(primitive: str) -> bool:
  return primitive in REDUCING or primitive == "dot_general(contracting)"
