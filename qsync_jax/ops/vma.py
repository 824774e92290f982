"""``shard_map`` and its varying-manual-axes (VMA) typing, across jax versions.

``shard_map(f, mesh=..., in_specs=..., out_specs=..., check_vma=True)`` is ``jax.shard_map``
(``jax.experimental.shard_map.shard_map`` on jax < 0.7). With ``check_vma`` a value inside is
typed *varying* over the mesh axes where it may differ per device, and *invariant* elsewhere.
A ``custom_vjp`` must return cotangents typed like its inputs, so ops give both operands the
union of their varying axes first: the cast is a no-op on values, and its transpose (a
``psum``) gives an invariant input its summed gradient.
"""

from __future__ import annotations

import jax

from pallas_kernels._platform import pvary, varying_like, vma

__all__ = ["match_vma", "pvary", "shard_map", "vma"]


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool = True):
  """``jax.shard_map(f, ...)`` where present, else ``jax.experimental.shard_map.shard_map``
  (whose ``check_rep`` is this ``check_vma``)."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
  from jax.experimental.shard_map import shard_map as legacy  # jax < 0.7

  return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


def match_vma(*xs):
  """Every array typed varying over the union of their varying axes."""
  return tuple(varying_like(x, *xs) for x in xs)
