"""``benchmarks/diagnosis/models.py``'s offline replay: measured steps read back from a run's rows."""

import dataclasses
import json

import pytest

from benchmarks.diagnosis import models
from planners.profile import Profile
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


@pytest.mark.standard_promotion  # optax's Adam in the profiled steps
def test_models_refits_and_predicts_every_plan_from_both_profiles(tmp_path):
  """The GPU benchmark's path on the CPU with the small mlp. A first run times the uniform and
  mixed plans and saves the profile (its checkpoint gone). A replay of that profile and a precast
  variant of it on recorded steps (``--steps-from``) then refits both to the fit step and
  predicts every plan from each. The replayed steps are the measured ones scaled up 10x, so that
  the fit is reachable whatever the load on the host (a step shorter than the standalone op
  timings, inflated on a busy host, cannot be fitted exactly)."""
  results, profiles = tmp_path / "models.jsonl", tmp_path / "profiles"
  argv = ["--models", "mlp", "--profile-dir", str(profiles), "--results", str(results), "--repeats", "3"]
  assert models.main([*argv, "--profile-repeats", "2", "--mixed", "--no-plan"]) == 0
  assert sorted(p.name for p in profiles.iterdir()) == ["mlp.json"]
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  steps = {r["case"].partition("/")[2]: r for r in rows if r["metric"] == "step_ms_median"}
  assert set(steps) == set(models.UNIFORM) | set(models.MIXED)
  pipelined = {r["case"].partition("/")[2]: r for r in rows if r["metric"] == "step_ms_pipelined"}
  assert set(pipelined) == set(steps)  # both clocks by default
  for r in [*steps.values(), *pipelined.values()]:  # round-robin (--rounds 3): the median of the rounds
    assert len(r["rounds"]) == 3 and r["value"] == sorted(r["rounds"])[1]
    assert r["spread_ms"] == pytest.approx(max(r["rounds"]) - min(r["rounds"]))
  predicted = [r for r in rows if r["metric"] == "predicted_step_ms"]
  assert {(r["operands"], r["clock"]) for r in predicted} == {("fp32", c) for c in ("wall", "pipelined")}
  for r in predicted:  # each clock's prediction is scored against that clock's step
    want = (steps if r["clock"] == "wall" else pipelined)[r["case"].partition("/")[2]]["value"]
    assert r["baseline"] == want
  # a precast variant, as a GPU would time it: the bf16 programs half as long
  prof = Profile.load(str(profiles / "mlp.json"))
  op_ms = {
    op: {
      k: ({**t, "fwd": t["fwd"] / 2, "bwd": t["bwd"] / 2} if k == "policy:bf16" else t)
      for k, t in table.items()
    }
    for op, table in prof.op_ms.items()
  }
  meta = {**prof.meta, "policy_operands": "precast"}
  dataclasses.replace(prof, op_ms=op_ms, meta=meta).save(str(profiles / "mlp.precast.json"))

  recorded = tmp_path / "recorded.jsonl"  # the wall clock's steps only: the replay predicts those
  scaled = {name: 10 * r["value"] for name, r in steps.items()}
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
  for operands in ("fp32", "precast"):  # the fit: refitted to the recorded all-bf16 step
    assert predicted[("bf16", operands)] == pytest.approx(scaled["bf16"], rel=1e-6)
  # the same remainder absorbs the faster bf16 programs: the other plans move by that difference
  assert predicted[("fp32", "precast")] > predicted[("fp32", "fp32")]
  summary = [r for r in rows if r["metric"] == "abs_rel_error" and r.get("run") == "replay-r"]
  assert [(r["operands"], r["clock"], r["refit"]) for r in summary] == [
    ("fp32", "wall", True),
    ("precast", "wall", True),
  ]
  for r in summary:  # the mean error leaves out the fit plan
    evaluated = [name for name in steps if name != "bf16"]
    errors = [abs(predicted[(name, r["operands"])] / scaled[name] - 1) for name in evaluated]
    assert r["value"] == pytest.approx(sum(errors) / len(errors))
  with pytest.raises(SystemExit, match="no step rows of 'mlp' in run 'nope'.*Fix: pass a run tag"):
    models.main([*replay, "--steps-from", "nope"])
