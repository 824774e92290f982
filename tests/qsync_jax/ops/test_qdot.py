"""Numerics of the quantized dot_general and conv: every leg × precision.

Each leg is checked twice: tightly against a fake-quant reference written here from the
quantize definition (quantize → dequantize → float64-accurate product), and loosely against
the float32 op.
"""

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.quantize import api as quantize_api
from pallas_kernels.quantize.reference import dequantize_reference, quantize_reference
from qsync_jax import (
  OpPolicy,
  QsyncError,
  quantized_conv_general_dilated,
  quantized_dot_general,
  residual_bytes,
)
from qsync_jax.ops import qconv, qdot
from tests.tolerances import LOOSE, TIGHT, rel_err, rel_tol

PRECISIONS = ["fp32", "tf32", "bf16", "fp16", "int8", "fp8"]
CAST = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
QUANTIZED = {"int8": "int8", "fp8": "e4m3"}  # storage format of forward values


def fake(x, precision, axes, is_grad=False):
  """What a leg at ``precision`` does to one operand, in float32 (the test oracle)."""
  if precision in CAST:
    return x.astype(CAST[precision]).astype(jnp.float32)
  if precision == "int8":
    return dequantize_reference(*quantize_reference(x, "int8", axes))
  if precision == "fp8":
    return dequantize_reference(*quantize_reference(x, "e5m2" if is_grad else "e4m3", axes))
  return x


def hi(a, b):
  return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def dense_reference(x, w, g, policy):
  """Y, dX, dW of Y = X·W (X: M×K, W: K×N) for ``policy`` (nearest rounding everywhere).

  Residuals are stored at the forward precision. A gradient leg at the forward's own 8-bit
  format reuses the saved values and folds their scale into dY before quantizing it
  (dX = Q(dY ⊙ s_w)·q_wᵀ, dW = q_xᵀ·Q(s_x ⊙ dY)); any other leg rounds its two operands
  along its own contraction."""
  per = (lambda axes: (0, 1)) if policy.granularity == "per_tensor" else (lambda axes: axes)
  y = hi(fake(x, policy.fwd, per((1,))), fake(w, policy.fwd, per((0,))))
  xr, wr = fake(x, policy.fwd, per((1,))), fake(w, policy.fwd, per((0,)))
  if policy.fwd in QUANTIZED and policy.dlhs == policy.fwd:
    qw, sw = quantize_reference(w, QUANTIZED[policy.fwd], per((0,)))
    dx = hi(fake(g * sw, policy.dlhs, per((1,)), True), qw.astype(jnp.float32).T)
  else:
    dx = hi(fake(g, policy.dlhs, per((1,)), True), fake(wr, policy.dlhs, per((1,))).T)
  if policy.fwd in QUANTIZED and policy.drhs == policy.fwd:
    qx, sx = quantize_reference(x, QUANTIZED[policy.fwd], per((1,)))
    dw = hi(qx.astype(jnp.float32).T, fake(sx * g, policy.drhs, per((0,)), True))
  else:
    dw = hi(fake(xr, policy.drhs, per((0,))).T, fake(g, policy.drhs, per((0,)), True))
  return y, dx, dw


def dense_run(x, w, g, policy):
  dims = (((1,), (0,)), ((), ()))
  y, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, dims, policy), x, w)
  return (y, *vjp(g))


