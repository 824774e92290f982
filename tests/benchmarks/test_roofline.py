"""benchmarks/diagnosis/roofline.py scored offline on timings made to equal the model, and on the committed
H100 steps."""

import json
import os

import pytest

from benchmarks.diagnosis import roofline
from planners import catalog
from planners.ops import OpShape
from planners.predictor.modeled import LEG_TENSORS
from qsync_jax.devices import device

OPS = [
  OpShape(
    "block0/mlp_in:dense", "dense", 1, 4096, 768, 3072, 1, 4096 * 768, 768 * 3072, 4096 * 3072, (8, 512, 768)
  ),
  OpShape(
    "head:dense", "dense", 1, 4096, 768, 30522, 2, 4096 * 768, 768 * 30522, 4096 * 30522, (8, 512, 768)
  ),
]


def _measured(scale: float) -> dict:
  """An H100 'measurement' of two ops whose every GEMM leg took ``scale`` × its roofline alone,
  and whose time inside the step is ``scale`` × the modeled legs."""
  spec = device("H100")
  gemms = {}
  for op in OPS:
    sizes = {"lhs": op.lhs_elems, "rhs": op.rhs_elems, "out": op.out_elems}
    for leg in roofline.LEGS:
      m, k, n = roofline.LEG_GEMM[leg](op.m, op.k, op.n)
      elems = tuple(sizes[t] for t in LEG_TENSORS[leg])
      for p in spec.peak_tflops:
        gemms[roofline.gemm_key(op, leg, p)] = scale * catalog.gemm_roofline_ms(spec, p, m, k, n, 1, elems)
  measured = {
    "model": "two_ops",
    "device_type": "H100",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "batch_per_device": 8,
    "param_bytes": 4 * (768 * 3072 + 768 * 30522),
    "ops": [o.to_json() for o in OPS],
    "gemm_ms": gemms,
    "conv_ms": {},
    "step_ms": {"bf16": 1.0},
    "in_step_ms": {},
  }
  modeled = roofline.modeled_profile(roofline.base_profile(measured), "H100")
  legs = {o.name: {leg: o.calls * modeled.leg_ms(o.name, leg, "bf16") for leg in roofline.LEGS} for o in OPS}
  measured["in_step_ms"]["bf16"] = {
    OPS[0].name: {"fwd": scale * legs[OPS[0].name]["fwd"], "bwd": scale * legs[OPS[0].name]["drhs"]},
    OPS[1].name: {
      "fwd": scale * legs[OPS[1].name]["fwd"],
      "bwd": scale * (legs[OPS[1].name]["dlhs"] + legs[OPS[1].name]["drhs"]),
    },
    "rest": {"fwd": scale * sum(modeled.remainder_ms.values()), "bwd": scale * modeled.optimizer_ms},
  }
  return measured


def test_legs_at_the_roofline_score_zero_error_and_slower_legs_score_their_ratio():
  rows, lines = roofline.score(_measured(1.0))
  legs = [r for r in rows if "op legs" in r["case"]]
  assert {r["case"].split()[-1] for r in legs} == set(device("H100").peak_tflops)
  for r in legs:
    assert abs(r["value"] - 1.0) < 1e-9 and abs(r["summed_error"]) < 1e-9
    assert r["legs"] == 3 * 3  # three legs of two ops, the second applied twice
  rows, _ = roofline.score(_measured(2.0))
  for r in (r for r in rows if "op legs" in r["case"]):
    assert abs(r["value"] - 2.0) < 1e-9 and abs(r["summed_error"] + 0.5) < 1e-9


def test_in_step_times_equal_to_the_model_score_zero_error_per_kind_and_for_the_rest():
  for scale, error in ((1.0, 0.0), (2.0, -0.5)):
    rows, lines = roofline.score(_measured(scale))
    in_step = {r["case"]: r for r in rows if " in-step " in r["case"]}
    assert set(in_step) == {"two_ops in-step bf16 dense", "two_ops in-step bf16 rest"}
    for r in in_step.values():
      assert r["error"] == pytest.approx(error) and r["modeled_ms"] > 0
    dense = in_step["two_ops in-step bf16 dense"]
    assert dense["fwd"][0] == pytest.approx(scale * dense["fwd"][1])  # (measured, modeled)


def test_the_step_row_compares_the_measured_step_with_the_modeled_replay():
  rows, _ = roofline.score(_measured(1.0))
  (step,) = [r for r in rows if r["case"] == "two_ops step bf16"]
  assert step["value"] == 1.0 and step["modeled_ms"] > 0
  assert abs(step["error"] - (step["modeled_ms"] - 1.0)) < 1e-12


def test_later_runs_of_a_model_add_to_and_replace_its_earlier_timings():
  first, second = _measured(1.0), _measured(2.0)
  second["step_ms"] = {"fp32": 3.0}
  (run,) = roofline.merged([first, second])
  assert run["step_ms"] == {"bf16": 1.0, "fp32": 3.0} and run["in_step_ms"] == second["in_step_ms"]


def test_the_committed_h100_steps_are_modeled_within_25_percent():
  """The catalog's model of the committed 1 × H100 steps (ResNet-50, BERT-base at 128 and 512;
  fp32 and bf16): a change to the model that moves a step past 25 % must be looked at. The bound
  was 15 % while a flat GEMM efficiency and a 12-pass fp32 remainder cancelled each other; with
  both fitted per part (docs/catalog.md), what the model leaves out shows in the step: cuDNN's
  fused bf16 attention and the bf16 LM head (a vocabulary not a multiple of 8) run slower than
  their GEMM roofline (BERT s512 bf16: −24 %), and an fp32 step's remainder is larger than the
  16-bit one the model charges every plan (ResNet-50 fp32: −18 %)."""
  path = os.path.join(os.path.dirname(roofline.RESULTS), "roofline", "h100_steps.json")
  with open(path) as f:
    runs = roofline.merged(json.load(f))
  errors = {
    (r["model"], p): roofline.modeled_step_ms(r, p) / ms - 1 for r in runs for p, ms in r["step_ms"].items()
  }
  assert len(errors) == 6
  assert max(abs(e) for e in errors.values()) < 0.25, errors


def test_a_tiny_model_is_measured_per_step_and_per_op_inside_the_step_on_the_cpu():
  said = []
  run = roofline.measure_model("bert_s128", True, said.append, step_windows=1, trace_steps=1)
  assert set(run["step_ms"]) == set(run["in_step_ms"]) == set(roofline.POLICIES) and said
  for policy, by_op in run["in_step_ms"].items():
    assert run["step_ms"][policy] > 0 and run["step_kernel_ms"][policy] > 0
    charged = {name for name, parts in by_op.items() if sum(parts.values()) > 0}
    assert "rest" in charged and any(name.endswith(":dense") for name in charged)
  rows, lines = roofline.score(json.loads(json.dumps(run)))
  assert {r["case"] for r in rows} >= {
    "bert_s128 step fp32",
    "bert_s128 in-step bf16 dense",
    "bert_s128 in-step fp32 rest",
  }
