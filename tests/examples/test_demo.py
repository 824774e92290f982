"""The demo's planning, table and outputs on hand-built profiles (no measuring, no training)."""

import argparse
import json

import jax
import numpy as np
import pytest

from examples import demo
from planners.replay import Prediction
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


def test_stage_plan_gives_four_configurations_and_qsync_keeps_pace():
  cluster, profiles, indicator, planned = _planned(np.random.default_rng())
  assert list(planned) == ["fp32", "uniform int8", "dynamic batch", "qsync"]
  preds = {name: pred for name, (_, pred) in planned.items()}
  assert all(isinstance(p, Prediction) for p in preds.values())
  # fp32: the T4 group straggles; uniform int8 speeds it up; QSync is no slower than the V100 group's pace.
  assert preds["fp32"].group_step_ms["inference"] > preds["fp32"].group_step_ms["training"]
  assert preds["uniform int8"].group_step_ms["inference"] < preds["fp32"].group_step_ms["inference"]
  assert preds["qsync"].step_ms <= preds["fp32"].step_ms
  # Dynamic batch sizing moves examples from the T4s to the V100s and keeps the global batch.
  dbs = planned["dynamic batch"][0].apply_to(cluster)
  assert dbs.global_batch == cluster.global_batch
  assert dbs.group("inference").batch_per_device < dbs.group("training").batch_per_device
  # The QSync plan keeps some op above int8 on the T4s (it recovers sensitive ops) unless none fits.
  mix = demo.precision_mix(planned["qsync"][0], "inference", profiles["T4"].op_names)
  assert "int8" in demo.precision_mix(planned["uniform int8"][0], "inference", profiles["T4"].op_names)
  assert mix and sum(int(part.split("×")[1]) for part in mix.split(", ")) == N_OPS


def test_results_table_and_outputs(tmp_path):
  cluster, profiles, indicator, planned = _planned(np.random.default_rng())
  trained = {name: {"train_loss": 0.5, "eval_loss": 0.6, "eval_accuracy": 0.9} for name in planned}
  text = demo.results_table(cluster, planned, trained, profiles["T4"].op_names)
  lines = text.splitlines()
  assert "sync step ms" in lines[0] and "fits" in lines[0] and len(lines) == 2 + 4
  assert lines[2].startswith("fp32") and lines[5].startswith("qsync")
  demo.write_outputs(str(tmp_path), cluster, indicator, profiles, planned, trained, lambda m: None)
  plan = Plan.load(str(tmp_path / "plan.json"))
  assert plan.policies["inference"].rules  # the per-op rules of the allocator
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e.get("ph") == "X" for e in trace["traceEvents"])
  for png in ("timeline.png", "sensitivity.png"):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  results = json.loads((tmp_path / "results.json").read_text())
  assert set(results) == set(planned) and results["qsync"]["eval_accuracy"] == 0.9
  assert {p.name for p in (tmp_path / "plans").iterdir()} == {
    "fp32.json",
    "uniform_int8.json",
    "dynamic_batch.json",
    "qsync.json",
  }


def test_simulated_devices_uses_the_first_four():
  devices = demo.simulated_devices(4)
  assert list(devices) == jax.devices()[:4]
  with pytest.raises(QsyncError, match="needs 64 devices.*xla_force_host_platform_device_count=64"):
    demo.simulated_devices(64)


def test_unknown_config_is_named():
  parser = argparse.ArgumentParser()
  demo.add_arguments(parser)
  args = parser.parse_args(["--configs", "fp32,bf16"])
  with pytest.raises(QsyncError, match=r"unknown configuration\(s\) \['bf16'\]"):
    demo.run(args)


def test_demo_is_a_cli_subcommand():
  from qsync_jax.cli import build_parser

  args = build_parser().parse_args(["demo", "--out", "x", "--steps", "3"])
  assert args.steps == 3 and args._run is demo.run


def test_scaled_t4_memory_excludes_fp32_but_admits_a_plan():
  rng = np.random.default_rng()
  profiles, ops = _profiles(rng)
  indicator = fake_indicator(ops, rng.uniform(0.1, 1.0, size=N_OPS))
  position = float(rng.uniform(0.2, 0.8))
  cluster, least, fp32 = demo.scale_inference_memory(demo.demo_cluster(8), profiles, position)
  assert least < fp32
  assert cluster.group("inference").memory_gb * 1e9 == pytest.approx(least + position * (fp32 - least))
  assert cluster.group("training").memory_gb == 32.0
  planned = demo.stage_plan(cluster, profiles, indicator, lambda m: None)
  assert not planned["fp32"][1].fits
  assert planned["qsync"][1].fits
  assert planned["dynamic batch"][0].batch_per_device  # a real batch split


def test_stage_train_runs_each_plan_per_seed_and_evaluates():
  from examples.tasks.vision import vgg_digits
  from qsync_jax.policy import PrecisionPolicy

  task = vgg_digits(stages=((4,), (8,)), hidden=8)
  cluster = demo.demo_cluster(4)
  plans = {
    "fp32": Plan(),
    "uniform int8": Plan(policies={"inference": PrecisionPolicy.uniform("int8_fwd")}),
  }
  seeds = [int(s) for s in np.random.default_rng().choice(1000, size=2, replace=False)]
  trained = demo.stage_train(task, cluster, plans, jax.devices()[:4], 2, 1e-3, seeds, lambda m: None, 1)
  assert list(trained) == ["fp32", "uniform int8"]
  for rows in trained.values():
    assert [r["seed"] for r in rows] == seeds
    assert all(np.isfinite(r["train_loss"]) and 0.0 <= r["eval_accuracy"] <= 1.0 for r in rows)
  # Different seeds start from different parameters, so their losses differ.
  assert trained["fp32"][0]["train_loss"] != trained["fp32"][1]["train_loss"]
