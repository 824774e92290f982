"""The demo's planning, table and outputs on hand-built profiles (no measuring, no training)."""

import argparse
import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

from examples import demo
from planners.allocator import summary
from planners.allocator.bound import BASELINES
from planners.predictor.replay import Prediction
from qsync_jax.errors import QsyncError
from qsync_jax.plan import Plan
from tests.planners.fakes import fake_indicator, fake_profile

N_OPS = 4


def _profiles(rng):
  legs = [tuple(float(v) for v in rng.uniform(0.5, 2.0, size=3)) for _ in range(N_OPS)]
  # The T4 is 2x slower than the V100 at fp32; int8 runs its legs at 0.3x fp32 (the fake's table).
  v100 = fake_profile(legs, device_type="V100", batch=8)
  t4 = fake_profile([tuple(2 * t for t in row) for row in legs], device_type="T4", batch=8)
  return {"V100": v100, "T4": t4}, v100.op_names


def _planned(rng):
  profiles, ops = _profiles(rng)
  indicator = fake_indicator(ops, rng.uniform(0.1, 1.0, size=N_OPS))
  indicator.update(
    method="gradient", precisions=["fp32", "int8", "fp16"], ops=list(ops), format="qsync-indicator/1"
  )
  cluster = demo.demo_cluster(8)
  return cluster, profiles, indicator, demo.stage_plan(cluster, profiles, indicator, lambda m: None)


def test_stage_plan_gives_the_joint_plan_and_its_alternatives():
  cluster, profiles, indicator, planned = _planned(np.random.default_rng(101))
  assert set(demo.CONFIGS) <= set(planned)
  preds = {name: pred for name, (_, pred, _) in planned.items()}
  assert all(isinstance(p, Prediction) for p in preds.values())
  joint = planned["joint"][2]
  for name, (plan, pred, cand) in planned.items():
    # the prediction is the plan's, and the joint plan is never slower beyond the slack
    assert pred.step_ms == pytest.approx(cand.step_ms)
    assert plan.apply_to(cluster).global_batch == cluster.global_batch
    if cand.fits and not cand.reference:  # (references: baselines outside the plan's space)
      assert joint.samples_per_s >= cand.samples_per_s / 1.02 * (1 - 1e-9), name
  # Dynamic batching moves examples from the T4s to the V100s (2x faster at fp32).
  dyn = planned["dynamic batching"][2]
  assert dyn.batches[1] < dyn.batches[0] and dyn.cost == 0.0
  # Uniform low precision runs int8 on every T4 op; its plan keeps the spec's batches.
  mix = demo.precision_mix(planned["uniform low precision"][0], "inference", profiles["T4"].op_names)
  assert mix == f"int8×{N_OPS}"
  alternatives = planned["joint"][0].predictions["alternatives"]
  assert {a["name"] for a in alternatives} == set(planned)
  for line in demo.why_not_beaten(planned):
    assert "joint" in line or "faster" in line


def test_pools_table_gives_the_gain_against_the_faster_baseline_and_the_bound():
  """Each pool's row: the chosen plan against the fastest baseline (dynamic batching or the training
  group alone, also at 8-bit auto policies), and the pool's bound; every figure's header says modeled."""
  cluster, profiles, indicator, planned = _planned(np.random.default_rng(106))
  modern = demo.modern_cluster(8)
  profiles = {**profiles, "A100": dataclasses.replace(profiles["V100"], device_type="A100")}
  planned_modern = demo.stage_plan(modern, profiles, indicator, lambda m: None, "bf16")
  text = demo.pools_table([("paper", "fp16", planned), ("modern", "bf16", planned_modern)])
  headers, rows = _columns(text)
  assert all(
    h.endswith("(modeled)") for h in headers if h not in ("pool", "training at", "plan (batch per device)")
  )
  for name, p in (("paper", planned), ("modern", planned_modern)):
    baselines = [p[n][2] for n in BASELINES if n in p and p[n][2].fits]
    best = max(baselines, key=lambda c: c.samples_per_s)
    chosen = p[p["joint"][0].predictions["chosen"]][2]
    label = summary.baseline_label(best, chosen)  # its sync where not the plan's; a reference marked
    assert rows[name]["best baseline (modeled)"] == f"{label} ({best.samples_per_s:.0f})"
    assert label.startswith(best.name) and ("reference" in label) == best.reference
    assert rows[name]["gain (modeled)"] == f"{chosen.samples_per_s / best.samples_per_s:.2f}×"
    assert float(rows[name]["bound (modeled)"]) >= chosen.samples_per_s * (1 - 1e-9)