def draw(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


LEG_CASES = [(leg, p) for leg in ("fwd", "dlhs", "drhs") for p in PRECISIONS]


@pytest.mark.parametrize("leg,precision", LEG_CASES)
def test_each_leg_against_fake_quant_and_float(leg, precision):
  m, k, n = 24, 48, 40
  seed = zlib.crc32(repr((leg, precision)).encode()) % 1000
  x, w, g = draw((m, k), seed), draw((k, n), seed + 1), draw((m, n), seed + 2)
  policy = OpPolicy(**{"fwd": "fp32", "dlhs": "fp32", "drhs": "fp32", leg: precision})
  got = dense_run(x, w, g, policy)
  ref = dense_reference(x, w, g, policy)
  exact = (hi(x, w), hi(g, w.T), hi(x.T, g))
  i = ("fwd", "dlhs", "drhs").index(leg)
  # tf32 is float32 on the CPU, so its fake-quant reference is float32 itself.
  assert rel_err(got[i], ref[i]) < rel_tol(TIGHT, precision, k), (leg, precision)
  assert rel_err(got[i], exact[i]) < rel_tol(LOOSE, precision), (leg, precision)
  for j in {0, 1, 2} - {i}:  # the other legs: float32 products of the stored residuals
    assert rel_err(got[j], ref[j]) < TIGHT["fp32"], (leg, precision, j)


BACKWARD_CASES = {
  # an 8-bit forward's saved operands read by every kind of gradient leg
  "int8": OpPolicy.uniform("int8"),
  "fp8": OpPolicy.uniform("fp8"),
  "int8_fwd": OpPolicy.preset("int8_fwd"),  # QSync's op: fp16 legs dequantize the int8 residuals
  "int8_bf16": OpPolicy(fwd="int8", dlhs="bf16", drhs="bf16"),
  "int8_fwd_fp8_dlhs": OpPolicy(fwd="int8", dlhs="fp8", drhs="int8"),  # fp8 leg: int8 re-rounded
  "fp8_fwd_int8_drhs": OpPolicy(fwd="fp8", dlhs="fp32", drhs="int8"),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_backward_of_an_8bit_forward_against_fake_quant(case, granularity):
  m, k, n = 24, 48, 40
  x, w, g = draw((m, k), 21), draw((k, n), 22), draw((m, n), 23)
  x = x * jnp.exp(draw((m, 1), 24))  # rows of different ranges: per-row scales differ
  policy = BACKWARD_CASES[case].replace(granularity=granularity)
  got, ref = dense_run(x, w, g, policy), dense_reference(x, w, g, policy)
  for i, leg in enumerate(("fwd", "dlhs", "drhs")):
    precision = getattr(policy, leg)
    assert rel_err(got[i], ref[i]) < rel_tol(TIGHT, precision, k), (leg, precision)


def test_folded_gradient_legs_round_the_saved_operand_once():
  """Guards the reference above: the scheme that re-quantizes the saved operand along the
  gradient leg's contraction (a second rounding) is measurably different from it."""
  x, w, g = draw((24, 48), 21), draw((48, 40), 22), draw((24, 40), 23)
  policy = OpPolicy.uniform("int8")
  _, dx, dw = dense_reference(x, w, g, policy)
  xr, wr = fake(x, "int8", (1,)), fake(w, "int8", (0,))
  dx_twice = hi(fake(g, "int8", (1,), True), fake(wr, "int8", (1,)).T)
  dw_twice = hi(fake(xr, "int8", (0,)).T, fake(g, "int8", (0,), True))
  assert rel_err(dx_twice, dx) > 100 * TIGHT["int8"] and rel_err(dw_twice, dw) > 100 * TIGHT["int8"]


@pytest.mark.parametrize("precision", ["int8", "fp8", "bf16", "fp16"])
def test_float_leg_is_really_lossy(precision):
  """Guards the checks above: the loose bound is not trivially met by a float32 path."""
  x, w = draw((32, 64), 1), draw((64, 32), 2)
  policy = OpPolicy.uniform(precision)
  y = quantized_dot_general(x, w, (((1,), (0,)), ((), ())), policy)
  assert rel_err(y, hi(x, w)) > 1e-5


DIMS_CASES = {
  # name: (lhs shape, rhs shape, dimension numbers)
  "dense_3d": ((2, 5, 12), (12, 7), (((2,), (0,)), ((), ()))),
  "dense_general_2contract": ((3, 4, 6), (4, 6, 5), (((1, 2), (0, 1)), ((), ()))),
  "attention_qk_batched": ((2, 3, 5, 8), (2, 3, 7, 8), (((3,), (3,)), ((0, 1), (0, 1)))),
  "contract_first_axes": ((9, 4), (9, 6), (((0,), (0,)), ((), ()))),
  "swapped_contract_order": ((3, 4, 5), (5, 4, 2), (((1, 2), (1, 0)), ((), ()))),
}


@pytest.mark.parametrize("case", sorted(DIMS_CASES))
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_general_dimension_numbers_match_lax(case, granularity):
  """fp32 legs through the custom_vjp equal lax.dot_general and its autodiff exactly."""
  ls, rs, dims = DIMS_CASES[case]
  a, b = draw(ls, 3), draw(rs, 4)
  policy = OpPolicy.uniform("fp32", granularity=granularity)

  def ours(a, b):
    return jnp.sum(jnp.sin(quantized_dot_general(a, b, dims, policy)))

  def theirs(a, b):
    return jnp.sum(jnp.sin(lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST)))

  np.testing.assert_allclose(ours(a, b), theirs(a, b), rtol=1e-6)
  for got, want in zip(jax.grad(ours, (0, 1))(a, b), jax.grad(theirs, (0, 1))(a, b)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(DIMS_CASES))
@pytest.mark.parametrize("precision", ["int8", "fp8", "bf16"])
def test_general_dimension_numbers_quantized_close_to_float(case, precision):
  ls, rs, dims = DIMS_CASES[case]
  a, b = draw(ls, 5), draw(rs, 6)
  g = draw(lax.dot_general(a, b, dims).shape, 7)
  policy = OpPolicy.uniform(precision)
  y, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, dims, policy), a, b)
  y_ref, vjp_ref = jax.vjp(lambda a, b: lax.dot_general(a, b, dims, precision="highest"), a, b)
  # Tiny contractions (K=4..12) have few terms to average rounding errors: 3× headroom.
  assert rel_err(y, y_ref) < 3 * LOOSE[precision]
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.shape == want.shape
    assert rel_err(got, want) < 3 * LOOSE[precision]


