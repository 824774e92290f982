"""``benchmarks/diagnosis/predictor_replay.py``: a logged predictor run scored offline (no timing)."""

import dataclasses
import json

import pytest

from benchmarks.diagnosis import predictor_replay
from planners.predictor.replay import predict
from planners.profiler.fit import fit_profile, fit_remainder, one_device
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from tests.planners.fakes import fake_profile

MEASUREMENTS = {
  "fit_preset": "bf16",
  "fit_step_ms": 6.0,
  "fp32_xla_peak_bytes": 3 * 10**6,
  "bf16_xla_peak_bytes": 25 * 10**5,
}


def _logged_run(tmp_path, measured: dict[str, float], peaks: dict[str, int], meta=None):
  """A profile saved in ``tmp_path`` and a results file holding one run's rows of it (the run fitted
  fp32, all-int8 and all-bf16, as runs did)."""
  prof = dataclasses.replace(
    fake_profile([(1, 2, 3), (1, 2, 3)], remainder_ms=4.0, optimizer_ms=1.0, other_bytes=10**6),
    model="mlp",
    meta=dict(meta or MEASUREMENTS),
  )
  (tmp_path / "profiles").mkdir(exist_ok=True)
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


def _rows(results, tag):
  return [r for r in map(json.loads, results.read_text().splitlines()) if r.get("run") == tag]


def test_replay_fits_as_profiled_or_to_the_runs_fit_step_and_scores_the_rest(tmp_path, capsys):
  measured = {"fp32": 12.0, "int8": 7.0, "bf16": 6.5, "fp16": 6.0, "int8_fwd": 9.0}
  prof, results = _logged_run(tmp_path, measured, {"fp32": 3 * 10**6, "bf16": 25 * 10**5, "fp16": 2 * 10**6})
  argv = ["--run", "r", "--profile-dir", str(tmp_path / "profiles"), "--results", str(results)]
  assert predictor_replay.main(argv) == 0
  mine = _rows(results, "replay-r")
  steps = {r["case"]: r for r in mine if r["metric"] == "step_ms_cpu_clock_replay"}
  assert set(steps) == {f"mlp/{p}" for p in measured}
  # as profiled: the remainder fitted to the profile's own fit step (6 ms), memory to its peaks
  fitted = fit_profile(prof)
  one = one_device(prof)

  def pred(p, plan):
    return predict(one, {"cpu": p}, Plan(policies={"all": PrecisionPolicy.uniform(plan)}))

  assert steps["mlp/bf16"]["value"] == pytest.approx(6.0) and steps["mlp/bf16"]["fit"]
  fp16 = pred(fitted, "fp16")
  assert steps["mlp/fp16"]["value"] == pytest.approx(fp16.step_ms) and steps["mlp/fp16"]["baseline"] == 6.0
  # memory: every plan with a peak but its fits, fp32 and all-bf16
  memory = {r["case"]: r for r in mine if r["metric"] == "peak_bytes"}
  assert set(memory) == {"mlp/fp16"} and memory["mlp/fp16"]["value"] == fp16.memory_bytes["all"]
  assert pred(fitted, "bf16").memory_bytes["all"] == 25 * 10**5  # fp16, all 16-bit, gets the same
  assert pred(fitted, "fp32").memory_bytes["all"] == 3 * 10**6
  # the means are over the plans the run did not fit (fp16, int8_fwd)
  summary = {r["case"]: r["value"] for r in mine if r["metric"] == "abs_rel_error"}
  errors = [abs(steps[f"mlp/{p}"]["value"] / measured[p] - 1) for p in ("fp16", "int8_fwd")]
  assert summary["all/mean_abs_step_error_replay"] == pytest.approx(sum(errors) / 2)
  assert summary["all/mean_abs_memory_error"] == pytest.approx(abs(fp16.memory_bytes["all"] / 2e6 - 1))
  assert "the run's other 2 fit plans, predicted now" in capsys.readouterr().out  # fp32, int8
  # --refit: the remainder fitted to the run's own all-bf16 step instead
  assert predictor_replay.main([*argv, "--refit", "--tag", "t"]) == 0
  refit = {r["case"]: r["value"] for r in _rows(results, "t") if r["metric"] == "step_ms_cpu_clock_refit"}
  assert refit["mlp/fp16"] == pytest.approx(pred(fit_remainder(fitted, "bf16", 6.5), "fp16").step_ms)
  with pytest.raises(SystemExit, match="no rows of run 'nope'.*Fix: pass a run tag"):
    predictor_replay.main(
      ["--run", "nope", "--profile-dir", str(tmp_path / "profiles"), "--results", str(results)]
    )


def test_an_older_profile_is_fitted_to_the_measurements_it_recorded_under_former_keys(tmp_path):
  former = {
    "fp32_step_ms": 12.0,
    "sixteen_bit_fit_step_ms": 6.0,
    "sixteen_bit_step_ms_samples": [6.0],
    "fp32_xla_peak_bytes": 3 * 10**6,
    "sixteen_bit_xla_peak_bytes": 25 * 10**5,
  }
  prof, _ = _logged_run(tmp_path, {"fp32": 12.0}, {}, meta=former)
  now = predictor_replay.with_measurements(prof)
  assert {k: now.meta[k] for k in MEASUREMENTS} == MEASUREMENTS
  fitted, expected = fit_profile(now), fit_profile(dataclasses.replace(prof, meta=MEASUREMENTS))
  assert (fitted.remainder_ms, fitted.memory) == (expected.remainder_ms, expected.memory)
  # a profile without an all-bf16 step: its fp32 step
  fp32_only = predictor_replay.with_measurements(dataclasses.replace(prof, meta={"fp32_step_ms": 12.0}))
  assert (fp32_only.meta["fit_preset"], fp32_only.meta["fit_step_ms"]) == ("fp32", 12.0)


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
  rows = {r["case"]: r for r in _rows(results, "t")}
  int8_fwd = Plan(policies={"all": PrecisionPolicy.uniform("int8_fwd")})
  with_table = predict(one_device(prof), {"cpu": fit_profile(traced)}, int8_fwd).step_ms
  assert rows["mlp/int8_fwd"]["value"] == pytest.approx(with_table)
  plain = predict(one_device(prof), {"cpu": fit_profile(prof)}, int8_fwd).step_ms
  assert with_table != pytest.approx(plain)  # the table changed the prediction
  for bad in ("mlp", f"vgg={table}", f"mlp={tmp_path / 'none.json'}"):
    with pytest.raises(SystemExit, match="needs MODEL=TABLE .*Fix"):
      predictor_replay.main([*argv, "--in-step", bad, "--no-save"])
  table.write_text(json.dumps({"bf16": {}}))
  with pytest.raises(SystemExit, match="no 'int8' plan.*Fix: trace it"):
    predictor_replay.with_in_step_table(prof, str(table))