def test_training_precision_is_fp16_on_a_v100_and_bf16_on_an_a100():
  assert demo.training_precision(demo.demo_cluster(8)) == "fp16"
  assert demo.training_precision(demo.modern_cluster(8)) == "bf16"


def _columns(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
  """The headers of a ``planners.report.table`` and ``{row name: {header: cell}}``: columns are
  split where the dashes under the headers are."""
  lines = text.splitlines()
  spans, at = [], 0
  for dashes in lines[1].split("  "):
    spans.append((at, at + len(dashes)))
    at += len(dashes) + 2
  cells = [[line[a:b].strip() for a, b in spans] for line in lines]
  headers = cells[0]
  return headers, {row[0]: dict(zip(headers, row)) for row in cells[2:]}


def test_results_table_says_modeled_and_scales_the_accuracy_cost(tmp_path):
  """Every column the replay predicts for the modeled pool says so in its header; the accuracy
  cost reads relative to uniform low precision (1); no single-seed held-out metric is shown."""
  cluster, profiles, indicator, planned = _planned(np.random.default_rng(102))
  trained = {name: {"train_loss": 0.5, "eval_loss": 0.6, "eval_accuracy": 0.9} for name in planned}
  text = demo.results_table(cluster, planned, trained, profiles["T4"].op_names)
  headers, rows = _columns(text)
  assert len(rows) == len(planned) and "joint" in rows
  predicted = [h for h in headers if h.split(" (")[0] in ("step ms", "samples/s", "vs best baseline", "fits")]
  assert len(predicted) == 4 and all(h.endswith("(modeled)") for h in predicted), headers
  assert not any("held-out" in h or "accuracy" in h for h in headers), headers
  cost = "acc. cost (uniform low = 1)"
  assert rows["uniform low precision"][cost] == "1" and rows["dynamic batching"][cost] == "0"
  low = planned["uniform low precision"][2].cost
  for name, (_, _, cand) in planned.items():  # 3 significant digits, however small
    assert float(rows[name][cost]) == pytest.approx(cand.cost / low, rel=5e-3), name
  assert "held-out" in demo.ACCURACY_NOTE and "results.json" in demo.ACCURACY_NOTE
  assert "modeled" in demo.MODELED_NOTE and "uniform low precision" in demo.MODELED_NOTE


def test_accuracy_cost_without_a_uniform_low_precision_plan_is_the_raw_sum():
  *_, planned = _planned(np.random.default_rng(105))
  planned.pop("uniform low precision")
  header, cost = demo.accuracy_cost_scale(planned)
  assert header == "acc. cost (Σ share·Ω)" and cost(1.25e-7) == "1.25e-07"


def test_results_table_and_outputs(tmp_path):
  cluster, profiles, indicator, planned = _planned(np.random.default_rng(102))
  trained = {name: {"train_loss": 0.5, "eval_loss": 0.6, "eval_accuracy": 0.9} for name in planned}
  text = demo.results_table(cluster, planned, trained, profiles["T4"].op_names)
  lines = text.splitlines()
  assert "samples/s" in lines[0] and "vs best baseline" in lines[0] and len(lines) == 2 + len(planned)
  assert any(line.startswith("joint") for line in lines)
  demo.write_outputs(str(tmp_path), cluster, indicator, profiles, planned, trained, lambda m: None)
  plan = Plan.load(str(tmp_path / "plan.json"))
  assert plan.predictions["alternatives"] and plan.batch_per_device
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e.get("ph") == "X" for e in trace["traceEvents"])
  for png in ("timeline.png", "sensitivity.png"):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  results = json.loads((tmp_path / "results.json").read_text())
  assert set(results) == set(planned) and results["joint"]["eval_accuracy"] == 0.9
  assert "qsync_precision_only.json" in {p.name for p in (tmp_path / "plans").iterdir()}


def test_simulated_devices_uses_the_first_four():
  devices = demo.simulated_devices(4)
  assert list(devices) == jax.devices()[:4]
  with pytest.raises(QsyncError, match="needs 64 devices.*xla_force_host_platform_device_count=64"):
    demo.simulated_devices(64)


def test_unknown_config_is_named():
  parser = argparse.ArgumentParser()
  demo.add_arguments(parser)
  args = parser.parse_args(["--configs", "joint,bf16"])
  with pytest.raises(QsyncError, match=r"unknown configuration\(s\) \['bf16'\]"):
    demo.run(args)


def test_demo_is_a_cli_subcommand():
  from qsync_cli.main import build_parser

  args = build_parser().parse_args(["demo", "--out", "x", "--steps", "3"])
  assert args.steps == 3 and args._run is demo.run