def folded_reference(a, b, g, dims, precision, granularity):
  """(dA, dB) of ``lax.dot_general(a, b, dims)``, forward and both legs at the 8-bit
  ``precision`` (nearest rounding): each leg multiplies the saved values of one operand
  (rounded along the forward contraction) by dY with that operand's scale folded in,
  rounded along the leg's contraction (dY's free axes that come from the saved operand)."""
  fmt = QUANTIZED[precision]
  (lc, rc), (lb, rb) = dims
  nb, n_lhs_free = len(lb), a.ndim - len(lc) - len(lb)

  def per(x, axes):
    return tuple(range(x.ndim)) if granularity == "per_tensor" else tuple(axes)

  qa, sa = quantize_reference(a, fmt, per(a, lc))
  qb, sb = quantize_reference(b, fmt, per(b, rc))

  def on_output(scale, lhs):  # an operand's scale, broadcast onto dY's layout
    if scale.size == 1:
      return scale.reshape(())
    if lhs:
      return lax.dot_general(scale, jnp.ones([1 if i in rc else d for i, d in enumerate(b.shape)]), dims)
    return lax.dot_general(jnp.ones([1 if i in lc else d for i, d in enumerate(a.shape)]), scale, dims)

  rhs_free, lhs_free = range(nb + n_lhs_free, g.ndim), range(nb, nb + n_lhs_free)
  ga = fake(g * on_output(sb, False), precision, per(g, rhs_free), True)
  gb = fake(g * on_output(sa, True), precision, per(g, lhs_free), True)
  qa, qb = qa.astype(jnp.float32), qb.astype(jnp.float32)
  (da,) = jax.vjp(lambda a: lax.dot_general(a, qb, dims, precision="highest"), a)[1](ga)
  (db,) = jax.vjp(lambda b: lax.dot_general(qa, b, dims, precision="highest"), b)[1](gb)
  return da, db


