"""The micro-benchmarks of ``benchmarks.e2e``: attention (the products as Flax's einsums at
each precision, and fused ``jax.nn.dot_product_attention``) and convolutions at ResNet-50
layer shapes (native bf16, 8-bit im2col and native), each timed forward + backward with the
gradients' error against the first case."""

from __future__ import annotations

import functools
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from planners.profiler import timing
from qsync_jax import OpPolicy, quantized_conv_general_dilated
from qsync_jax.ops.quant_ops import QuantizedEinsum


def attention_cases(seq: int, tiny: bool):
  """``{case: fn(q, k, v, mask) -> out}`` and the operands (8192 tokens, 12 heads of 64)."""
  heads, dim, tokens = (2, 16, 256) if tiny else (12, 64, 8192)
  batch = max(1, tokens // seq)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (batch, seq, heads, dim), jnp.float32).astype(jnp.bfloat16) for kk in keys)
  mask = nn.make_causal_mask(jnp.zeros((batch, seq), jnp.int32))
  impl = "cudnn" if jax.default_backend() == "gpu" else "xla"

  def flax_attention(q, k, v, mask, preset=None):
    if preset is None:
      return nn.dot_product_attention(q, k, v, mask=mask)
    policy, key = OpPolicy.preset(preset), jax.random.key(1)
    qk, pv = (QuantizedEinsum(None, policy, key if policy.needs_rng else None, None) for _ in range(2))
    return nn.dot_product_attention(
      q, k, v, mask=mask, qk_attn_weights_einsum=qk, attn_weights_value_einsum=pv
    )

  def fused(q, k, v, mask, causal):
    with jax.numpy_dtype_promotion("standard"):
      if causal:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
      return jax.nn.dot_product_attention(q, k, v, mask=mask.astype(jnp.bool_), implementation=impl)

  cases = {
    "bf16_einsum": flax_attention,
    "int8": functools.partial(flax_attention, preset="int8"),
    "int8_fwd": functools.partial(flax_attention, preset="int8_fwd"),
    "fp8": functools.partial(flax_attention, preset="fp8"),
    f"{impl}_mask": functools.partial(fused, causal=False),
    f"{impl}_causal": functools.partial(fused, causal=True),
  }
  return cases, (q, k, v, mask)


CONV_SHAPES = {  # (N, H, W, C_in, C_out, kernel, stride): ResNet-50 layers at batch 32
  "56x56x64_3x3_64": (32, 56, 56, 64, 64, 3, 1),
  "28x28x128_3x3_128": (32, 28, 28, 128, 128, 3, 1),
  "14x14x256_3x3_256": (32, 14, 14, 256, 256, 3, 1),
  "7x7x512_3x3_512": (32, 7, 7, 512, 512, 3, 1),
  "56x56x256_1x1_64": (32, 56, 56, 256, 64, 1, 1),
  "14x14x1024_1x1_256": (32, 14, 14, 1024, 256, 1, 1),
}
TINY_CONV_SHAPES = {"8x8x8_3x3_8": (2, 8, 8, 8, 8, 3, 1)}
CONV_CASES = {  # case: (op policy preset, impl); "bf16" is the native bf16 convolution
  "bf16": ("bf16", "im2col"),
  "int8_im2col": ("int8", "im2col"),
  "int8_native": ("int8", "native"),
  "int8_fwd_im2col": ("int8_fwd", "im2col"),
  "int8_fwd_native": ("int8_fwd", "native"),
  "fp8_native": ("fp8", "native"),
}


def conv_case(preset: str, impl: str, stride: int):
  policy = OpPolicy.preset(preset)
  key = jax.random.key(1) if policy.needs_rng else None

  def conv(x, w):
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
    return quantized_conv_general_dilated(
      x, w, (stride, stride), "SAME", None, None, dn, op_policy=policy, key=key, impl=impl
    )

  return conv


def fwd_bwd(fn, n_args: int):
  """A jitted forward + the gradients to the first ``n_args`` arguments of ``sum(fn(...) · g)``."""

  def loss(*args):
    *operands, g = args
    return jnp.sum(fn(*operands).astype(jnp.float32) * g)

  return jax.jit(jax.grad(loss, argnums=tuple(range(n_args))))


def time_micro(cases: dict, operands, n_grads: int, steps: int) -> dict:
  """``{case: {"ms", "ms_min", "ms_max", "compile_s", "rel_err"}}`` of forward + backward of each
  case; ``rel_err`` of its gradients against the first case's."""
  out, reference = {}, None
  clock = timing.default_step_clock()
  for case, fn in cases.items():
    try:
      g = jnp.ones(jax.eval_shape(fn, *operands).shape, jnp.float32)
      f = fwd_bwd(fn, n_grads)
      t0 = time.perf_counter()
      f = f.lower(*operands, g).compile()
      compile_s = time.perf_counter() - t0
      grads = f(*operands, g)
      ms, samples = timing.timed_ms(lambda f=f, g=g: f(*operands, g), steps, clock=clock)
    except Exception as e:  # noqa: BLE001 - a case a backend cannot run is reported, the rest go on
      out[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      continue
    flat = np.concatenate([np.asarray(x, np.float32).ravel() for x in grads])
    reference = flat if reference is None else reference
    err = float(np.linalg.norm(flat - reference) / max(np.linalg.norm(reference), 1e-30))
    out[case] = {
      "ms": ms,
      "ms_min": min(samples),
      "ms_max": max(samples),
      "compile_s": compile_s,
      "rel_err": err,
    }
  return out


def conv_operands(shape):
  n, h, w, c, o, k, _ = shape
  x = jax.random.normal(jax.random.key(0), (n, h, w, c), jnp.float32).astype(jnp.bfloat16)
  wt = (jax.random.normal(jax.random.key(1), (k, k, c, o), jnp.float32) / math.sqrt(k * k * c)).astype(
    jnp.bfloat16
  )
  return x, wt
