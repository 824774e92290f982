"""Policies applied to unmodified flax.nnx models: names, bit-identity, structure, gradients,
RNG streams, and the refusals (a policy that quantizes nothing, a bridge-wrapped nnx module)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from qsync_jax import OpPolicy, PolicyError, PrecisionPolicy, QsyncError, QsyncWarning, Rule, quantize
from qsync_jax.models.nnx_model import NnxModel
from qsync_jax.models.nnx_quant import QuantizedNnxModel
from qsync_jax.train.task import Task
from tests.jaxpr_dtypes import gemm_dtypes
from tests.qsync_jax.models.linen_models import cnn_data
from tests.qsync_jax.models.nnx_models import CNN, CNN_OPS, LM, LM_OPS, lm_ids


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def lm_setup():
  module = LM(nnx.Rngs(params=0, dropout=1))
  return module, NnxModel.of(module), lm_ids()


def lm_loss(qmodel, params, ids, key, train=False):
  keys = jax.random.split(key)
  logits = qmodel.apply(
    {"params": params}, ids[:, :-1], train=train, rngs={"qsync": keys[0], "dropout": keys[1]}
  )
  return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def test_ops_are_named_by_their_nnx_graph_paths():
  module, model, ids = lm_setup()
  qmodel = quantize(module, "int8")
  assert isinstance(qmodel, QuantizedNnxModel)
  ops = qmodel.ops(model.init(None), ids)
  assert set(ops) == LM_OPS
  assert all(p == OpPolicy.preset("int8") for p in ops.values())
  cnn = CNN(nnx.Rngs(0))
  assert set(quantize(cnn, "int8").ops(NnxModel.of(cnn).init(None), jnp.zeros((2, 8, 8, 1)))) == CNN_OPS


def test_same_policy_json_as_linen_first_match_wins():
  module, model, ids = lm_setup()
  policy = PrecisionPolicy.from_json(
    {
      "rules": [
        {"path": "blocks/0/attn", "kind": "attention_qk", "policy": "bf16"},
        {"path": "blocks/.*/(up|down)", "policy": "int8_fwd"},
        {"path": "blocks/0/.*", "policy": "fp16"},
        {"path": "no_such_module", "policy": "int8"},
      ],
      "__default__": None,
    }
  )
  with pytest.warns(QsyncWarning, match=r"\['no_such_module'\] match none"):
    qmodel = quantize(module, policy)
  ops = qmodel.ops(model.init(None), ids)
  assert ops["blocks/0/attn:attention_qk"] == OpPolicy.preset("bf16")
  assert ops["blocks/0/attn:attention_pv"] == OpPolicy.preset("fp16")
  assert ops["blocks/0/up:dense"] == ops["blocks/1/down:dense"] == OpPolicy.preset("int8_fwd")
  assert ops["blocks/0/attn/query:dense_general"] == OpPolicy.preset("fp16")
  assert ops["blocks/1/attn/query:dense_general"] is None and ops["embed:embed"] is None
  assert [r.path for r in qmodel.unused_rules(model.init(None), ids)] == ["no_such_module"]


@pytest.mark.parametrize("train", [False, True])
def test_fp32_policy_and_unmatched_ops_are_bit_identical_to_the_float_model(train):
  module, model, ids = lm_setup()
  params = model.init(None)["params"]
  key = jax.random.key(3)

  def plain_loss(p):  # the nnx model itself, its dropout streams reseeded as the adapter does
    copy = model.module({"params": p})
    nnx.reseed(copy, dropout=jax.random.split(key)[1])
    logits = copy(ids[:, :-1], train=train)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

  want, want_grads = jax.value_and_grad(plain_loss)(params)
  if not train:
    np.testing.assert_array_equal(module(ids[:, :-1]), model.apply({"params": params}, ids[:, :-1]))
  # A policy that matches no op leaves every module's own function: value and gradient bit-identical.
  with pytest.warns(QsyncWarning, match=r"\['no_such_module'\] match none"):
    nothing = quantize(module, PrecisionPolicy(rules=(Rule("no_such_module", OpPolicy.preset("fp32")),)))
  got, grads = jax.value_and_grad(lambda p: lm_loss(nothing, p, ids, key, train))(params)
  np.testing.assert_array_equal(got, want)
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)
  # An all-fp32 policy runs every op as a qsync op at fp32: the same forward bits; its gradient
  # products (the op's custom VJP) sum in another order than JAX's transposes, so gradients agree
  # to fp32 rounding (measured: at most 6e-8 absolute here) rather than bit for bit.
  fp32 = quantize(module, "fp32")
  got, grads = jax.value_and_grad(lambda p: lm_loss(fp32, p, ids, key, train))(params)
  np.testing.assert_array_equal(got, want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, want_grads)


@pytest.mark.parametrize("preset", ["int8", "int8_fwd"])
def test_int8_jaxpr_has_int8_gemms_for_exactly_the_matched_ops(preset):
  module, model, ids = lm_setup()
  params = model.init(None)["params"]
  policy = PrecisionPolicy(rules=(Rule("blocks/0/.*", OpPolicy.preset(preset)),))
  qmodel = quantize(module, policy)
  matched = {n for n, p in qmodel.ops({"params": params}, ids[:, :-1]).items() if p is not None}
  assert matched == {n for n in LM_OPS if n.startswith("blocks/0/")}  # 4 projections, 2 products, 2 MLP
  grad_fn = jax.grad(lambda p: lm_loss(qmodel, p, ids, jax.random.key(0), train=True))
  counts = gemm_dtypes(jax.make_jaxpr(grad_fn)(params))
  low = {k: v for k, v in counts.items() if k[1:] != ("float32", "float32")}
  n = len(matched)
  expected = (
    {("dot_general", "int8", "int8"): 3 * n}
    if preset == "int8"
    else {("dot_general", "int8", "int8"): n, ("dot_general", "float16", "float16"): 2 * n}
  )
  assert low == expected
  # The other 11 ops run their float products, 3 GEMMs each, except the float embedding lookup
  # (a gather, differentiated as a scatter): 10 × 3.
  assert counts[("dot_general", "float32", "float32")] == 3 * (len(LM_OPS) - n - 1)


def test_conv_and_batchnorm_model_under_int8_gradients_flow_and_stats_update():
  module = CNN(nnx.Rngs(0))
  model = NnxModel.of(module)
  variables = model.init(None)
  x, y = cnn_data(jax.random.key(0), 8)
  qmodel = quantize(module, "int8")

  def loss(params):
    logits, updates = qmodel.apply(
      {**variables, "params": params}, x, mutable=["batch_stats"], rngs={"qsync": jax.random.key(1)}
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

  (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
  assert np.isfinite(value)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(g)) and np.abs(g).sum() > 0, jax.tree_util.keystr(path)
  assert set(updates) == {"batch_stats"}
  assert np.abs(updates["batch_stats"]["norm"]["mean"]).sum() > 0  # starts at zero
  counts = gemm_dtypes(jax.make_jaxpr(jax.grad(lambda p: loss(p)[0]))(variables["params"]))
  assert counts[("dot_general", "int8", "int8")] == 3 * len(CNN_OPS)  # convs as im2col GEMMs


@pytest.mark.standard_promotion  # optax.adam is not strict-promotion clean
def test_lm_trains_under_all_int8():
  module, model, _ = lm_setup()
  qmodel = quantize(module, "int8")
  params = model.init(None)["params"]
  opt = optax.adam(3e-3)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, ids, key):
    loss, grads = jax.value_and_grad(lambda p: lm_loss(qmodel, p, ids, key, train=True))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(40):
    ids = (jnp.arange(13)[None, :] + jax.random.randint(jax.random.key(i), (16, 1), 0, 16)) % 16
    params, opt_state, loss = step(params, opt_state, ids, jax.random.key(100 + i))
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  # Counting up mod 16 is learnable: 40 steps take the loss from ~2.8 (chance) to ~0.5 on this seed.
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


def test_dropout_and_stochastic_rounding_follow_the_given_keys():
  module, model, ids = lm_setup()
  params = model.init(None)["params"]
  qmodel = quantize(module, "int8")

  def out(key):
    return qmodel.apply({"params": params}, ids, train=True, rngs={"qsync": key, "dropout": key})

  np.testing.assert_array_equal(out(jax.random.key(0)), out(jax.random.key(0)))
  assert not np.array_equal(out(jax.random.key(0)), out(jax.random.key(1)))
  # int8 rounds only its gradients stochastically: the forward alone (evaluation) needs no key,
  # its gradient does, and is refused with the fix.
  qmodel.apply({"params": params}, ids, rngs={"dropout": jax.random.key(0)})
  with pytest.raises(QsyncError, match=r"rngs=\{'qsync': key\}"):
    jax.grad(lambda p: qmodel.apply({"params": p}, ids, rngs={"dropout": jax.random.key(0)}).sum())(params)
  # A draw from a stream no key seeds would repeat every step: refused, with the fix.
  with pytest.raises(QsyncError, match=r"RNG stream 'dropout' .* Fix: list 'dropout' in Task.rng_streams"):
    model.apply({"params": params}, ids, train=True)


def test_variables_restored_with_string_keys_apply_and_bad_variables_are_named():
  module, model, ids = lm_setup()
  variables = model.init(None)
  as_stored = jax.tree.map(
    np.asarray,
    {
      "params": {
        **variables["params"],
        "blocks": {"0": variables["params"]["blocks"][0], "1": variables["params"]["blocks"][1]},
      }
    },
  )
  np.testing.assert_array_equal(model.apply(as_stored, ids), module(ids))
  del as_stored["params"]["mix"]
  with pytest.raises(QsyncError, match=r"variables\['params'\] has no entry 'mix/kernel'"):
    model.apply(as_stored, ids)
  cnn = NnxModel.of(CNN(nnx.Rngs(0)))
  with pytest.raises(QsyncError, match=r"no entry 'norm/mean'.*\['params', 'batch_stats'\]"):
    cnn.apply({"params": cnn.init(None)["params"]}, jnp.zeros((2, 8, 8, 1)))


def test_a_policy_that_quantizes_nothing_is_refused_before_tracing():
  module, _, _ = lm_setup()
  with pytest.raises(
    PolicyError, match=r"matches none of the model's ops.*'blocks/0/attn/query:dense_general'"
  ):
    quantize(module, {"rules": [{"path": "Dense_0", "policy": "int8"}]})

  class NoOps(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
      return self.norm(x)

  with pytest.raises(PolicyError, match="calls no quantizable op"):
    quantize(NoOps(nnx.Rngs(0)), "int8")
  quantize(NoOps(nnx.Rngs(0)), "fp32")  # asks for no quantization: nothing to refuse


class _NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def test_bridge_wrapped_nnx_module_is_refused_with_the_fix():
  class Wrapper(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nnx.bridge.to_linen(_NnxMLP)(x)

  x = jnp.ones((2, 3))
  variables = Wrapper().init(jax.random.key(0), x)
  qmodel = quantize(Wrapper(), "int8")
  assert qmodel.ops(variables, x) == {}  # the linen interceptor sees no op inside the bridge
  with pytest.raises(PolicyError, match=r"nnx.bridge.to_linen.*Fix: quantize the nnx module directly"):
    qmodel.apply(variables, x)
  with pytest.raises(PolicyError, match=r"nnx.bridge.to_linen"):
    qmodel.init(jax.random.key(0), x)
  # The fix: the nnx module itself.
  assert set(
    quantize(_NnxMLP(nnx.Rngs(0)), "int8").ops(
      {"params": NnxModel.of(_NnxMLP(nnx.Rngs(0))).init(None)["params"]}, x
    )
  ) == {"hidden:dense", "out:dense"}


def test_grouped_query_attention_and_embed_subclasses():
  class Attend(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.MultiHeadAttention(4, 16, num_kv_heads=2, decode=False, rngs=rngs)

    def __call__(self, x):
      return self.attn(x)

  module = Attend(nnx.Rngs(0))
  variables = NnxModel.of(module).init(None)
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  fp32 = quantize(module, "fp32")
  assert set(fp32.ops(variables, x)) >= {"attn:attention_qk", "attn:attention_pv"}
  # Key and value heads repeated per group: the grouped products, to fp32 rounding.
  np.testing.assert_allclose(fp32.apply(variables, x), module(x), rtol=1e-5, atol=1e-6)
  int8 = quantize(module, "int8_fwd").apply(variables, x)
  assert int8.shape == (2, 5, 16) and np.abs(np.asarray(int8) - np.asarray(module(x))).max() < 0.1

  class ScaledEmbed(nnx.Embed):  # its own lookup: qsync leaves it alone, and says so
    def __call__(self, ids):
      return 2.0 * super().__call__(ids)

  class Both(nnx.Module):
    def __init__(self, rngs):
      self.plain = nnx.Embed(8, 4, rngs=rngs)
      self.scaled = ScaledEmbed(8, 4, rngs=rngs)

    def __call__(self, ids):
      return self.plain(ids) + self.scaled(ids)

  both = Both(nnx.Rngs(0))
  ids = jnp.arange(6) % 8
  qmodel = quantize(both, "int8_fwd")
  variables = NnxModel.of(both).init(None)
  assert set(qmodel.ops(variables, ids)) == {"plain:embed"}
  np.testing.assert_allclose(qmodel.apply(variables, ids), both(ids), atol=0.05)


@pytest.mark.standard_promotion  # jax.nn.dot_product_attention's gradient promotes bf16 with float32
def test_bf16_attention_is_fused_inside_the_block_as_for_linen():
  from qsync_jax.ops.qattention import fused_attention
  from tests.qsync_jax.ops.test_fused_attention import float32_logits

  class Attend(nnx.Module):
    def __init__(self, rngs, dropout=0.0):
      self.attn = nnx.MultiHeadAttention(
        2, 16, dtype=jnp.bfloat16, dropout_rate=dropout, decode=False, rngs=rngs
      )

    def __call__(self, x):
      return self.attn(x, mask=nnx.make_causal_mask(x[..., 0]), deterministic=True)

  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  for dropout, fused, want in ((0.0, True, 1), (0.0, False, 0), (0.1, True, 0)):
    module = Attend(nnx.Rngs(0), dropout)
    qmodel, variables = quantize(module, "bf16"), NnxModel.of(module).init(None)
    with fused_attention(fused):
      text = str(jax.make_jaxpr(lambda v, q=qmodel: q.apply(v, x))(variables))
      y = qmodel.apply(variables, x)
    assert float32_logits(text) == want, (dropout, fused)
    assert y.dtype == jnp.bfloat16 and rel_err(y, module(x)) < 0.03


def test_a_quantized_nnx_model_is_an_nnx_module_over_the_models_own_variables():
  from tests.qsync_jax.train.tiny import NnxNet

  net = NnxNet(nnx.Rngs(params=0, dropout=1))
  qnet = quantize(net, "int8_fwd")  # rounds to nearest: no rngs needed
  assert isinstance(qnet, nnx.Module) and qnet.module is net
  x = jax.random.normal(jax.random.key(0), (8, 6))
  call = nnx.jit(lambda m, x, train: m(x, train=train), static_argnums=2)
  mean, count = net.norm.mean[...], net.dropout.rngs.count[...]
  assert call(qnet, x, True).shape == (8, 3)
  assert not np.array_equal(net.norm.mean[...], mean)  # batch statistics written back into net
  assert net.dropout.rngs.count[...] == count + 1  # and its dropout stream's count
  # its call is the functional view's apply on net's variables
  variables = qnet.init(None)
  assert set(variables) == {"params", "batch_stats"}
  want = jax.jit(lambda v: qnet.apply(v, x, train=False))(variables)
  np.testing.assert_allclose(call(qnet, x, False), want, rtol=1e-6)  # two programs: XLA may fuse apart
  with pytest.raises(QsyncError, match=r"already quantized.*Fix: quantize its float module"):
    quantize(qnet, "int8")
  with pytest.raises(QsyncError, match=r"a Task takes the float model.*Fix: pass qmodel.module"):
    Task("quantized", qnet, lambda b: (b,), lambda out, b: (out.sum(), {}), lambda n, seed: iter(()))
  with pytest.raises(QsyncError, match=r"rngs is for flax.nnx modules.*Fix"):
    quantize(nn.Dense(3), "int8", rngs=nnx.Rngs(0))
  with pytest.raises(QsyncError, match=r"not an nnx.Rngs with a 'qsync' or default stream.*Fix"):
    quantize(net, "int8", rngs=nnx.Rngs(params=0))
