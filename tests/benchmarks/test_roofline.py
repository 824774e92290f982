"""benchmarks/roofline.py scored offline on timings made to equal the roofline."""

from benchmarks import roofline
from planners import catalog
from planners.ops import OpShape


def _measured(scale: float) -> dict:
  """An H100 'measurement' of two ops whose every GEMM leg took ``scale`` × its roofline."""
  spec = catalog.device_spec("H100")
  ops = [
    OpShape("block0/mlp_in:dense", "dense", 1, 4096, 768, 3072, lhs_elems=4096 * 768, rhs_elems=768 * 3072),
    OpShape("head:dense", "dense", 1, 4096, 768, 30522, calls=2, lhs_elems=4096 * 768, rhs_elems=768 * 30522),
  ]
  gemms = {}
  for op in ops:
    for leg in roofline.LEGS:
      m, k, n = roofline.LEG_GEMM[leg](op.m, op.k, op.n)
      for p in spec.peak_tflops:
        gemms[roofline.gemm_key(op, leg, p)] = scale * catalog.gemm_roofline_ms(spec, p, m, k, n)
  return {
    "model": "two_ops",
    "device_type": "H100",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "batch_per_device": 8,
    "param_bytes": 4 * (768 * 3072 + 768 * 30522),
    "ops": [o.to_json() for o in ops],
    "gemm_ms": gemms,
    "conv_ms": {},
    "step_ms": {"bf16": 1.0},
  }


def test_legs_at_the_roofline_score_zero_error_and_slower_legs_score_their_ratio():
  rows, lines = roofline.score(_measured(1.0))
  legs = [r for r in rows if "op legs" in r["case"]]
  assert {r["case"].split()[-1] for r in legs} == set(catalog.device_spec("H100").peak_tflops)
  for r in legs:
    assert abs(r["value"] - 1.0) < 1e-9 and abs(r["summed_error"]) < 1e-9
    assert r["legs"] == 3 * 3  # three legs of two ops, the second applied twice
  rows, _ = roofline.score(_measured(2.0))
  for r in (r for r in rows if "op legs" in r["case"]):
    assert abs(r["value"] - 2.0) < 1e-9 and abs(r["summed_error"] + 0.5) < 1e-9


def test_the_step_row_compares_the_measured_step_with_the_modeled_replay():
  rows, _ = roofline.score(_measured(1.0))
  (step,) = [r for r in rows if r["case"] == "two_ops step bf16"]
  assert step["value"] == 1.0 and step["modeled_ms"] > 0
  assert abs(step["error"] - (step["modeled_ms"] - 1.0)) < 1e-12