@pytest.mark.parametrize("case", sorted(DIMS_CASES))
@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_general_dimension_numbers_gradients_against_folded_reference(case, precision, granularity):
  """DenseGeneral, einsum and attention products (both operands activations, batch axes):
  the folded scales land on the right axes of dY."""
  ls, rs, dims = DIMS_CASES[case]
  a, b = draw(ls, 15) * jnp.exp(draw(ls[:1] + (1,) * (len(ls) - 1), 16)), draw(rs, 17)
  g = draw(lax.dot_general(a, b, dims).shape, 18)
  policy = OpPolicy.uniform(precision, granularity=granularity)
  _, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, dims, policy), a, b)
  for got, want in zip(vjp(g), folded_reference(a, b, g, dims, precision, granularity)):
    assert rel_err(got, want) < rel_tol(TIGHT, precision, 64), case


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_conv_gradients_against_folded_reference(precision):
  """The im2col convolution: its legs are the folded dot_general over the patch matrix."""
  x, w = draw((2, 8, 8, 4), 19), draw((3, 3, 4, 6), 20)
  dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
  policy = OpPolicy.uniform(precision)

  def conv(x, w):
    return quantized_conv_general_dilated(x, w, (1, 1), "SAME", None, None, dn, op_policy=policy)

  y, vjp = jax.vjp(conv, x, w)
  g = draw(y.shape, 25)
  dx, dw = vjp(g)
  patches, to_patches = jax.vjp(lambda x: qconv.library_patches(x, (3, 3), (1, 1), "SAME", (1, 1), (1, 1)), x)
  w_mat = jnp.transpose(w, (2, 0, 1, 3)).reshape(-1, w.shape[-1])  # (C, kh, kw) flattened C-major
  dp, dw_mat = folded_reference(patches, w_mat, g, (((3,), (0,)), ((), ())), precision, "per_channel")
  assert rel_err(dx, to_patches(dp)[0]) < rel_tol(TIGHT, precision, 36)
  assert rel_err(dw, jnp.transpose(dw_mat.reshape(4, 3, 3, 6), (1, 2, 0, 3))) < rel_tol(TIGHT, precision, 128)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_output_dtype_and_jit_equals_eager(precision):
  x, w = draw((8, 16), 8).astype(jnp.bfloat16), draw((16, 4), 9).astype(jnp.bfloat16)
  policy = OpPolicy.uniform(precision)
  dims = (((1,), (0,)), ((), ()))

  def f(x, w):
    return quantized_dot_general(x, w, dims, policy)

  y = f(x, w)
  assert y.dtype == jnp.bfloat16  # the plain op's result type
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w), np.float32), np.asarray(y, np.float32))
  dx, dw = jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(), (0, 1))(x, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


def conv_fake_reference(x, w, policy, strides, padding):
  """Per-tensor fake-quant reference of a 2-D NHWC conv (per-tensor scales of the im2col
  patches equal those of the input, since patches only repeat and zero-pad it)."""
  dn = ("NHWC", "HWIO", "NHWC")
  xf, wf = fake(x, policy.fwd, (0, 1, 2, 3)), fake(w, policy.fwd, (0, 1, 2, 3))
  y = lax.conv_general_dilated(xf, wf, strides, padding, dimension_numbers=dn, precision="highest")
  return fake(y, policy.fwd, ()) if policy.fwd in CAST else y  # native 16-bit convs round Y


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strides,padding", [((1, 1), "SAME"), ((2, 2), ((1, 0), (2, 1)))])
def test_conv_forward_against_fake_quant_and_float(precision, strides, padding):
  x, w = draw((2, 9, 9, 3), 10), draw((3, 3, 3, 5), 11)
  policy = OpPolicy.uniform(precision, granularity="per_tensor")
  dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
  y = quantized_conv_general_dilated(x, w, strides, padding, None, None, dn, op_policy=policy)
  assert rel_err(y, conv_fake_reference(x, w, policy, strides, padding)) < rel_tol(TIGHT, precision, 27)
  exact = lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=dn, precision="highest")
  assert rel_err(y, exact) < rel_tol(LOOSE, precision)


