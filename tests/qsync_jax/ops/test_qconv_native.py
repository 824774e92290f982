"""Quantized convolution through XLA's own convolution (qsync_jax.ops.qconv_native)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from qsync_jax import OpPolicy, quantized_conv_general_dilated
from qsync_jax.ops.qconv_native import (
  _pads,
  conv_dlhs,
  conv_drhs,
  conv_fwd,
  native_quantized_conv,
  reference_quantized_conv,
)

HIGHEST = lax.Precision.HIGHEST


@pytest.mark.parametrize(
  "n,size,c,o,k,s,padding",
  [
    (2, 9, 3, 4, 3, 1, "SAME"),
    (2, 9, 3, 4, 3, 2, "SAME"),
    (2, 8, 3, 5, 1, 2, "VALID"),
    (1, 11, 2, 3, 7, 2, "SAME"),
  ],
)
def test_gradient_convolutions_are_jaxs_transposes(n, size, c, o, k, s, padding):
  """Integer-valued data: every sum is exact in float32, so the results must be equal."""
  x = jnp.round(3 * jax.random.normal(jax.random.key(0), (n, size, size, c)))
  w = jnp.round(3 * jax.random.normal(jax.random.key(1), (k, k, c, o)))
  pads = _pads(padding, (size, size), (k, k), (s, s))
  y, vjp = jax.vjp(lambda a, b: conv_fwd(a, b, (s, s), pads, precision=HIGHEST), x, w)
  g = jnp.round(3 * jax.random.normal(jax.random.key(2), y.shape))
  dx, dw = vjp(g)
  np.testing.assert_array_equal(conv_dlhs(g, w, x.shape, (s, s), pads, precision=HIGHEST), dx)
  np.testing.assert_array_equal(conv_drhs(x, g, w.shape, (s, s), pads, precision=HIGHEST), dw)


POLICIES = {
  "int8 (stochastic gradients)": (OpPolicy.preset("int8"), 1e-6),
  "int8 per tensor": (OpPolicy.uniform("int8", granularity="per_tensor"), 1e-6),
  "fp8": (OpPolicy.preset("fp8"), 1e-6),
  # fp16 gradient convolutions round their output to fp16 (as cuDNN's do); the reference keeps
  # float32 outputs of the fp16-rounded operands
  "int8_fwd": (OpPolicy.preset("int8_fwd"), 2e-3),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_native_equals_its_reference(name):
  policy, tol = POLICIES[name]
  x = jax.random.normal(jax.random.key(0), (2, 9, 9, 8))
  w = jax.random.normal(jax.random.key(1), (3, 3, 8, 16))
  key = jax.random.key(5)
  y, vjp = jax.vjp(lambda a, b: native_quantized_conv(a, b, (2, 2), "SAME", policy, key), x, w)
  y_ref, vjp_ref = jax.vjp(lambda a, b: reference_quantized_conv(a, b, (2, 2), "SAME", policy, key), x, w)
  g = jax.random.normal(jax.random.key(3), y.shape)

  def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

  assert rel(y, y_ref) < 1e-6
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert rel(got, want) < tol
  # quantization is real: the fp32 convolution differs by about an int8 / fp8 step
  y32 = conv_fwd(x, w, (2, 2), _pads("SAME", (9, 9), (3, 3), (2, 2)), precision=HIGHEST)
  assert 1e-3 < rel(y, y32) < 0.06


def test_conv_op_native_option_takes_any_layout():
  """quantized_conv_general_dilated(impl='native') in NCHW / OIHW equals the NHWC op, and the
  im2col path (other scales) is as close to float32."""
  policy = OpPolicy.preset("int8_fwd")
  x = jax.random.normal(jax.random.key(0), (2, 8, 10, 10))  # NCHW
  w = jax.random.normal(jax.random.key(1), (6, 8, 3, 3))  # OIHW
  dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NCHW", "OIHW", "NCHW"))

  def op(impl):
    return lambda a, b: quantized_conv_general_dilated(
      a, b, (1, 1), "SAME", None, None, dn, op_policy=policy, impl=impl
    )

  y = op("native")(x, w)
  y_nhwc = native_quantized_conv(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), (1, 1), "SAME", policy)
  np.testing.assert_allclose(y, y_nhwc.transpose(0, 3, 1, 2), rtol=1e-6, atol=1e-6)
  y32 = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn, precision=HIGHEST)
  for impl in ("native", "im2col"):
    got = op(impl)(x, w)
    assert float(jnp.linalg.norm(got - y32) / jnp.linalg.norm(y32)) < 0.02
  grads = jax.grad(lambda a, b: jnp.sum(op("native")(a, b) ** 2), argnums=(0, 1))(x, w)
  assert [g.shape for g in grads] == [x.shape, w.shape]
  with pytest.raises(ValueError, match="impl="):
    quantized_conv_general_dilated(x, w, (1, 1), "SAME", None, None, dn, op_policy=policy, impl="cudnn")
