"""Profiler pieces: op shapes from the tap, residual memory, cast-model fit, modeled profiles,
the profile's JSON and a measured profile's fits."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.catalog import gemm_roofline_ms
from planners.ops import OpShape, collect_ops, gemm_shape
from planners.predictor.graph import in_step_factors
from planners.predictor.memory_model import residual_bytes
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import predict
from planners.profile import Profile
from planners.profiler.fit import fit_cast_model, one_device
from planners.profiler.measure import measure_profile
from planners.profiler.op_programs import policy_programs, precast_dtypes
from qsync_jax.devices import device
from qsync_jax.errors import ClusterSpecError, PlanError
from qsync_jax.ops.qdot import quantized_dot_general
from qsync_jax.ops.qdot import residual_bytes as measured_residual_bytes
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from tests.planners import tiny
from tests.planners.fakes import fake_profile


@pytest.mark.parametrize("seed", range(5))
def test_cast_model_fit_recovers_synthetic_line(seed):
  # Fixed seeds: the 3 % bounds sit near 3σ of 1 % noise, so an unseeded draw would fail ~1 run in 5.
  rng = np.random.default_rng(seed)
  a, b = rng.uniform(1e-8, 1e-6), rng.uniform(1e-3, 1e-1)
  n = np.array([2**12, 2**14, 2**16, 2**18, 2**20], np.float64)
  t = (a * n + b) * (1 + rng.normal(0, 0.01, n.shape))  # 1 % noise
  model = fit_cast_model(n, t)
  assert model.a == pytest.approx(a, rel=0.05)
  assert model.rel_error < 0.03
  assert model.ms(2**20) == pytest.approx(a * 2**20 + b, rel=0.03)


def test_collect_ops_attention_model():
  task = tiny.attn(seq=8, dim=16)
  batch = next(task.train_batches(4, 0))
  variables = jax.eval_shape(task.model.init, jax.random.key(0), batch["x"])  # shapes suffice
  ops = {o.name: o for o in collect_ops(task.model, variables, batch["x"])}
  assert list(ops)[:4] == [
    "Embed_0:embed",
    "attn/query:dense_general",
    "attn/key:dense_general",
    "attn/value:dense_general",
  ]
  qk, pv = ops["attn:attention_qk"], ops["attn:attention_pv"]
  heads, head_dim = 2, 8
  assert (qk.batch, qk.m, qk.k, qk.n) == (4 * heads, 8, head_dim, 8)
  assert (pv.batch, pv.m, pv.k, pv.n) == (4 * heads, 8, 8, head_dim)
  assert not qk.has_weight and qk.param_elems == 0
  # Dense(dim)(gelu(Dense(2·dim)(x))): the outer Dense is built first (Dense_0: 32 -> 16) but
  # called second; ops are listed in call order
  assert list(ops).index("Dense_1:dense") < list(ops).index("Dense_0:dense")
  dense = ops["Dense_1:dense"]  # 16 -> 32 on 4×8 tokens
  assert (dense.batch, dense.m, dense.k, dense.n) == (1, 32, 16, 32)
  assert dense.flops == 2 * 32 * 16 * 32


def test_gemm_shape_conv():
  # 3x3 conv, 4 -> 8 channels, on 2×6×6 (SAME): im2col GEMM m = 2·6·6, k = 3·3·4, n = 8
  assert gemm_shape("conv", (2, 6, 6, 4), (3, 3, 4, 8), (2, 6, 6, 8)) == (1, 72, 36, 8)


@pytest.mark.parametrize("preset", ["bf16", "int8_fwd", "fp8"])
def test_residual_bytes_match_the_runtime(preset):
  # attention-like product (both operands are activations): the runtime saves both
  rng = np.random.default_rng(75)
  m, k, n = (int(x) for x in rng.integers(4, 32, 3))
  lhs, rhs = (
    jnp.asarray(rng.normal(size=(m, k)), jnp.float32),
    jnp.asarray(rng.normal(size=(k, n)), jnp.float32),
  )
  pol = OpPolicy.preset(preset)
  dims = (((1,), (0,)), ((), ()))
  measured = measured_residual_bytes(lambda a, b: quantized_dot_general(a, b, dims, pol), lhs, rhs)
  op = collect_like(m, k, n)
  # residual_bytes counts the saved operands (and scales); the runtime also keeps two
  # 0-d dtype prototypes (4 bytes each)
  assert residual_bytes(op, pol) == measured - 8


def collect_like(m, k, n):
  from planners.ops import OpShape

  return OpShape("x:attention_qk", "attention_qk", 1, m, k, n, 1, m * k, k * n, m * n)


def test_modeled_profile_is_labelled_and_follows_the_roofline():
  base = fake_profile([(1, 1, 1)] * 2)
  t4 = modeled_profile(base, "T4")
  assert t4.source == "modeled" and t4.device_type == "T4"
  assert set(t4.op_ms["Dense_0:dense"]["fwd"]) == {"fp32", "fp16", "int8"}
  op = base.ops[0]  # the product over the tensors the op moves
  assert t4.op_ms[op.name]["fwd"]["fp32"] == pytest.approx(
    gemm_roofline_ms(device("T4"), "fp32", op.m, op.k, op.n, 1, (op.lhs_elems, op.rhs_elems, op.out_elems))
  )
  with pytest.raises(ClusterSpecError, match="Fix: use one of"):
    modeled_profile(base, "TPUv9")


def test_profile_json_round_trip_and_errors(tmp_path):
  prof = fake_profile([(1.5, 2.5, 3.5)] * 2)
  path = tmp_path / "p.json"
  prof.save(str(path))
  again = Profile.load(str(path))
  assert again == prof
  traced = dataclasses.replace(prof, quantized_in_step_ms={"Dense_0:dense": {"fwd": 0.5, "bwd": 1.25}})
  traced.save(str(path))
  assert Profile.load(str(path)) == traced
  # fields that are not a profile's (files written by other versions) are ignored
  older = {**prof.to_json(), "quantized_leg_scale": 0.7, "relayout_ms": {"Dense_0:dense": 1.0}}
  assert Profile.from_json(older) == prof
  with pytest.raises(PlanError, match="no .* time .* Fix"):
    again.leg_ms("Dense_0:dense", "fwd", "nf4")
  path.write_text(json.dumps({"format": "something else"}))
  with pytest.raises(PlanError, match="not a qsync profile"):
    Profile.load(str(path))
  path.write_text(json.dumps({"format": "qsync-profile/1", "model": "m"}))
  with pytest.raises(PlanError, match="malformed profile.*Fix"):
    Profile.load(str(path))


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_policy_programs_hand_a_bf16_models_op_both_operands_in_bf16(kind):
  lhs_shape, rhs_shape = ((2, 8, 16), (16, 32)) if kind == "dense" else ((2, 8, 8, 16), (3, 3, 16, 32))
  out_elems = {"dense": 2 * 8 * 32, "conv": 2 * 8 * 8 * 32}[kind]
  op = OpShape(
    "op", kind, 1, 2, 8, 16, 32, math.prod(lhs_shape), math.prod(rhs_shape), out_elems, lhs_shape, rhs_shape
  )
  bf16_op = dataclasses.replace(op, activation_dtype="bfloat16")
  for preset in ("int8", "bf16"):  # quantized from bf16 (the module converted its weight); bf16: no cast
    for precast in (True, False):
      fwd_prog, fwd_bwd_prog = policy_programs(
        OpPolicy.preset(preset), 1, 2, 8, 16, op=bf16_op, precast=precast
      )
      lhs, rhs, _, g = fwd_bwd_prog.args
      assert lhs.dtype == rhs.dtype == g.dtype == jnp.bfloat16
      y, (d_lhs, d_rhs) = fwd_bwd_prog()
      assert y.dtype == jnp.bfloat16 and d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
  # a float32 model's weight stays float32 (its conversion is part of the op's program)
  _, fwd_bwd_prog = policy_programs(OpPolicy.preset("int8"), 1, 2, 8, 16, op=op, precast=True)
  assert fwd_bwd_prog.args[1].dtype == jnp.float32


@pytest.mark.parametrize(
  ("kind", "lhs_shape", "rhs_shape"),
  [
    ("dense", (2, 8, 16), (16, 32)),
    ("attention_qk", (2, 8, 4, 16), (2, 8, 4, 16)),
    ("conv", (2, 8, 8, 16), (3, 3, 16, 32)),  # 3x3, stride 1, SAME: its real geometry runs
  ],
)
def test_policy_programs_precast_hands_ops_their_activations_in_the_dtypes_the_step_converts_to(
  kind, lhs_shape, rhs_shape
):
  out_elems = {"dense": 2 * 8 * 32, "attention_qk": 2 * 4 * 8 * 8, "conv": 2 * 8 * 8 * 32}[kind]
  op = OpShape(
    "op", kind, 1, 2, 8, 16, 32, math.prod(lhs_shape), math.prod(rhs_shape), out_elems, lhs_shape, rhs_shape
  )
  attention = kind == "attention_qk"
  for preset, precast, want_in, want_out in (
    ("bf16", True, jnp.bfloat16, jnp.bfloat16),
    ("bf16", False, jnp.float32, jnp.float32),  # as profiled by default: fp32 operands, casts in the program
    ("int8", True, jnp.float32, jnp.float32),  # a quantized policy quantizes fp32 inputs in the step too
    ("int8_fwd", True, jnp.float32, jnp.float16),  # int8 forward of fp32 inputs; fp16 backward
  ):
    fwd_prog, fwd_bwd_prog = policy_programs(
      OpPolicy.preset(preset), op.batch, op.m, op.k, op.n, op=op, precast=precast
    )
    lhs, rhs, _, g = fwd_bwd_prog.args
    assert precast_dtypes(OpPolicy.preset(preset)) == (
      (None if want_in == jnp.float32 else want_in, None if want_out == jnp.float32 else want_out)
      if precast
      else (jnp.bfloat16, jnp.bfloat16)
    )
    if attention and preset == "int8_fwd":
      want_out = jnp.float32  # jnp.einsum returns its operands' dtype; the fp16 cast stays in the program
    assert lhs.dtype == want_in and g.dtype == want_out  # the output gradient comes as the output
    assert rhs.dtype == (want_in if attention else jnp.float32)  # a weight stays fp32
    y, (d_lhs, d_rhs) = fwd_bwd_prog()
    assert y.dtype == fwd_prog().dtype == want_out
    assert d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape


@pytest.mark.standard_promotion  # optax's Adam in the profiled steps
def test_a_measured_profile_is_fitted_to_its_fit_step_and_its_steps_xla_peaks():
  prof = measure_profile(
    tiny.mlp(), 16, ("fp32", "bf16", "fp16", "int8"), repeats=2, step_repeats=2, clock="cpu", fit_rounds=2
  )
  meta = prof.meta
  # the ops are timed on the step's clock here; whole policies with fp32 activations (not precast)
  assert meta["op_clock"] == "cpu" and "policy_operands" not in meta
  for op in prof.op_names:
    assert {"policy:fp32", "policy:bf16", "policy:int8", "policy:int8_fwd"} <= set(prof.op_ms[op])
  # the all-int8 step is traced op by op only where the ops are timed on the device clock
  assert prof.quantized_in_step_ms == {}
  assert meta["fit_preset"] == "bf16" and len(meta["fit_step_round_ms"]) == 2  # one median per round
  assert meta["fit_step_ms"] == pytest.approx(float(np.median(meta["fit_step_round_ms"])))
  one = one_device(prof)
  bf16, fp32 = (Plan(policies={"all": PrecisionPolicy.uniform(p)}) for p in ("bf16", "fp32"))
  replay = predict(one, {"cpu": prof}, bf16)
  if replay.step_ms != pytest.approx(meta["fit_step_ms"]):
    # a busy host (tests run two at a time) timed the step below its ops' programs: the fitted
    # remainder is negative enough that the forward ends the replayed step
    first_remainder = next(i for i, node in enumerate(replay.nodes) if node.kind == "remainder")
    forward_end = max(end for _, end in replay.times[:first_remainder])
    assert sum(prof.remainder_ms.values()) < 0 and replay.step_ms == pytest.approx(forward_end)
  # the memory model reproduces the XLA peaks it is fitted to: fp32 and all-bf16
  assert predict(one, {"cpu": prof}, fp32).memory_bytes["all"] == meta["fp32_xla_peak_bytes"]
  assert replay.memory_bytes["all"] == meta["bf16_xla_peak_bytes"]
  # without bf16 the remainder is fitted to the fp32 step
  fp32_only = measure_profile(tiny.mlp(), 16, ("fp32",), repeats=2, step_repeats=2, clock="cpu", fit_rounds=1)
  assert fp32_only.meta["fit_preset"] == "fp32" and "other_bytes_16bit" not in fp32_only.memory


@pytest.mark.gpu
@pytest.mark.standard_promotion  # optax's Adam in the profiled steps
def test_on_a_gpu_the_all_int8_step_is_traced_op_by_op_and_gives_every_op_its_factors():
  # tests/conftest.py puts JAX on the CPU unless JAX_PLATFORMS is set: run with JAX_PLATFORMS=cuda
  assert jax.devices()[0].platform == "gpu", "run the gpu tests with JAX_PLATFORMS=cuda"
  prof = measure_profile(tiny.mlp(), 16, ("fp32", "bf16", "int8"), repeats=3, step_repeats=20, fit_rounds=2)
  assert prof.meta["op_clock"] == "device" and prof.meta["policy_operands"] == "precast"
  assert set(prof.quantized_in_step_ms) == set(prof.op_names)
  for i, op in enumerate(prof.op_names):
    legs = prof.quantized_in_step_ms[op]
    assert legs["fwd"] > 0 and legs["bwd"] > 0, op  # kernels named by their instruction
    assert in_step_factors(prof, i) is not None


def test_qsync_profile_warns_when_the_repeats_of_the_op_timings_disagree(tmp_path, monkeypatch, capsys):
  from planners.profiler import timing
  from planners.profiler.measure import noisy_host_warning
  from qsync_cli.main import main

  # a busy host: every fourth clock reading comes 4 ms after the one before, the others 1 ms
  ticks = {"n": 0, "t": 0.0}

  def busy_clock():
    ticks["n"] += 1
    ticks["t"] += 0.004 if ticks["n"] % 4 == 0 else 0.001
    return ticks["t"]

  monkeypatch.setitem(timing.CLOCKS, "cpu", busy_clock)
  out = str(tmp_path / "busy.json")
  args = ["profile", "--model", "tests.planners.tiny:mlp", "--batch", "16", "--precisions", "fp32"]
  assert main([*args, "--repeats", "4", "--clock", "cpu", "--out", out]) == 0
  err = capsys.readouterr().err
  prof = Profile.load(out)
  spread = prof.meta["op_round_spread"]
  assert set(spread) and all(s == pytest.approx(4.0) for s in spread.values())
  assert f"warning: the repeats of {len(spread)} of {len(spread)} ops' timings disagree" in err
  assert "Fix: profile on an idle host, or raise --repeats (now 4)" in err
  # a quarter of the ops or fewer is no warning; nor is a profile without the record
  steady = {f"op{i}": 4.0 if i < 2 else 1.1 for i in range(8)}  # 2 of 8 noisy
  assert noisy_host_warning(dataclasses.replace(prof, meta={**prof.meta, "op_round_spread": steady})) is None
  assert noisy_host_warning(dataclasses.replace(prof, meta={"repeats": 4})) is None
