"""``benchmarks/predictor.py`` end to end on the CPU with the small mlp (tiny repeats: the
numbers are noise; the test checks what is timed, fitted and written)."""

import dataclasses
import json

import pytest

from benchmarks import predictor
from planners.predictor.replay import predict
from planners.profile import Profile
from planners.profiler.fit import fit_profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy


@pytest.mark.standard_promotion  # optax's Adam in the timed steps
def test_plans_timed_round_robin_predicted_and_scored_with_and_without_in_step_factors(tmp_path, capsys):
  results = tmp_path / "predictor.jsonl"
  argv = ["--models", "mlp", "--repeats", "2", "--rounds", "2", "--profile-repeats", "2", "--refit"]
  predictor.main(
    [*argv, "--results", str(results), "--profile-dir", str(tmp_path / "profiles"), "--run", "t"]
  )
  assert [p.name for p in (tmp_path / "profiles").iterdir()] == ["mlp.json"]  # saved, no checkpoint left
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  assert {r["run"] for r in rows} == {"t"}
  as_profiled = {r["case"]: r for r in rows if r["metric"] == "step_ms_cpu_clock" and not r.get("fit")}
  fits = {r["case"] for r in rows if r.get("fit")}
  assert fits == {"mlp/bf16 (fit)"}  # the remainder's fit step, for offline refits
  for r in rows:  # with their round medians, as the evaluated plans' (a drift shows per round)
    if r.get("fit") and r["metric"] == "step_ms_cpu_clock":
      assert len(r["rounds"]) == 2 and r["baseline"] == pytest.approx(sum(r["rounds"]) / 2)
  refit = {r["case"]: r for r in rows if r["metric"] == "step_ms_cpu_clock_refit"}
  plans = predictor.plans(["Dense_0:dense", "Dense_1:dense"])
  evaluated = {f"mlp/{case}" for case in [*plans, "fp32"] if case != "bf16"}
  assert set(as_profiled) == set(refit) == evaluated  # all-bf16 is the fit
  # memory is fitted to the fp32 and all-bf16 steps' peaks: every other plan's is scored
  memory = {r["case"] for r in rows if r["metric"] == "peak_bytes"}
  assert memory == evaluated - {"mlp/fp32"}
  for case, r in as_profiled.items():
    assert len(r["rounds"]) == 2 and r["baseline"] == pytest.approx(sum(r["rounds"]) / 2)
    assert refit[case]["baseline"] == r["baseline"]  # the same measured step, two predictions
  summary = {r["case"] for r in rows if r["metric"] == "abs_rel_error"}
  assert summary == {"all/mean_abs_step_error", "all/mean_abs_memory_error", "all/mean_abs_step_error_refit"}
  assert "refitted to the fit step timed among the plans" in capsys.readouterr().out

  # A second run reuses the saved profile instead of measuring one; given in-step factors (as a
  # GPU profile holds them), it also scores every plan without them. One test, not two, so that
  # the profile is measured once.
  path = str(tmp_path / "profiles" / "mlp.json")
  plain = Profile.load(path)
  assert plain.quantized_in_step_ms == {}  # XLA:CPU: not traced (planners.profiler.measure)
  traced = {op: {"fwd": 1.0, "bwd": 2.0} for op in plain.op_names}  # int8 legs twice as dear in the step
  fit_profile(dataclasses.replace(plain, quantized_in_step_ms=traced)).save(path)
  again, results = ["--models", "mlp", "--repeats", "1", "--rounds", "1"], tmp_path / "again.jsonl"
  predictor.main([*again, "--profile-dir", str(tmp_path / "profiles"), "--results", str(results)])
  out = capsys.readouterr().out
  assert f"# mlp: profile {path}" in out and "profiled" not in out
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  by = {(r["case"], r["metric"]): r["value"] for r in rows}
  without = {case for case, metric in by if metric == "step_ms_cpu_clock_no_in_step"}
  evaluated = {r["case"] for r in rows if r["metric"] == "step_ms_cpu_clock" and not r.get("fit")}
  assert without == evaluated and without  # every evaluated plan, fits aside
  cluster = ClusterSpec.uniform("cpu", 1, plain.batch_per_device, memory_gb=1e3)
  int8_fwd = Plan(policies={"all": PrecisionPolicy.uniform("int8_fwd")})
  assert by[("mlp/int8_fwd", "step_ms_cpu_clock_no_in_step")] == pytest.approx(
    predict(cluster, {"cpu": plain}, int8_fwd).step_ms  # the profile as it was, fitted to the same step
  )
  assert by[("mlp/int8_fwd", "step_ms_cpu_clock")] != pytest.approx(
    by[("mlp/int8_fwd", "step_ms_cpu_clock_no_in_step")]
  )
  assert ("all/mean_abs_step_error_no_in_step", "abs_rel_error") in by
  assert "no_in_step profile: step-time |error|" in out
