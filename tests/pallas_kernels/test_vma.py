"""Every Pallas kernel's output is typed varying under ``shard_map(check_vma=True)`` wherever
its operands are.

An output typed invariant is cast back to varying by the next op, and the transpose of that
cast is a ``psum`` of the activation gradient over the devices: each device then trains on
the sum of all devices' gradients. Seen on 2 × H100 with the Mosaic GPU GEMM (one all-reduce
of every int8 op's input per step); on the CPU the kernels are traced (Mosaic GPU) or run in
interpret mode (Triton), which types their outputs the same way.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels._platform import vma
from pallas_kernels.gemm import api as gemm_api
from pallas_kernels.gemm import hopper
from pallas_kernels.quantize import api as quantize_api
from pallas_kernels.quantize.reference import quantize_reference

NT = (((1,), (1,)), ((), ()))


def operands(m=512, k=256, n=256):
  ka, kb = jax.random.split(jax.random.key(0))
  a, sa = quantize_reference(jax.random.normal(ka, (m, k)), "int8", (1,))
  b, sb = quantize_reference(jax.random.normal(kb, (n, k)), "int8", (1,))
  return a, b, sa.reshape(m), sb.reshape(n)


KERNELS = {
  "mosaic_gpu_gemm": lambda a, b, sa, sb: hopper.scaled_matmul_nt(a, b, sa, sb, jnp.float32),
  "triton_gemm": lambda a, b, sa, sb: gemm_api.scaled_dot_general(
    a, b, sa[:, None], sb[:, None], NT, impl="pallas", interpret=True
  ),
  "quantize": lambda a, b, sa, sb: quantize_api.quantize(
    a.astype(jnp.float32) * sa[:, None], "int8", (1,), impl="pallas", interpret=True
  )[0],
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_output_varies_where_the_operands_do(kernel):
  mesh = Mesh(jax.devices()[:2], ("data",))
  spec = (P("data"), P(), P("data"), P())  # rows of the activation sharded, the weight replicated
  seen = []

  def local(*args):
    out = KERNELS[kernel](*args)
    seen.append(vma(out))
    return out

  mapped = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=P("data"), check_vma=True)
  jax.make_jaxpr(mapped)(*operands())
  assert seen == [frozenset({"data"})]
