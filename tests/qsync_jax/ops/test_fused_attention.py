"""Attention at one 16-bit policy through jax.nn.dot_product_attention (qsync_jax.ops.qattention)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qsync_jax import OpPolicy, PrecisionPolicy, Rule, quantize
from qsync_jax.ops.qattention import fused_attention


class Attention(nn.Module):
  dropout: float = 0.0
  dtype: jnp.dtype = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(x[..., 0])
    attn = nn.MultiHeadDotProductAttention(2, dtype=self.dtype, dropout_rate=self.dropout, deterministic=True)
    return attn(x, mask=mask)


def setup(dropout=0.0):
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  model = Attention(dropout)
  return model, model.init(jax.random.key(1), x), x


def float32_logits(jaxpr_text: str) -> int:
  """dot_generals writing float32 results: the fused path's logits (jax.nn writes them in
  float32, with a heads-per-group axis); every product of the bf16 einsum path is bf16."""
  return len(re.findall(r"f32\[[\d,]+\] = dot_general", jaxpr_text))


def run(qmodel, variables, x, fused):
  with fused_attention(fused):  # a trace-time switch: fresh functions, traced (and jitted) in it
    y = jax.jit(lambda v: qmodel.apply(v, x))(variables)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(qmodel.apply(v, x).astype(jnp.float32) ** 2)))(variables)
    text = str(jax.make_jaxpr(lambda v: qmodel.apply(v, x))(variables))
  return y, grads, text


@pytest.mark.standard_promotion  # jax.nn.dot_product_attention's gradient promotes bf16 with float32
def test_bf16_attention_is_fused_inside_the_block_only():
  model, variables, x = setup()
  qmodel = quantize(model, "bf16")
  y, grads, text = run(qmodel, variables, x, fused=True)
  y_plain, grads_plain, text_plain = run(qmodel, variables, x, fused=False)
  assert float32_logits(text) == 1 and float32_logits(text_plain) == 0
  # the same attention: against the float32 model, the fused path is as close as Flax's bf16
  # einsums (closer: its logits and softmax stay float32)
  y_ref, grads_ref, _ = run(quantize(Attention(dtype=jnp.float32), "fp32"), variables, x, fused=True)
  for got, plain, ref in ((y, y_plain, y_ref), (grads, grads_plain, grads_ref)):
    assert rel_err(got, ref) < 0.03
    assert rel_err(got, ref) <= rel_err(plain, ref)


def rel_err(tree, ref_tree):
  a = np.concatenate([np.asarray(t, np.float64).ravel() for t in jax.tree.leaves(tree)])
  b = np.concatenate([np.asarray(t, np.float64).ravel() for t in jax.tree.leaves(ref_tree)])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
  "policy",
  [
    PrecisionPolicy.uniform("int8_fwd"),  # quantized products: quantized einsums
    PrecisionPolicy(rules=(Rule(".*", OpPolicy.preset("bf16"), kind="attention_qk"),)),  # pv not bf16
  ],
)
def test_other_attention_policies_are_not_fused(policy):
  model, variables, x = setup()
  _, _, text = run(quantize(model, policy), variables, x, fused=True)
  assert float32_logits(text) == 0


def test_attention_with_dropout_is_not_fused():
  model, variables, x = setup(dropout=0.1)
  _, _, text = run(quantize(model, "bf16"), variables, x, fused=True)
  assert float32_logits(text) == 0
