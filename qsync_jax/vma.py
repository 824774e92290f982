"""Varying-manual-axes (VMA) typing under ``shard_map`` with ``check_vma``, across jax versions.

Inside ``shard_map`` a value is typed *varying* over the mesh axes where it may differ per
device, and *invariant* elsewhere. A ``custom_vjp`` must return cotangents typed like its
inputs, so ops give both operands the union of their varying axes first: the cast is a no-op
on values, and its transpose (a ``psum``) gives an invariant input its summed gradient.
"""

from __future__ import annotations

from jax import lax

from pallas_kernels._platform import vma

__all__ = ["match_vma", "pvary", "vma"]


def pvary(x, axes):
  """``x`` typed varying over ``axes`` too (no-op on values)."""
  axes = tuple(a for a in axes if a not in vma(x))
  if not axes:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, axes, to="varying")
  return lax.pvary(x, axes)


def match_vma(*xs):
  """Every array typed varying over the union of their varying axes."""
  union = frozenset().union(*(vma(x) for x in xs))
  return tuple(pvary(x, tuple(sorted(union))) for x in xs)