@pytest.mark.parametrize(
  "policy",
  [
    OpPolicy.preset("int8"),
    OpPolicy.preset("int8_fwd"),
    OpPolicy.preset("fp8"),
    OpPolicy(fwd="bf16", dlhs="fp32", drhs="fp16"),
  ],
)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_conv_gradients_close_to_float(policy, layout):
  x, w = draw((2, 8, 8, 4), 12), draw((3, 3, 4, 6), 13)
  if layout == "NCHW":
    x, w = jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(w, (3, 2, 0, 1))
    spec = ("NCHW", "OIHW", "NCHW")
  else:
    spec = ("NHWC", "HWIO", "NHWC")
  dn = lax.conv_dimension_numbers(x.shape, w.shape, spec)
  key = jax.random.key(0)

  def ours(x, w):
    return quantized_conv_general_dilated(x, w, (1, 1), "SAME", None, (1, 2), dn, op_policy=policy, key=key)

  def theirs(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", None, (1, 2), dn, precision="highest")

  y, vjp = jax.vjp(ours, x, w)
  y_ref, vjp_ref = jax.vjp(theirs, x, w)
  g = draw(y.shape, 14)
  worst = max(LOOSE[p] for p in policy.precisions)
  assert rel_err(y, y_ref) < LOOSE[policy.fwd]
  for got, want in zip(vjp(g), vjp_ref(g)):
    # Each gradient passes through two quantized operands (dY and a residual): 2× budget.
    assert rel_err(got, want) < 2 * worst


def test_stochastic_rounding_needs_a_key_in_the_legs_that_round_so():
  x, w = draw((4, 4), 0), draw((4, 4), 1)
  dims = (((1,), (0,)), ((), ()))
  int8 = OpPolicy.preset("int8")  # forward to nearest, gradients stochastic
  y = quantized_dot_general(x, w, dims, int8)  # the forward alone (evaluation) needs no key
  np.testing.assert_array_equal(y, quantized_dot_general(x, w, dims, int8, jax.random.key(0)))
  with pytest.raises(QsyncError, match="rounds its gradients stochastically.*forward alone.*Fix: pass key"):
    jax.grad(lambda x: quantized_dot_general(x, w, dims, int8).sum())(x)
  with pytest.raises(QsyncError, match="rounds its operands stochastically and needs a PRNG key.*Fix"):
    quantized_dot_general(x, w, dims, int8.replace(rounding="stochastic"))


def test_int8_forward_saves_int8_residuals():
  x, w = draw((64, 128), 0), draw((128, 96), 1)
  dims = (((1,), (0,)), ((), ()))

  def run(policy):
    return residual_bytes(lambda x, w: quantized_dot_general(x, w, dims, policy), x, w)

  fp32_bytes = run(OpPolicy.preset("fp32"))
  int8_bytes = run(OpPolicy.preset("int8_fwd"))
  bf16_bytes = run(OpPolicy.preset("bf16"))
  operand_bytes = (x.size + w.size) * 4
  assert fp32_bytes >= operand_bytes
  # int8 values (1 byte) plus one float32 scale per row of X and per column of W.
  assert int8_bytes <= operand_bytes / 4 + (64 + 96) * 4 + 64
  assert bf16_bytes <= operand_bytes / 2 + 64


def test_8bit_residuals_are_laid_out_for_the_gradient_leg_that_reads_them():
  """An 8-bit forward whose gradient legs run at its own precision keeps X [M, K] as [K, M] and
  W [K, N] as [K, N]: the layouts the weight and input gradients contract (their contraction
  last), written by the forward's quantization, so the backward transposes no 8-bit operand.
  With a 16-bit backward (``int8_fwd``) the residuals are the forward GEMM's own copies. The
  bytes kept are the same either way."""
  x, w = draw((64, 128), 0), draw((128, 96), 1)
  dims = (((1,), (0,)), ((), ()))

  def residuals(name):
    policy = OpPolicy.preset(name)
    _, vjp = jax.vjp(lambda x, w: quantized_dot_general(x, w, dims, policy, jax.random.key(0)), x, w)
    leaves = jax.tree_util.tree_leaves(vjp)
    return sorted(
      leaf.shape for leaf in leaves if getattr(leaf, "dtype", None) in (jnp.int8, jnp.float8_e4m3fn)
    )

  assert residuals("int8") == residuals("fp8") == [(128, 64), (128, 96)]
  assert residuals("int8_fwd") == [(64, 128), (96, 128)]


def test_every_leg_precision_combination_runs():
  x, w = draw((6, 8), 0), draw((8, 5), 1)
  key = jax.random.key(1)
  # Every (fwd, dlhs) pair, with drhs cycling through all precisions too (36 policies).
  for (i, fwd), (j, dlhs) in itertools.product(enumerate(PRECISIONS), repeat=2):
    drhs = PRECISIONS[(i + j) % len(PRECISIONS)]
    policy = OpPolicy(fwd=fwd, dlhs=dlhs, drhs=drhs, grad_rounding="stochastic")
    dx, dw = jax.grad(
      lambda x, w, policy=policy: quantized_dot_general(x, w, (((1,), (0,)), ((), ())), policy, key).sum(),
      (0, 1),
    )(x, w)
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
    assert rel_err(dw, hi(x.T, jnp.ones((6, 5)))) < 0.25


@pytest.mark.parametrize("preset", ["fp32", "tf32"])
def test_all_float32_policy_runs_as_plain_dot_general(preset):
  """Every leg at one float32 precision: ``lax.dot_general`` differentiated by JAX, no
  custom_vjp (which made XLA:CPU re-run producers for relayouts: +17 % on a BERT-like LM)."""
  rng = np.random.default_rng(0)
  x, w = (
    jnp.asarray(rng.normal(size=(4, 6, 8)), jnp.float32),
    jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
  )
  dims = (((2,), (0,)), ((), ()))
  policy = OpPolicy.preset(preset) if preset == "fp32" else OpPolicy.uniform("tf32")
  precision = lax.Precision.HIGHEST if preset == "fp32" else lax.Precision.DEFAULT

  def ours(x, w):
    return quantized_dot_general(x, w, dims, policy).sum()

  def plain(x, w):
    return lax.dot_general(x, w, dims, precision=precision).sum()

  assert "custom_vjp" not in str(jax.make_jaxpr(ours)(x, w))
  for a, b in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  mixed = OpPolicy(fwd="fp32", dlhs="fp32", drhs="bf16")  # one leg differs: the custom_vjp runs
  assert "custom_vjp" in str(jax.make_jaxpr(lambda x, w: quantized_dot_general(x, w, dims, mixed))(x, w))


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_gradient_quantized_once_for_both_legs_gives_the_per_leg_values(precision, monkeypatch):
  """dY quantized for both gradient legs in one ``quantize_pair`` (its kernels, in interpret
  mode) gives, bit for bit, the gradients of quantizing it in each leg with nearest rounding:
  the same scales and layouts reach the GEMMs. With stochastic rounding the kernels give the
  reference pair's gradients (one hash per element serves both legs, ``noise.pair_noise``)."""
  x, w, g = draw((2, 16, 32), 31) * jnp.exp(draw((2, 16, 1), 34)), draw((32, 64), 32), draw((2, 16, 64), 33)
  dims = (((2,), (0,)), ((), ()))

  def grads(rounding):
    policy = OpPolicy.uniform(precision).replace(grad_rounding=rounding)
    _, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, dims, policy, jax.random.key(7)), x, w)
    return vjp(g)

  with monkeypatch.context() as m:
    m.setattr(qdot, "_grad_pair", lambda *args: None)
    per_leg = grads("nearest")
  calls = []

  def pair_with(impl):
    def pair(*args, **kwargs):
      calls.append(args[1:3])
      return quantize_api.quantize_pair(*args, **kwargs, impl=impl, interpret=impl == "pallas")

    return pair

  monkeypatch.setattr(qdot, "quantize_pair", pair_with("pallas"))
  once, once_stochastic = grads("nearest"), grads("stochastic")
  assert calls == [("int8" if precision == "int8" else "e5m2", 2)] * 2
  for got, want in zip(once, per_leg):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  monkeypatch.setattr(qdot, "quantize_pair", pair_with("reference"))
  for got, want in zip(once_stochastic, grads("stochastic")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(once_stochastic[1]), np.asarray(once[1]))
