"""``benchmarks/models.py``'s offline replay: measured steps read back from a run's rows."""

import json

import pytest

from benchmarks import models
from tests.benchmarks import result, write_rows


def test_steps_from_reads_the_uniform_steps_of_one_run_and_model(tmp_path):
  step = "step_ms_median"
  path = write_rows(
    tmp_path / "models.jsonl",
    [
      result("r1", "lm_base/bf16", step, 5.2, "H100", iqr_ms=0.04),
      result("r1", "lm_base/fp32", step, 21.8, "H100"),
      result("r1", "lm_base/qsync", step, 6.5, "H100"),  # not a uniform policy
      result("r1", "lm_base/bf16", "predicted_step_ms", 7.0, "H100"),
      result("r1", "resnet18_224/bf16", step, 7.0, "H100"),
      result("r0", "lm_base/int8", step, 9.9, "H200"),
    ],
  )
  found, device = models.steps_from(path, "r1", "lm_base")
  assert device == "H100"
  assert set(found) == {"bf16", "fp32"}
  assert found["bf16"][:2] == (5.2, 0.04) and found["bf16"][2] is None  # no XLA peak in step rows
  assert models.steps_from(path, "r2", "lm_base") == ({}, None)
  assert models.steps_from(path, "r1", "lm_base", "pipelined") == ({}, None)  # no such rows


@pytest.mark.standard_promotion  # optax's Adam in the profiled fp32 step
def test_models_refits_and_predicts_every_plan_from_both_profiles(tmp_path):
  """The GPU benchmark's path on the CPU with the small mlp. A first run times the uniform and
  mixed plans and saves the profile (its checkpoint gone) and its precast variant. A replay of
  those profiles on recorded steps (``--steps-from``) then refits both to the fp32 step and
  predicts every plan from each. The replayed steps are the measured ones scaled up 10x, the
  fp32 step 20x, so that every fit is reachable whatever the load on the host: a step shorter
  than the standalone op timings (inflated on a busy CI host) cannot be refitted exactly
  (``refit_remainder``), nor an fp32 step shorter than the remainder fitted to the all-bf16 step
  plus the optimizer (``refit_16bit_remainder`` clips the fp32 legs' scale at 0)."""
  results, profiles = tmp_path / "models.jsonl", tmp_path / "profiles"
  argv = ["--models", "mlp", "--profile-dir", str(profiles), "--results", str(results), "--repeats", "3"]
  assert models.main([*argv, "--profile-repeats", "2", "--precast", "--mixed", "--no-plan"]) == 0
  assert sorted(p.name for p in profiles.iterdir()) == ["mlp.json", "mlp.precast.json"]
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  steps = {r["case"].partition("/")[2]: r for r in rows if r["metric"] == "step_ms_median"}
  assert set(steps) == set(models.UNIFORM) | set(models.MIXED)
  pipelined = {r["case"].partition("/")[2]: r for r in rows if r["metric"] == "step_ms_pipelined"}
  assert set(pipelined) == set(steps)  # both clocks by default
  for r in [*steps.values(), *pipelined.values()]:  # round-robin (--rounds 3): the median of the rounds
    assert len(r["rounds"]) == 3 and r["value"] == sorted(r["rounds"])[1]
    assert r["spread_ms"] == pytest.approx(max(r["rounds"]) - min(r["rounds"]))
  predicted = [r for r in rows if r["metric"] == "predicted_step_ms"]
  assert {(r["operands"], r["clock"]) for r in predicted} == {
    (v, c) for v in ("fp32", "precast") for c in ("wall", "pipelined")
  }
  for r in predicted:  # each clock's prediction is scored against that clock's step
    want = (steps if r["clock"] == "wall" else pipelined)[r["case"].partition("/")[2]]["value"]
    assert r["baseline"] == want

  recorded = tmp_path / "recorded.jsonl"  # the wall clock's steps only: the replay predicts those
  scaled = {name: (20 if name == "fp32" else 10) * r["value"] for name, r in steps.items()}
  lines = [json.dumps({**r, "run": "r", "value": scaled[name]}) + "\n" for name, r in steps.items()]
  recorded.write_text("".join(lines))
  replay = ["--models", "mlp", "--profile-dir", str(profiles), "--results", str(recorded)]
  assert models.main([*replay, "--steps-from", "r", "--precast", "--refit"]) == 0
  rows = [json.loads(line) for line in recorded.read_text().splitlines()]
  predicted = {
    (r["case"].partition("/")[2], r["operands"]): r["value"]
    for r in rows
    if r["metric"] == "predicted_step_ms" and r.get("run") == "replay-r"
  }
  assert set(predicted) == {(name, v) for name in steps for v in ("fp32", "precast")}
  for operands in ("fp32", "precast"):  # the fits: refitted to the recorded fp32, all-int8, all-bf16 steps
    for fit in ("fp32", "int8", "bf16"):
      assert predicted[(fit, operands)] == pytest.approx(scaled[fit], rel=1e-6)
  # all-int8 is not precast: both fitted to the same step. Equal up to rounding, not bit for
  # bit: its scale is fitted on the remainder of the all-bf16 step, whose programs differ
  assert predicted[("int8", "fp32")] == pytest.approx(predicted[("int8", "precast")], rel=1e-9)
  summary = [r for r in rows if r["metric"] == "abs_rel_error" and r.get("run") == "replay-r"]
  assert [(r["operands"], r["clock"], r["refit"]) for r in summary] == [
    ("fp32", "wall", True),
    ("precast", "wall", True),
  ]
  for r in summary:  # the mean error leaves out the three fit plans
    evaluated = [name for name in steps if name not in ("fp32", "int8", "bf16")]
    errors = [abs(predicted[(name, r["operands"])] / scaled[name] - 1) for name in evaluated]
    assert r["value"] == pytest.approx(sum(errors) / len(errors))
  with pytest.raises(SystemExit, match="no step rows of 'mlp' in run 'nope'.*Fix: pass a run tag"):
    models.main([*replay, "--steps-from", "nope"])
