"""Reads the precision of every GEMM in a jaxpr, nested jaxprs included.

An operand's precision is its dtype, except that a float32 operand made by upcasting a
16-bit value counts as that 16-bit type: on the CPU backend ``qsync_jax.ops.qdot`` runs 16-bit
products as float32 products of the 16-bit-rounded values (XLA's CPU runtime cannot run
some bf16 × bf16 → f32 dots), the same numbers as the 16-bit product on a GPU.
"""

import collections

GEMMS = ("dot_general", "conv_general_dilated")
SIXTEEN_BIT = ("bfloat16", "float16")


def _walk(jaxpr, found, primitives):
  made_by = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "convert_element_type" and str(eqn.invars[0].aval.dtype) in SIXTEEN_BIT:
      made_by[eqn.outvars[0]] = str(eqn.invars[0].aval.dtype)
    if eqn.primitive.name in primitives:
      dtypes = tuple(made_by.get(v, str(v.aval.dtype)) if hasattr(v, "aval") else "const" for v in eqn.invars)
      found.append((eqn.primitive.name, *dtypes))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _walk(inner, found, primitives)


def gemm_dtypes(jaxpr, primitives=GEMMS) -> collections.Counter:
  """Counter of ``(primitive, lhs precision, rhs precision)`` over the jaxpr's GEMMs."""
  found = []
  _walk(getattr(jaxpr, "jaxpr", jaxpr), found, primitives)
  return collections.Counter(found)
