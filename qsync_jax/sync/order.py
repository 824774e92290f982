"""The order in which the backward pass produces the gradient leaves, for the all-reduce.

XLA hands the gradient ``psum`` of the trainer to its all-reduce combiner, which packs the
operands into collectives of up to a threshold (30 MiB on GPUs) *in operand order*; a
collective can start only when every gradient in it exists. In the parameter tree's order
(modules sorted by name: ``block0`` first) every collective holds some of the first layers'
gradients, which the backward pass produces last, so no all-reduce overlaps the backward
(measured on 4 H200s: three of four collectives ran after it). Handed over in the order the
backward produces them, the first collective closes after the last layers' backward and runs
while the earlier layers' backward does: PyTorch DDP's reverse-order buckets, obtained from
the program rather than from hooks.

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
