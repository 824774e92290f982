"""Embedding lookups stay gathers under every policy; uniform 16-bit policies keep the plain program
(an LM and a CNN)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.models.transformer import TransformerLM
from qsync_jax import OpPolicy, PrecisionPolicy, QsyncError, Rule, quantize, quantized_dot_general
from qsync_jax.ops.qattention import fused_attention
from qsync_jax.ops.qembed import fake_quantize, quantized_embed_lookup

VOCAB, WIDTH = 37, 16  # 37: no other dim of the models below has this size

NEAREST_POLICIES = {
  "bf16": OpPolicy.preset("bf16"),
  "fp16": OpPolicy.preset("fp16"),
  "int8": OpPolicy.uniform("int8"),
  "int8 per tensor": OpPolicy.uniform("int8", granularity="per_tensor"),
  "int8_fwd": OpPolicy.preset("int8_fwd"),
  "fp8": OpPolicy.preset("fp8"),
}


def lookup_data():
  table = jax.random.normal(jax.random.key(0), (VOCAB, WIDTH))
  ids = jax.random.randint(jax.random.key(1), (4, 5), 0, VOCAB)
  g = jax.random.normal(jax.random.key(2), (4, 5, WIDTH))
  return table, ids, g


@pytest.mark.parametrize("name", sorted(NEAREST_POLICIES))
def test_lookup_equals_the_one_hot_product(name):
  """The gather computes what one_hot(ids) · table computes through quantized_dot_general:
  the same forward values and the same table gradient (up to the scale epilogue's float
  rounding: the GEMM multiplies by the one-hot's scale 1/127 and back)."""
  policy = NEAREST_POLICIES[name]
  table, ids, g = lookup_data()
  dims = (((2,), (0,)), ((), ()))
  y, vjp = jax.vjp(lambda t: quantized_embed_lookup(t, ids, policy), table)
  y_ref, vjp_ref = jax.vjp(
    lambda t: quantized_dot_general(jax.nn.one_hot(ids, VOCAB, dtype=t.dtype), t, dims, policy), table
  )
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(vjp(g)[0], vjp_ref(g)[0], rtol=1e-6, atol=1e-6)
  # and the rounding is real: the rows differ from the fp32 table's
  assert float(jnp.max(jnp.abs(y - table[ids]))) > 1e-4


def test_stochastic_gradient_rounding_is_unbiased_and_needs_a_key():
  table, ids, g = lookup_data()
  policy = OpPolicy.preset("int8")  # stochastic rounding of the table's gradient
  quantized_embed_lookup(table, ids, policy)  # the lookup alone (evaluation) needs no key
  with pytest.raises(QsyncError, match="rounds its gradients stochastically.*Fix"):
    jax.vjp(lambda t: quantized_embed_lookup(t, ids, policy), table)[1](g)

  def grad(key):
    return jax.vjp(lambda t: quantized_embed_lookup(t, ids, policy, key), table)[1](g)[0]

  exact = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)[1](g)[0]
  grads = jax.vmap(grad)(jax.random.split(jax.random.key(3), 256))
  one = np.asarray(grads[0] - exact)
  mean = np.asarray(jnp.mean(grads, axis=0) - exact)
  # one draw is off by up to an int8 step of the largest |g| per feature (~3/127); the mean
  # of 256 independent draws is ~16x closer (1/sqrt(256)), far below one step
  step = float(jnp.max(jnp.abs(g))) / 127
  assert np.abs(one).max() > 0.2 * step
  assert np.abs(mean).max() < 0.25 * step


def test_fake_quantize_scales():
  x = jnp.asarray([[1.0, -2.0], [0.5, 4.0]])
  np.testing.assert_allclose(fake_quantize(x, "int8", (0, 1)), x, atol=4.0 / 127)
  assert fake_quantize(x, "fp32", ()) is x
  assert fake_quantize(x, "bf16", ()).dtype == x.dtype


class EmbedMLP(nn.Module):
  """Token lookup, then a Dense: the vocabulary appears only in the table."""

  @nn.compact
  def __call__(self, ids):
    return nn.Dense(8)(nn.Embed(VOCAB, WIDTH)(ids))


def vocab_gemms(jaxpr):
  """dot_generals with an operand that has a vocabulary-sized dim, nested jaxprs included."""
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "dot_general" and any(VOCAB in v.aval.shape for v in eqn.invars):
        found.append(eqn)
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("preset", ["bf16", "fp16", "int8", "int8_fwd", "fp8", "fp32"])
def test_training_step_has_no_vocabulary_gemm(preset):
  model = EmbedMLP()
  ids = jax.random.randint(jax.random.key(0), (4, 6), 0, VOCAB)
  variables = model.init(jax.random.key(1), ids)
  qmodel = quantize(model, preset)
  loss = lambda v: jnp.sum(qmodel.apply(v, ids, rngs={"qsync": jax.random.key(2)}) ** 2)  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(loss))(variables)
  assert vocab_gemms(jaxpr) == []
  assert "embed" in " ".join(qmodel.ops(variables, ids, rngs={"qsync": jax.random.key(2)}))