def test_stage_train_runs_each_plan_per_seed_and_evaluates():
  from examples.tasks.vision import mlp_digits
  from qsync_jax.policy import PrecisionPolicy

  task = mlp_digits(hidden=(8,))  # the smallest model: this is about the loop (BatchNorm: the next test)
  cluster = demo.demo_cluster(4)
  plans = {
    "fp32": Plan(),
    "uniform int8": Plan(policies={"inference": PrecisionPolicy.uniform("int8_fwd")}),
  }
  seeds = [int(s) for s in np.random.default_rng(104).choice(1000, size=2, replace=False)]
  reported = []
  trained = demo.stage_train(
    task,
    cluster,
    plans,
    jax.devices()[:4],
    2,
    optax.adam(1e-3),
    seeds,
    lambda m: None,
    1,
    on_seed=lambda config, row: reported.append((config, row)),
  )
  assert list(trained) == ["fp32", "uniform int8"]
  # on_seed sees every seed's row, in training order, as it is made.
  assert reported == [(c, r) for c, rows in trained.items() for r in rows]
  for rows in trained.values():
    assert [r["seed"] for r in rows] == seeds
    assert all(np.isfinite(r["train_loss"]) and 0.0 <= r["eval_accuracy"] <= 1.0 for r in rows)
  # Different seeds start from different parameters, so their losses differ.
  assert trained["fp32"][0]["train_loss"] != trained["fp32"][1]["train_loss"]


def test_stage_train_logs_the_loss_and_stops_a_seed_whose_loss_is_not_finite():
  from examples.tasks.vision import vgg_digits

  task = vgg_digits(stages=((4,), (8,)), hidden=8)
  said = []
  # A NaN learning rate makes every parameter NaN after the first update.
  nan_sgd = optax.sgd(float("nan"))
  trained = demo.stage_train(
    task,
    demo.demo_cluster(4),
    {"fp32": Plan()},
    jax.devices()[:4],
    6,
    nan_sgd,
    [3],
    said.append,
    1,
    log_every=1,
  )
  (row,) = trained["fp32"]
  assert row["steps_run"] == 2 and np.isnan(row["train_loss"])
  assert any("step 1, loss" in m for m in said) and any("stopped at step 2" in m for m in said)


def test_cpu_plan_keeps_each_plan_s_shares_at_the_cpu_global_batch():
  pool, cpu = demo.demo_cluster(128), demo.demo_cluster(16)
  for batches, expected in [
    ({"training": 86, "inference": 170}, {"training": 11, "inference": 21}),
    ({"training": 256, "inference": 0}, {"training": 32, "inference": 0}),
    ({}, {"training": 16, "inference": 16}),
  ]:
    scaled = demo.cpu_plan(Plan(batch_per_device=batches), pool, cpu)
    assert scaled.batch_per_device == expected
    assert scaled.apply_to(cpu).global_batch == cpu.global_batch


def test_the_demo_runs_end_to_end(tmp_path, capsys):
  """``qsync demo``, the quickstart's ``python3 dev.py demo`` (3–5 minutes with its defaults),
  through the CLI at a small size (the MLP example, 2 steps of the joint plan): every stage, the
  table, its notes and the files."""
  from qsync_cli.main import main as cli_main

  out = tmp_path / "demo"
  args = ["demo", "--out", str(out), "--model", "mlp", "--steps", "2"]
  args += ["--pretrain-steps", "0", "--indicator-batches", "2", "--pool-batch-per-device", "32"]
  args += ["--batch-per-device", "4", "--configs", "joint"]
  assert cli_main(args) == 0, capsys.readouterr().err
  printed = capsys.readouterr().out
  headers, rows = _columns(printed.split("\n\n")[0].split("\nmodeled: ")[0])
  assert set(demo.CONFIGS) <= set(rows) and rows["joint"]["CPU batch"] != "-"
  assert "step ms (modeled)" in headers and "acc. cost (uniform low = 1)" in headers
  assert demo.MODELED_NOTE in printed and demo.ACCURACY_NOTE in printed and demo.POOLS_NOTE in printed
  pools_text = printed.split("not trained here):\n")[1].split("\n" + demo.POOLS_NOTE)[0]
  headers, pools = _columns(pools_text)
  assert set(pools) == {"2 × V100 + 2 × T4", "1 × A100 + 7 × T4"}
  assert (
    pools["2 × V100 + 2 × T4"]["training at"] == "fp16"
    and pools["1 × A100 + 7 × T4"]["training at"] == "bf16"
  )
  results = json.loads((out / "results.json").read_text())
  assert np.isfinite(results["joint"]["eval_loss"]) and results["joint"]["steps_run"] == 2
  assert Plan.load(str(out / "plan.json")).predictions["alternatives"]
  assert {p.name for p in out.iterdir()} >= {"cluster.json", "indicator.json", "trace.json", "timeline.png"}
