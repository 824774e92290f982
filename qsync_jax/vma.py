"""Varying-manual-axes (VMA) typing under ``shard_map`` with ``check_vma``, across jax versions.

Inside ``shard_map`` a value is typed *varying* over the mesh axes where it may differ per
device, and *invariant* elsewhere. A ``custom_vjp`` must return cotangents typed like its
inputs, so ops give both operands the union of their varying axes first: the cast is a no-op
on values, and its transpose (a ``psum``) gives an invariant input its summed gradient.
"""

from __future__ import annotations

from pallas_kernels._platform import pvary, varying_like, vma

__all__ = ["match_vma", "pvary", "vma"]


def match_vma(*xs):
  """Every array typed varying over the union of their varying axes."""
  return tuple(varying_like(x, *xs) for x in xs)
