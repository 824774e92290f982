"""The order in which the backward pass produces the gradient leaves, for the all-reduce.

A collective can start only when every gradient in it exists, and the backward produces the
last layers' gradients first. The trainer therefore hands order-free syncs (every built-in
one) the gradient leaves as a list in backward order. What that buys depends on who forms
the collectives:

* an all-reduce with ``bucket_bytes`` (``qsync_jax.sync.allreduce``) and the two-level sum
  (``qsync_jax.sync.two_level``) concatenate consecutive leaves into their own buckets, so in
  backward order the first bucket completes after the last layers' backward and can run while
  the earlier layers' backward does (PyTorch DDP's reverse-order buckets, obtained from the
  program rather than from hooks);
* without buckets each leaf is its own ``psum`` and XLA's all-reduce combiner packs them — in
  parameter-tree order whatever order they come in, so the compiled step holds the same
  collectives with the leaves in tree or in backward order (``docs/results.md`` times both
  against buckets).

* ``backward_order(grad_jaxpr)`` — the permutation of the gradient leaves by the position
  of the equation that produces each in the jaxpr of the gradient (``jax.make_jaxpr`` of
  ``jax.grad``): earlier-produced first, ties in tree order;
* ``in_order(tree, order)`` / ``from_order(leaves, tree, order)`` — a tree's leaves as a list
  in that order, and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax


def backward_order(grad_jaxpr, num_leaves: int) -> tuple[int, ...]:
  """Indices of the first ``num_leaves`` outputs of ``grad_jaxpr`` (a ``ClosedJaxpr`` whose
  leading outputs are the gradient leaves, e.g. ``jax.make_jaxpr(jax.grad(f, has_aux=True))``)
  sorted by the position of the equation producing each: an output that is an input or a
  constant (no equation) comes first; ties keep tree order."""
  jaxpr = grad_jaxpr.jaxpr
  produced = {id(v): i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  position = [produced.get(id(v), -1) for v in jaxpr.outvars[:num_leaves]]
  return tuple(sorted(range(num_leaves), key=lambda i: position[i]))


def in_order(tree, order: Sequence[int]) -> list:
  """The leaves of ``tree`` as a list, leaf ``order[0]`` first."""
  leaves = jax.tree.leaves(tree)
  return [leaves[i] for i in order]


def from_order(leaves: Sequence, tree, order: Sequence[int]):
  """The tree shaped like ``tree`` whose leaf ``order[j]`` is ``leaves[j]`` (inverse of ``in_order``)."""
  out = [None] * len(order)
  for j, i in enumerate(order):
    out[i] = leaves[j]
  return jax.tree.unflatten(jax.tree.structure(tree), out)
