"""``benchmarks/predictor_replay.py``: a logged predictor run scored offline (no timing)."""

import dataclasses
import json

import pytest

from benchmarks import predictor_replay
from planners.profiler import with_16bit_other_bytes
from planners.replay import predict, refit_profile
from qsync_jax.cluster import ClusterSpec
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from tests.planners.fakes import fake_profile


def _logged_run(tmp_path, measured: dict[str, float], peaks: dict[str, int]):
  """A profile saved in ``tmp_path`` and a results file holding one run's rows of it."""
  prof = dataclasses.replace(
    fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0, other_bytes=10**6),
    model="mlp",
  )
  (tmp_path / "profiles").mkdir()
  prof.save(str(tmp_path / "profiles" / "mlp.json"))
  rows = []
  for plan, ms in measured.items():
    fit = plan in ("fp32", "int8", "bf16")
    case = f"mlp/{plan}" + (" (fit)" if fit else "")
    rows.append({"run": "r", "case": case, "metric": "step_ms_cpu_clock", "baseline": ms, "device": "cpu"})
    if plan in peaks:
      rows.append(
        {"run": "r", "case": case, "metric": "peak_bytes", "baseline": peaks[plan], "device": "cpu"}
      )
  rows.append(
    {"run": "other", "case": "mlp/fp16", "metric": "step_ms_cpu_clock", "baseline": 1.0, "device": "cpu"}
  )
  results = tmp_path / "predictor.jsonl"
  results.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return prof, results


def test_replay_refits_to_the_runs_fit_steps_and_scores_the_rest(tmp_path):
  measured = {"fp32": 12.0, "int8": 7.0, "bf16": 6.5, "fp16": 6.0, "int8_fwd": 9.0}
  prof, results = _logged_run(tmp_path, measured, {"fp32": 3 * 10**6, "bf16": 25 * 10**5, "fp16": 2 * 10**6})
  argv = ["--run", "r", "--profile-dir", str(tmp_path / "profiles"), "--results", str(results)]
  assert predictor_replay.main(argv) == 0
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  mine = [r for r in rows if r.get("run") == "replay-r"]
  steps = {r["case"]: r for r in mine if r["metric"] == "step_ms_cpu_clock_refit"}
  assert set(steps) == {f"mlp/{p}" for p in measured}
  for plan in ("fp32", "int8", "bf16"):  # the fits reproduce their steps
    assert steps[f"mlp/{plan}"]["fit"] and steps[f"mlp/{plan}"]["value"] == pytest.approx(measured[plan])
  # an evaluated plan: what the refitted replay predicts, against the run's step
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)
  # the all-bf16 step's peak fits the 16-bit memory correction
  fitted = with_16bit_other_bytes(refit_profile(one, prof, 12.0, 7.0, 6.5), 25 * 10**5)
  fp16 = predict(one, {"cpu": fitted}, Plan(policies={"all": PrecisionPolicy.uniform("fp16")}))
  assert steps["mlp/fp16"]["value"] == pytest.approx(fp16.step_ms) and steps["mlp/fp16"]["baseline"] == 6.0
  # memory: every plan with a peak but its fits, fp32 and all-bf16
  memory = {r["case"]: r for r in mine if r["metric"] == "peak_bytes"}
  assert set(memory) == {"mlp/fp16"} and memory["mlp/fp16"]["value"] == fp16.memory_bytes["all"]
  summary = {r["case"]: r["value"] for r in mine if r["metric"] == "abs_rel_error"}
  errors = [abs(steps[f"mlp/{p}"]["value"] / measured[p] - 1) for p in ("fp16", "int8_fwd")]
  assert summary["all/mean_abs_step_error_refit"] == pytest.approx(sum(errors) / 2)
  assert summary["all/mean_abs_memory_error"] == pytest.approx(abs(fp16.memory_bytes["all"] / 2e6 - 1))
  bf16 = predict(one, {"cpu": fitted}, Plan(policies={"all": PrecisionPolicy.uniform("bf16")}))
  # fp16, all 16-bit too, gets the same correction (its scored peak differs here: 2.0 MB)
  assert bf16.memory_bytes["all"] == fp16.memory_bytes["all"] == 25 * 10**5
  with pytest.raises(SystemExit, match="no rows of run 'nope'.*Fix: pass a run tag"):
    predictor_replay.main(
      ["--run", "nope", "--profile-dir", str(tmp_path / "profiles"), "--results", str(results)]
    )


def test_a_step_ops_table_gives_the_profile_its_in_step_int8_times(tmp_path):
  measured = {"fp32": 12.0, "int8": 7.0, "bf16": 6.5, "int8_fwd": 9.0}
  prof, results = _logged_run(tmp_path, measured, {})
  table = tmp_path / "per_op.json"
  table.write_text(json.dumps({"int8": {"Dense_0|fwd": 0.6, "Dense_0|bwd": 0.45, "rest|bwd": 2.0}}))
  traced = predictor_replay.with_in_step_table(prof, str(table))
  assert traced.quantized_in_step_ms == {
    "Dense_0:dense": {"fwd": 0.6, "bwd": 0.45},
    "Dense_1:dense": {"fwd": 0.0, "bwd": 0.0},  # not in the table: no factors (graph)
  }
  argv = ["--run", "r", "--profile-dir", str(tmp_path / "profiles"), "--results", str(results)]
  assert predictor_replay.main([*argv, "--in-step", f"mlp={table}", "--tag", "t"]) == 0
  rows = {r["case"]: r for r in map(json.loads, results.read_text().splitlines()) if r.get("run") == "t"}
  one = ClusterSpec.uniform("cpu", 1, prof.batch_per_device, memory_gb=1e3)
  fitted = refit_profile(one, traced, 12.0, 7.0, 6.5)
  int8_fwd = predict(
    one, {"cpu": fitted}, Plan(policies={"all": PrecisionPolicy.uniform("int8_fwd")})
  ).step_ms
  assert rows["mlp/int8_fwd"]["value"] == pytest.approx(int8_fwd)
  untraced = refit_profile(one, prof, 12.0, 7.0, 6.5)
  plain = predict(one, {"cpu": untraced}, Plan(policies={"all": PrecisionPolicy.uniform("int8_fwd")})).step_ms
  assert int8_fwd != pytest.approx(plain)  # the table changed the prediction
  for bad in ("mlp", f"vgg={table}", f"mlp={tmp_path / 'none.json'}"):
    with pytest.raises(SystemExit, match="needs MODEL=TABLE .*Fix"):
      predictor_replay.main([*argv, "--in-step", bad, "--no-save"])
  table.write_text(json.dumps({"bf16": {}}))
  with pytest.raises(SystemExit, match="no 'int8' plan.*Fix: trace it"):
    predictor_replay.with_in_step_table(prof, str(table))
