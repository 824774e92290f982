"""The device catalog's roofline and the legs ``planners.predictor.modeled`` builds from it."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from planners import catalog
from planners.catalog import gemm_roofline_ms, parallel_fraction
from planners.ops import OpShape, collect_ops
from planners.predictor import modeled
from planners.predictor.modeled import leg_ms, modeled_cast, modeled_profile, quantize_leg_ms
from planners.profile import Profile
from qsync_jax.devices import DEVICES, device

MEMORY = {"param_bytes": 800, "opt_state_bytes": 1600, "batch_bytes": 0, "other_bytes": 0}


def test_every_device_has_a_rate_for_each_precision_it_runs_and_its_sms():
  for name, spec in DEVICES.items():
    assert set(spec.peak_tflops) == set(spec.precisions)
    assert all(r > 0 for r in spec.peak_tflops.values()), name
    assert spec.sm_count > 0 and spec.mem_bw_gbps > 0 and spec.memory_gb > 0
  assert device("L40S").peak_tflops["fp8"] == 733.0 and device("H100").sm_count == 132


def test_output_tiles_run_in_waves_of_the_sm_count():
  h100 = device("H100")  # 132 SMs, 128×128 tiles at 16 bits
  assert parallel_fraction(h100, "bf16", 128 * 132, 64, 128) == 1.0
  assert parallel_fraction(h100, "bf16", 128 * 133, 64, 128) == pytest.approx(133 / 264)
  # 8-bit tiles are 128×256: the same product has half the tiles
  assert parallel_fraction(h100, "int8", 128 * 132, 64, 256) == 1.0
  assert parallel_fraction(h100, "bf16", 128 * 66, 64, 256) == 1.0
  # few tiles and a shallow contraction: mostly idle; a deep one is split over the idle SMs
  assert parallel_fraction(h100, "bf16", 128, 64, 128) == pytest.approx(1 / 132)
  assert parallel_fraction(h100, "bf16", 128, 64 * 2**10, 128) == 1.0
  assert parallel_fraction(h100, "bf16", 128, 4 * catalog.SPLIT_K_DEPTH, 128) == pytest.approx(4 / 132)


def test_gemm_efficiency_grows_with_the_products_time_toward_its_maximum():
  e_max, half = catalog.GEMM_EFFICIENCY_MAX, catalog.GEMM_HALF_US
  # a product that takes GEMM_HALF_US at the peak sustains half the maximum; a long one nearly all
  assert catalog.gemm_efficiency(half) == pytest.approx(e_max / 2)
  assert catalog.gemm_efficiency(1e3 * half) == pytest.approx(e_max * 1e3 / 1001)
  # so a product pays GEMM_HALF_US / GEMM_EFFICIENCY_MAX on top of its flops at the sustained rate,
  # once, not once per idle SM: a one-tile product on an H100 is not 132 × that overhead
  h100 = device("H100")
  launch = h100.launch_us * 1e-3
  t_us = 1e6 * 2 * 128 * 64 * 128 / (989e12 / 132)  # one 128 × 128 tile on one of 132 SMs
  want = 1e-3 * (t_us + half) / e_max
  assert gemm_roofline_ms(h100, "bf16", 128, 64, 128) - launch == pytest.approx(want)
  # the same product is longer on a slower (throttled) card: a larger share of its peak there
  t4 = device("T4")
  assert catalog.gemm_efficiency(1e6 * 1e9 / (65e12 * t4.derate)) > catalog.gemm_efficiency(
    1e6 * 1e9 / 989e12
  )


def test_a_large_product_is_compute_bound_at_the_sustained_rate_and_a_thin_one_memory_bound():
  h100 = device("H100")
  m = k = n = 128 * 132  # 132 tiles of 128 × 128 per row of tiles: full waves
  launch = h100.launch_us * 1e-3
  t_us = 1e6 * 2.0 * m * k * n / 989e12
  compute = 1e-3 * t_us / catalog.gemm_efficiency(t_us)
  assert gemm_roofline_ms(h100, "bf16", m, k, n) == pytest.approx(compute + launch)
  conv = gemm_roofline_ms(h100, "bf16", m, k, n, conv=True)
  assert conv - launch == pytest.approx(
    (gemm_roofline_ms(h100, "bf16", m, k, n) - launch) / catalog.CONV_EFFICIENCY
  )
  # a matrix-vector product moves its operands: bytes over the sustained bandwidth
  bw = 3350e9 * catalog.MEMORY_EFFICIENCY
  assert gemm_roofline_ms(h100, "bf16", 2**14, 2**14, 1) == pytest.approx(
    1e3 * (2 * (2**28 + 2**14) + 4 * 2**14) / bw + launch
  )
  # the bytes moved are the ones given (a convolution's input, not its patches)
  small = gemm_roofline_ms(h100, "bf16", 2**14, 2**14, 1, elems=(2**20, 2**14, 2**14))
  assert small < gemm_roofline_ms(h100, "bf16", 2**14, 2**14, 1)
  # a throttled card's compute is derated, its memory is not
  t4 = device("T4")
  assert t4.derate < 1 and catalog.memory_ms(t4, 1e9) == pytest.approx(
    1e3 / (320 * catalog.MEMORY_EFFICIENCY)
  )


def test_a_16_bit_leg_pays_half_of_its_operands_fused_conversions():
  h100 = device("H100")
  op = OpShape("mlp:dense", "dense", 1, 4096, 768, 3072, 1, 4096 * 768, 768 * 3072, 4096 * 3072)
  for leg, (a, b) in {"fwd": (op.lhs_elems, op.rhs_elems), "drhs": (op.lhs_elems, op.out_elems)}.items():
    m, k, n = {"fwd": (op.m, op.k, op.n), "drhs": (op.k, op.m, op.n)}[leg]
    out = op.rhs_elems if leg == "drhs" else op.out_elems
    gemm = gemm_roofline_ms(h100, "bf16", m, k, n, 1, (a, b, out))
    assert leg_ms(h100, op, leg, "bf16") == pytest.approx(gemm + catalog.memory_ms(h100, 2 * (a + b)) / 2)
    assert leg_ms(h100, op, leg, "fp32") == gemm_roofline_ms(h100, "fp32", m, k, n, 1, (a, b, out))
  bf16 = modeled_cast(h100, "fp32->bf16")
  assert bf16.b == 0.0 and bf16.a == pytest.approx(catalog.memory_ms(h100, 2))  # the copy's write


def test_a_leg_converts_its_operands_only_from_a_dtype_other_than_its_own():
  h100 = device("H100")
  op = OpShape("mlp:dense", "dense", 1, 4096, 768, 3072, 1, 4096 * 768, 768 * 3072, 4096 * 3072)
  bf16_model = dataclasses.replace(op, activation_dtype="bfloat16")
  write = {p: catalog.memory_ms(h100, catalog.BYTES[p]) for p in ("bf16", "fp32")}  # a copy's write
  for leg, (a, b) in {"fwd": (op.lhs_elems, op.rhs_elems), "drhs": (op.lhs_elems, op.out_elems)}.items():
    # both operands reach the op at the model's dtype (a Flax module converts its weight first):
    # a bf16 leg converts a float32 model's, a bf16 model's none; an fp32 leg the other way round
    saved = (a + b) * write["bf16"] / 2
    assert leg_ms(h100, op, leg, "bf16") - leg_ms(h100, bf16_model, leg, "bf16") == pytest.approx(saved)
    assert leg_ms(h100, bf16_model, leg, "fp32") - leg_ms(h100, op, leg, "fp32") == pytest.approx(
      (a + b) * write["fp32"] / 2
    )


def test_an_8_bit_leg_of_a_bf16_model_reads_its_operands_at_two_bytes():
  h100 = device("H100")
  t, k, n = 4096, 768, 3072
  op = OpShape("mlp:dense", "dense", 1, t, k, n, 1, t * k, k * n, t * n, activation_dtype="bfloat16")
  launch = h100.launch_us * 1e-3
  per_byte = 1e3 / (3350e9 * catalog.QUANTIZE_EFFICIENCY)
  # X (bf16) read once, int8 written; W (bf16: the module converted it) read twice, int8 written
  assert quantize_leg_ms(h100, op, "fwd") == pytest.approx((3 * t * k + 5 * k * n) * per_byte + 3 * launch)
  # dY (bf16) read twice, two int8 copies written, half each; the weight gradient pays X's absmax
  # and its second int8 copy (the forward's kernel writes it in this leg's layout), the input
  # gradient W's second copy
  pair = ((4 + 2) * t * n * per_byte + 2 * launch) / 2
  assert quantize_leg_ms(h100, op, "drhs") == pytest.approx(pair + 3 * t * k * per_byte + launch)
  assert quantize_leg_ms(h100, op, "dlhs") == pytest.approx(pair + k * n * per_byte)


def test_an_op_records_the_dtype_its_model_computes_in():
  x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
  for dtype, name in ((jnp.float32, "float32"), (jnp.bfloat16, "bfloat16")):
    model = nn.Dense(4, dtype=dtype)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    (op,) = collect_ops(model, variables, x)
    assert op.activation_dtype == name
    assert OpShape.from_json(op.to_json()) == op
  old = {
    k: v for k, v in op.to_json().items() if k != "activation_dtype"
  }  # a profile written before the field
  assert OpShape.from_json(old).activation_precision == "fp32"
  with pytest.raises(ValueError, match=r"activation_dtype 'int8' is not one of .*Fix: trace a model"):
    dataclasses.replace(op, activation_dtype="int8")


def test_an_8_bit_leg_pays_the_quantize_kernels_the_trainer_runs_at_their_measured_rate():
  h100, a10 = device("H100"), device("A10")
  t, k, n = 4096, 768, 3072
  op = OpShape("mlp:dense", "dense", 1, t, k, n, 1, t * k, k * n, t * n)
  launch = h100.launch_us * 1e-3
  per_byte = 1e3 / (3350e9 * catalog.QUANTIZE_EFFICIENCY)
  # forward: X (fp32) per row, read once, int8 written; W (fp32) per column, read twice (absmax, then
  # the kernel), int8 written; three kernels
  fwd = (5 * t * k + 9 * k * n) * per_byte + 3 * launch
  assert quantize_leg_ms(h100, op, "fwd") == pytest.approx(fwd)
  # backward: dY (fp32) quantized once for both legs, two passes, two int8 copies: half each; plus
  # the forward operand's second copy each leg reads (X: with its absmax, 4 + 1 bytes; W: 1 byte)
  pair = ((8 + 2) * t * n * per_byte + 2 * launch) / 2
  assert quantize_leg_ms(h100, op, "drhs") == pytest.approx(pair + 5 * t * k * per_byte + launch)
  assert quantize_leg_ms(h100, op, "dlhs") == pytest.approx(pair + k * n * per_byte)
  gemm = gemm_roofline_ms(h100, "int8", t, k, n, 1, (t * k, k * n, t * n))
  assert leg_ms(h100, op, "fwd", "int8") == pytest.approx(gemm + fwd)
  # the same bytes cost in proportion to the bandwidth on another device (600 GB/s on an A10)
  assert quantize_leg_ms(a10, op, "fwd") - 3 * launch == pytest.approx((fwd - 3 * launch) * 3350 / 600)
  int8, dequantize = modeled_cast(h100, "fp32->int8"), modeled_cast(h100, "int8->fp32")
  assert int8.b == launch and int8.a == pytest.approx(5 * per_byte)  # the per-row kernel
  assert dequantize.b == launch and dequantize.a == pytest.approx(catalog.memory_ms(h100, 1 + 4))


def test_the_remainder_is_bytes_per_op_output_element_by_kind_without_attention_scores():
  h100 = device("H100")
  conv = OpShape("c:conv", "conv", 1, 100, 9, 8, 2, 800, 72, 800)
  dense = OpShape("d:dense", "dense", 1, 100, 8, 16, 1, 800, 128, 1600)
  scores = OpShape("a:attention_qk", "attention_qk", 4, 100, 4, 100, 1, 1600, 1600, 40000)
  want = catalog.memory_ms(h100, modeled.REST_BYTES["conv"] * 2 * 800 + modeled.REST_BYTES["other"] * 1600)
  assert modeled.remainder_ms(h100, [conv, dense, scores]) == pytest.approx(want)
  prof = modeled_profile(
    Profile("m", "cpu", "traced", 2, (conv, dense, scores), {}, {}, 0.0, {}, MEMORY), "H100"
  )
  assert sum(prof.remainder_ms.values()) == pytest.approx(want)


def test_an_embedding_lookup_is_costed_as_a_gather_not_a_product():
  h100 = device("H100")
  vocab, rows, width = 30522, 4096, 768
  op = OpShape("embed:embed", "embed", 1, rows, vocab, width, 1, rows * vocab, vocab * width, rows * width)
  assert leg_ms(h100, op, "dlhs", "bf16") == 0.0
  assert leg_ms(h100, op, "fwd", "fp32") == pytest.approx(catalog.memory_ms(h100, 8 * rows * width) + 0.005)
  assert leg_ms(h100, op, "fwd", "fp32") < 0.1 * gemm_roofline_ms(h100, "fp32", rows, vocab, width)


def test_estimated_costs_name_the_unchecked_precisions_of_modeled_groups():
  from planners.report import estimated_costs

  sources = {"train": "modeled (H100)", "infer": "modeled (T4)", "local": "measured (cpu)"}
  types = {"train": "H100", "infer": "T4", "local": "cpu"}
  lines = estimated_costs(
    types, sources, {"train": {"bf16": 3}, "infer": {"int8_fwd": 2, "fp16": 1}, "local": {}}
  )
  assert lines == [
    "infer (T4): fp16, int8 costs are datasheet estimates (the catalog's T4 is never measured)"
  ]  # H100 bf16 was checked against measured steps; a measured profile is no estimate
  lines = estimated_costs(types, sources, {"train": {"int8": 1}})
  assert lines == [
    "train (H100): int8 costs are datasheet estimates (the catalog's H100 is checked against "
    "measurements at fp32, bf16)"
  ]