def test_tap_sees_the_lookup_as_its_one_hot_product():
  """Planners and indicators see an embed op as the GEMM one_hot(ids) · table, whose rerun
  at the op's policy gives the lookup's values."""
  model = EmbedMLP()
  ids = jax.random.randint(jax.random.key(0), (4, 6), 0, VOCAB)
  variables = model.init(jax.random.key(1), ids)
  seen = {}

  def tap(info, y):
    if info.kind == "embed":
      seen["shapes"] = (info.lhs_shape, info.rhs_shape)
      seen["diff"] = jnp.max(jnp.abs(info.rerun(info.op_policy, info.lhs, info.rhs) - y))
    return y

  quantize(model, PrecisionPolicy.uniform(OpPolicy.uniform("int8")), tap).apply(variables, ids)
  assert seen["shapes"] == ((4, 6, VOCAB), (VOCAB, WIDTH))
  assert float(seen["diff"]) < 1e-6


def lm_loss_fn(apply, ids):
  def loss(params):
    logits = apply({"params": params}, ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

  return loss


class Bf16LM(nn.Module):
  """Every module in bf16, the embedding table included."""

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, 32, dtype=jnp.bfloat16)(ids)
    x = x + nn.MultiHeadDotProductAttention(2, dtype=jnp.bfloat16)(x, mask=nn.make_causal_mask(ids))
    x = x + nn.Dense(32, dtype=jnp.bfloat16)(nn.gelu(nn.Dense(64, dtype=jnp.bfloat16)(x)))
    return nn.Dense(VOCAB, dtype=jnp.bfloat16)(x).astype(jnp.float32)


def step_jaxpr(model, policy, ids):
  variables = model.init(jax.random.key(1), ids[:, :-1])
  apply = model.apply if policy is None else quantize(model, policy).apply
  return str(jax.make_jaxpr(jax.grad(lm_loss_fn(apply, ids)))(variables["params"]))


def test_uniform_bf16_on_a_bf16_model_is_the_plain_program():
  """With Flax's own attention (fused attention off, the default on a CPU); fused (the default
  on a GPU), the attention is jax.nn.dot_product_attention's."""
  ids = jax.random.randint(jax.random.key(0), (2, 9), 0, VOCAB)
  model = Bf16LM()
  with fused_attention(False):
    assert step_jaxpr(model, "bf16", ids) == step_jaxpr(model, None, ids)
  with fused_attention():  # the GPU's default
    assert step_jaxpr(model, "bf16", ids) != step_jaxpr(model, None, ids)


@pytest.mark.standard_promotion  # Flax's bf16 LayerNorm promotes bf16 with float32
def test_uniform_bf16_on_the_example_lm_differs_only_by_the_lookup_rounding():
  """``TransformerLM(dtype=bf16)`` keeps its embedding tables (and the residual stream) in
  float32: a bf16 policy rounds the looked-up rows to bf16 (and the table gradients), which
  the plain model does not; every other op is the plain program (with Flax's own attention:
  by default the policy's bf16 attention is fused, ``qsync_jax.ops.qattention``)."""
  ids = jax.random.randint(jax.random.key(0), (2, 9), 0, VOCAB)
  model = TransformerLM(
    vocab_size=VOCAB, d_model=32, num_heads=2, num_layers=1, max_len=8, dtype=jnp.bfloat16
  )
  plain = step_jaxpr(model, None, ids)
  no_lookup_rounding = PrecisionPolicy(
    rules=(Rule(".*", OpPolicy.preset("fp32"), kind="embed"),), default=OpPolicy.preset("bf16")
  )
  with fused_attention(False):
    assert step_jaxpr(model, no_lookup_rounding, ids) == plain
    assert step_jaxpr(model, "bf16", ids) != plain


class Bf16CNN(nn.Module):
  """Convolutions (strided, grouped) and a head, every module in bf16."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3), dtype=jnp.bfloat16)(x))
    x = nn.Conv(8, (3, 3), strides=2, dtype=jnp.bfloat16)(x)
    x = nn.Conv(8, (1, 1), feature_group_count=2, dtype=jnp.bfloat16)(x)
    return nn.Dense(10, dtype=jnp.bfloat16)(x.mean(axis=(1, 2))).astype(jnp.float32)


def test_uniform_bf16_on_a_bf16_cnn_is_the_plain_program():
  """A uniform bf16 policy costs a bf16 CNN nothing: its training step is Flax's own."""
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  model = Bf16CNN()
  variables = model.init(jax.random.key(1), x)

  def jaxpr(apply):
    return str(jax.make_jaxpr(jax.grad(lambda p: apply({"params": p}, x).sum()))(variables["params"]))

  assert jaxpr(quantize(model, "bf16").apply) == jaxpr(model.apply)
  assert jaxpr(quantize(model, "fp16").apply) != jaxpr(model.apply)  # the check can fail
