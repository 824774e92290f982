"""CLI round trip on a tiny model: profile (measured + modeled) → plan → predict."""

import json

import pytest

from planners.profile import Profile
from qsync_cli.main import main
from qsync_jax.errors import PlanError, QsyncError, QsyncWarning
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from tests.planners.fakes import fake_indicator, fake_profile

MODEL = "tests.planners.tiny:mlp"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli")
  cpu, t4 = str(d / "cpu.json"), str(d / "t4.json")
  assert (
    main(
      [
        "profile",
        "--model",
        MODEL,
        "--batch",
        "16",
        "--precisions",
        "fp32,int8",
        "--repeats",
        "2",
        "--clock",
        "cpu",
        "--out",
        cpu,
      ]
    )
    == 0
  )
  assert main(["profile", "--model", MODEL, "--batch", "16", "--device-type", "T4", "--out", t4]) == 0
  cluster = d / "cluster.json"
  cluster.write_text(
    json.dumps(
      {
        "groups": [
          {"name": "train", "device_type": "A100", "count": 2, "memory_gb": 40, "batch_per_device": 16},
          {"name": "infer", "device_type": "T4", "count": 2, "memory_gb": 16, "batch_per_device": 16},
        ]
      }
    )
  )
  ops = Profile.load(cpu).op_names
  indicator = d / "omega.json"
  indicator.write_text(json.dumps(fake_indicator(ops, [3.0, 1.0, 2.0])))
  return d, cpu, t4, str(cluster), str(indicator)


def test_profile_files(files):
  _, cpu, t4, _, _ = files
  measured, modeled = Profile.load(cpu), Profile.load(t4)
  assert measured.source == "measured" and modeled.source == "modeled"
  assert measured.op_names == ("Dense_0:dense", "Dense_1:dense", "Dense_2:dense")
  assert set(measured.op_ms["Dense_1:dense"]["dlhs"]) == {"fp32", "int8"}
  assert set(measured.op_ms["Dense_1:dense"]) == {"fwd", "dlhs", "drhs", "policy:fp32", "policy:int8"}
  assert all(t > 0 for t in measured.op_ms["Dense_1:dense"]["fwd"].values())
  # no bf16 profiled: the remainder is fitted to the fp32 step; the ops on the step's --clock
  assert measured.meta["jax_version"] and measured.meta["fit_step_ms"] > 0
  assert measured.meta["fit_preset"] == "fp32" and "other_bytes_16bit" not in measured.memory
  assert measured.meta["clock"] == measured.meta["op_clock"] == "cpu"
  assert modeled.meta["derived_from"] == "cpu" and modeled.remainder_ms["fwd"] > 0
  assert set(modeled.op_ms["Dense_1:dense"]["fwd"]) == {"fp32", "fp16", "int8"}  # what a T4 runs


def test_plan_then_predict(files, capsys):
  d, cpu, t4, cluster, indicator = files
  plan_path, trace, png = str(d / "plan.json"), str(d / "trace.json"), str(d / "t.png")
  assert (
    main(
      [
        "plan",
        "--model",
        MODEL,
        "--cluster",
        cluster,
        "--indicator",
        indicator,
        "--profile",
        cpu,
        t4,
        "--out",
        plan_path,
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "chosen:" in out and "replays" in out and "dynamic batching" in out and "(modeled costs for" in out
  # both groups are modeled (the A100 and the T4 have no profile of their own): the plan names the
  # datasheet estimates it relies on, per group
  assert "modeled costs this plan relies on:" in out
  # 4 devices: every modeled step and samples/s with its range at the measured multi-device error
  assert "multi-device step error: measured " in out and "ms (" in out and "at the measured error)" in out
  # the training group's default --train-precision: bf16, as an A100 runs it
  assert "train (A100): bf16 costs are datasheet estimates (the catalog's A100 is never measured)" in out
  assert "infer (T4): " in out and "datasheet estimates" in out
  plan = Plan.load(plan_path)
  assert set(plan.policies) == {"train", "infer"}
  assert plan.policy_for("train") == PrecisionPolicy.uniform("bf16")
  # every candidate once per mode the search ran (flat / sharded optimizer / two-level): keep each
  # name's fastest fitting one, as the best baseline does
  alternatives = {}
  for a in plan.predictions["alternatives"]:
    assert (a["reduction"], a["optimizer_update"]) in {("flat", "replicated"), ("flat", "sharded")}
    kept = alternatives.get(a["name"])
    if kept is None or (a["fits_memory"], a["samples_per_s"]) > (kept["fits_memory"], kept["samples_per_s"]):
      alternatives[a["name"]] = a
  assert {"dynamic batching", "QSync (precision only)", "uniform low precision"} <= set(alternatives)
  assert plan.predictions["chosen"] in alternatives
  assert (plan.reduction, plan.optimizer_update) in {("flat", "replicated"), ("flat", "sharded")}
  best = max(a["samples_per_s"] for a in alternatives.values() if a["fits_memory"])
  assert plan.predictions["samples_per_s"] >= best / 1.02 * (1 - 1e-9)  # the default --slack
  assert sum(plan.batch_per_device.values()) * 2 == 64  # 2 devices a group, the spec's global batch
  # the gain is against the fastest of equal batches, dynamic batching and the training groups alone,
  # and below the bound
  preds = plan.predictions
  names = ("equal batches, training precision", "dynamic batching", "training groups only")
  baselines = [alternatives[n] for n in names if n in alternatives]
  baseline = max((a for a in baselines if a["fits_memory"]), key=lambda a: a["samples_per_s"])
  assert preds["best_baseline"] == {"name": baseline["name"], "samples_per_s": baseline["samples_per_s"]}
  assert preds["gain_vs_best_baseline"] == pytest.approx(preds["samples_per_s"] / baseline["samples_per_s"])
  assert preds["samples_per_s"] <= preds["bound_samples_per_s"] * (1 + 1e-9)
  assert preds["figures"] == "modeled" and preds["limited_by"]["straggler"] in {"train", "infer"}
  summary = [line for line in out.splitlines() if line.startswith("modeled: ")]
  assert len(summary) == 3, out
  assert f"× the best baseline ({baseline['name']}, " in summary[0]
  assert "pool bound" in summary[1] and "limited by: straggler" in summary[2]
  assert (
    main(
      [
        "predict",
        "--model",
        MODEL,
        "--cluster",
        cluster,
        "--plan",
        plan_path,
        "--profile",
        cpu,
        t4,
        "--trace",
        trace,
        "--png",
        png,
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "synchronous step" in out and "modeled (A100)" in out
  assert "at the measured error)" in out and "multi-device step error: measured " in out
  assert json.load(open(trace))["traceEvents"]


def test_plan_int8_op_sets_what_the_int8_level_runs(files):
  """`--int8-op int8` plans the int8 level as int8 on every leg: the uniform int8 alternative's
  predicted step changes (the T4's int8 backward legs replace fp16 ones)."""
  d, cpu, t4, cluster, indicator = files
  steps = {}
  for op in ("int8_fwd", "int8"):
    path = str(d / f"plan_{op}.json")
    args = ["plan", "--model", MODEL, "--cluster", cluster, "--indicator", indicator, "--profile", cpu, t4]
    assert main([*args, "--int8-op", op, "--out", path]) == 0
    alternatives = {a["name"]: a for a in Plan.load(path).predictions["alternatives"]}
    steps[op] = alternatives["uniform low precision"]["step_ms"]
  assert steps["int8"] != steps["int8_fwd"]


def test_bad_inputs_exit_2_with_fix(files, capsys):
  d, cpu, t4, cluster, indicator = files
  assert main(["predict", "--model", MODEL, "--cluster", cluster, "--plan", indicator, "--profile", cpu]) == 2
  assert "Fix:" in capsys.readouterr().err
  small = d / "small.json"
  small.write_text(
    json.dumps(
      {
        "groups": [
          {"name": "train", "device_type": "A100", "count": 1, "memory_gb": 40, "batch_per_device": 16},
          {"name": "infer", "device_type": "T4", "count": 1, "memory_gb": 1e-6, "batch_per_device": 16},
        ]
      }
    )
  )
  assert (
    main(
      [
        "plan",
        "--model",
        MODEL,
        "--cluster",
        str(small),
        "--indicator",
        indicator,
        "--profile",
        cpu,
        "--out",
        str(d / "p.json"),
      ]
    )
    == 2
  )
  err = capsys.readouterr().err
  assert "'infer' (T4) cannot fit even 1 example" in err and "Fix: set memory_gb" in err
  assert main(["profile", "--model", MODEL, "--device-type", "TPU", "--out", str(d / "x.json")]) == 2
  assert "catalog" in capsys.readouterr().err
  (d / "y.json.partial").write_text("{truncated")  # an interrupted profile's checkpoint, damaged
  assert main(["profile", "--model", MODEL, "--precisions", "fp32", "--out", str(d / "y.json")]) == 2
  err = capsys.readouterr().err
  assert "y.json.partial cannot be read" in err and "Fix: delete it" in err and "Traceback" not in err
  assert not (d / "y.json").exists()


def test_train_precision_defaults_to_what_the_training_devices_run(files, capsys):
  """bf16 where the training groups' device type runs bf16, fp16 mixed precision on a V100 (no
  bf16), the first both run for a V100 and an A100; --train-precision overrides, if they run it."""
  from planners.planning import train_precision
  from qsync_jax.cluster import ClusterSpec, DeviceGroup

  def cluster(*types):
    return ClusterSpec(tuple(DeviceGroup(f"g{i}", t, 1, 16, 8) for i, t in enumerate(types)))

  assert train_precision(cluster("A100", "T4"), ("g0",), None) == "bf16"
  assert train_precision(cluster("V100", "T4"), ("g0",), None) == "fp16"
  assert train_precision(cluster("A100", "V100"), ("g0", "g1"), None) == "fp16"
  assert train_precision(cluster("V100"), ("g0",), "fp32") == "fp32"
  with pytest.raises(QsyncError, match=r"'g0' \(V100\) cannot run \['bf16'\].*Fix:"):
    train_precision(cluster("V100"), ("g0",), "bf16")
  with pytest.raises(QsyncError, match="'fp12' is not a policy preset.*Fix:"):
    train_precision(cluster("V100"), ("g0",), "fp12")
  d, cpu, t4, cluster_path, indicator = files
  v100 = d / "v100.json"
  spec = json.loads(open(cluster_path).read())
  spec["groups"][0]["device_type"] = "V100"
  v100.write_text(json.dumps(spec))
  plan_path = d / "plan_v100.json"
  args = ["plan", "--model", MODEL, "--indicator", indicator, "--profile", cpu, t4, "--out", str(plan_path)]
  assert main([*args, "--cluster", str(v100)]) == 0
  assert Plan.load(str(plan_path)).policy_for("train") == PrecisionPolicy.uniform("fp16")
  assert "training group(s) train at fp16" in capsys.readouterr().err
  plan_path.unlink()
  assert main([*args, "--cluster", str(v100), "--train-precision", "fp32"]) == 0
  assert Plan.load(str(plan_path)).policy_for("train") == PrecisionPolicy.uniform("fp32")


def test_plan_refuses_an_indicator_of_another_model_or_with_nan(files, capsys):
  d, cpu, t4, cluster, indicator = files
  table = json.loads(open(indicator).read())
  args = ["plan", "--model", MODEL, "--cluster", cluster, "--profile", cpu, t4, "--out", str(d / "x.json")]
  other = d / "other_model.json"
  other.write_text(json.dumps({**table, "metadata": {"task": "vgg"}}))
  assert main([*args, "--indicator", str(other)]) == 2
  err = capsys.readouterr().err
  assert "was computed on model 'vgg', not on 'mlp' (--model tests.planners.tiny:mlp)" in err
  assert "Fix: run `qsync indicator --model tests.planners.tiny:mlp" in err and err.count("\n") == 1
  same = d / "same_model.json"
  same.write_text(json.dumps({**table, "metadata": {"task": "mlp"}}))
  assert main([*args, "--indicator", str(same)]) == 0
  capsys.readouterr()
  nan = d / "nan.json"
  table["omega"]["Dense_1:dense"]["int8"] = float("nan")
  nan.write_text(json.dumps(table))
  assert main([*args, "--indicator", str(nan)]) == 2
  err = capsys.readouterr().err
  assert "has Ω that are not finite numbers: Dense_1:dense[int8]=nan" in err and "Fix:" in err


def test_help_on_each(capsys):
  for cmd in ("profile", "predict", "plan"):
    with pytest.raises(SystemExit) as e:
      main([cmd, "--help"])
    assert e.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_predict_refuses_what_it_cannot_predict_faithfully(files, capsys):
  d, cpu, t4, cluster, indicator = files
  plan = d / "fp32.json"
  plan.write_text(json.dumps({"policies": {}}))
  predict = ["predict", "--model", MODEL, "--plan", str(plan), "--profile", cpu, t4]
  big = json.loads(open(cluster).read())
  big["groups"][1]["memory_gb"] = 1e-6  # the T4 group cannot hold the fp32 step
  over = d / "over.json"
  over.write_text(json.dumps(big))
  out_json = d / "pred.json"
  assert main([*predict, "--cluster", str(over), "--json", str(out_json)]) == 2
  captured = capsys.readouterr()
  assert "synchronous step" in captured.out  # the table still shows where memory runs out
  assert "does not fit in memory on group(s) ['infer']" in captured.err and "Fix:" in captured.err
  assert json.load(open(out_json))["memory_bytes"]
  big["groups"][1]["memory_gb"], big["groups"][1]["batch_per_device"] = 16, 32
  other_batch = d / "b32.json"
  other_batch.write_text(json.dumps(big))
  assert main([*predict, "--cluster", str(other_batch)]) == 2
  err = capsys.readouterr().err
  assert "measured at batch 16 per device, but group 'infer' runs 32" in err and "--batch 32" in err
  plan.write_text(
    json.dumps({"policies": {"infer": {"rules": [{"path": "renamed_.*", "policy": "int8_fwd"}]}}})
  )
  assert main([*predict, "--cluster", cluster]) == 2
  assert "rule path(s) ['renamed_.*'] match none" in capsys.readouterr().err
  plan.write_text("")
  assert main([*predict, "--cluster", cluster]) == 2
  assert "fp32.json is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
  "command",
  [
    ["indicator", "--model", MODEL],
    ["profile", "--model", MODEL],
    ["plan", "--model", MODEL, "--cluster", "c", "--indicator", "i", "--profile", "p"],
    ["predict", "--model", MODEL, "--cluster", "c", "--plan", "p", "--profile", "p", "--json"],
  ],
)
def test_unusable_output_files_are_refused_before_any_work(tmp_path, capsys, command):
  # the inputs "c", "i", "p" do not exist: an output error proves it was checked first
  for out, needle in [
    (tmp_path, "is a directory, not a file"),
    (tmp_path / "missing" / "x.json", "does not exist"),
    ("/sys/x.json", "not writable"),
  ]:
    flag = [] if command[-1] == "--json" else ["--out"]
    assert main([*command, *flag, str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err and "Traceback" not in err and err.count("\n") == 1


def test_demo_refuses_a_non_empty_directory_before_any_work(tmp_path, capsys, monkeypatch):
  from importlib.metadata import EntryPoint, EntryPoints

  from qsync_cli import main as cli

  found = EntryPoints([EntryPoint("demo", "examples.demo", cli.COMMAND_GROUP)])
  monkeypatch.setattr(cli, "entry_points", lambda group: found if group == cli.COMMAND_GROUP else ())
  (tmp_path / "mine.txt").write_text("keep")
  assert main(["demo", "--out", str(tmp_path), "--model", "no_such_task"]) == 2
  err = capsys.readouterr().err
  assert "is a directory that is not empty" in err and (tmp_path / "mine.txt").read_text() == "keep"


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_in_profile_keeps_the_timings_and_says_how_to_resume(tmp_path, signal_name, status):
  """Ctrl-C, and SIGTERM (what Slurm, Kubernetes and preemptible VMs send) the same way."""
  import signal
  import subprocess
  import sys
  import time

  from tests.qsync_jax.train import procs

  out = tmp_path / "p.json"
  cmd = [sys.executable, "-m", "qsync_cli", "profile", "--model", MODEL, "--batch", "16", "--out", str(out)]
  proc = subprocess.Popen([*cmd, "--repeats", "50"], env=procs.env(), stderr=subprocess.PIPE, text=True)
  partial = tmp_path / "p.json.partial"
  deadline = time.monotonic() + 180
  while not partial.exists():
    assert proc.poll() is None and time.monotonic() < deadline
    time.sleep(0.1)
  proc.send_signal(getattr(signal, signal_name))
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == status and "Traceback" not in err, err
  cause = "terminated (SIGTERM): " if signal_name == "SIGTERM" else ""
  assert err.strip().splitlines()[-1] == (
    f"qsync profile: {cause}interrupted; the timings measured so far are kept in {out}.partial. "
    "Resume with the same command."
  )
  assert partial.exists() and not out.exists()


def test_plan_and_predict_say_where_each_groups_costs_come_from(files, capsys):
  d, cpu, t4, cluster, indicator = files
  plan_path = str(d / "sources_plan.json")
  args = ["--model", MODEL, "--cluster", cluster, "--profile", cpu, t4]
  assert main(["plan", *args, "--indicator", indicator, "--out", plan_path]) == 0
  out = capsys.readouterr().out
  assert "costs per group:" in out
  # no A100 profile: modeled from the measured cpu profile; the T4 file is a modeled one
  assert f"train (A100): modeled from the catalog (based on {cpu})" in out
  assert f"infer (T4): modeled from the catalog: {t4}" in out
  assert "was not used" not in out  # the cpu profile is the A100's base
  assert main(["predict", *args, "--plan", plan_path]) == 0
  out = capsys.readouterr().out
  assert f"train (A100): modeled from the catalog (based on {cpu})" in out
  assert f"infer (T4): modeled from the catalog: {t4}" in out


def test_a_profile_no_group_uses_is_named_with_a_fix(files, capsys):
  d, cpu, t4, cluster, indicator = files
  spec = json.loads(open(cluster).read())
  spec["groups"] = [dict(g, name=f"t4_{i}", device_type="T4") for i, g in enumerate(spec["groups"])]
  t4_only, plan_path = d / "t4_only.json", str(d / "t4_plan.json")
  t4_only.write_text(json.dumps(spec))
  args = ["--model", MODEL, "--cluster", str(t4_only), "--profile", cpu, t4]
  assert main(["plan", *args, "--indicator", indicator, "--out", plan_path]) == 0
  out = capsys.readouterr().out
  unused = f"profile {cpu} (device type cpu) was not used: no group of the cluster is of type cpu. Fix:"
  assert unused in out and f"t4_0 (T4): modeled from the catalog: {t4}" in out
  assert main(["predict", *args, "--plan", plan_path]) == 0
  assert unused in capsys.readouterr().out


def test_a_group_of_the_profiled_type_is_costed_from_the_measurements(files, capsys):
  d, cpu, t4, cluster, indicator = files
  spec = json.loads(open(cluster).read())
  spec["groups"][0].update(name="local", device_type="cpu", memory_gb=8)
  mixed, plan_path = d / "cpu_t4.json", d / "cpu_t4_plan.json"
  mixed.write_text(json.dumps(spec))
  plan_path.write_text(json.dumps({"policies": {"local": "fp32", "infer": "fp32"}}))
  assert (
    main(["predict", "--model", MODEL, "--cluster", str(mixed), "--plan", str(plan_path), "--profile", cpu])
    == 0
  )
  out = capsys.readouterr().out
  assert f"local (cpu): measured: {cpu}" in out
  assert f"infer (T4): modeled from the catalog (based on {cpu})" in out


RUN_GROUPS = [
  {"name": name, "device_type": "cpu", "count": 4, "memory_gb": 16, "batch_per_device": 16}
  for name in ("g0", "g1")
]


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
  """A tiny real `qsync train --replan once` run of two cpu groups of 4 simulated devices, its
  cluster spec, a hand-built cpu profile of its model (a measured one of a model this small,
  noisy on a busy host, can fit a step that shrinks with the batch) and an indicator."""
  d = tmp_path_factory.mktemp("measured")
  (d / "cluster.json").write_text(json.dumps({"groups": RUN_GROUPS}))
  profile = fake_profile([(0.2, 0.2, 0.2)] * 3, batch=16, model="mlp", remainder_ms=0.3, optimizer_ms=0.1)
  profile.save(str(d / "cpu.json"))
  (d / "omega.json").write_text(json.dumps(fake_indicator(profile.op_names, [3.0, 1.0, 2.0])))
  train = ["train", "--model", MODEL, "--cluster", str(d / "cluster.json"), "--replan", "once"]
  assert main([*train, "--steps", "24", "--out", str(d / "run")]) == 0
  assert '"measured_ms"' in (d / "run" / "metrics.jsonl").read_text()  # it measured the groups
  return d


def _plan_measured(d, out, *extra, cluster="cluster.json"):
  args = ["plan", "--model", MODEL, "--cluster", str(d / cluster), "--indicator", str(d / "omega.json")]
  return main([*args, "--train-precision", "fp32", *extra, "--out", str(out)])


def test_plan_from_a_runs_measurements_writes_group_profiles_that_plan_the_same_offline(
  measured_run, tmp_path, capsys
):
  d = measured_run
  run = str(d / "run")
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  first = tmp_path / "a" / "plan.json"
  assert _plan_measured(d, first, "--profile", str(d / "cpu.json"), "--measured", run) == 0
  out = capsys.readouterr().out
  records = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
  measured = [x["replan"]["measured_ms"] for x in records if "measured_ms" in x.get("replan", {})][-1]
  paths = [str(tmp_path / "a" / f"profile-{g}.json") for g in ("g0", "g1")]
  for g, path in zip(("g0", "g1"), paths):
    prof = Profile.load(path)
    cal = prof.meta["calibration"]
    assert (prof.group, prof.source, prof.device_type) == (g, "calibrated", "cpu")
    assert cal["run"] == run and cal["base"]["file"] == str(d / "cpu.json") and cal["scale"] > 0
    assert {str(p["batch"]): p["measured_ms"] for p in cal["points"]} == measured[g]
    assert f"  {g} (cpu): modeled, calibrated to measured: {path} (×" in out
  # every figure of the report is labelled as what it is
  assert "(modeled, calibrated to measured), accuracy cost" in out
  assert len([x for x in out.splitlines() if x.startswith("modeled, calibrated to measured: ")]) == 3
  assert not [x for x in out.splitlines() if x.startswith("modeled: ")]
  assert "alternatives (predicted, modeled, calibrated to measured;" in out
  plan = Plan.load(str(first))
  assert plan.predictions["figures"] == "modeled, calibrated to measured"
  # offline, from the written profiles alone: the same plan
  second = tmp_path / "b" / "plan.json"
  assert _plan_measured(d, second, "--profile", *paths) == 0
  assert [x for x in capsys.readouterr().out.splitlines() if "(cpu): " in x] == [
    x for x in out.splitlines() if "(cpu): " in x
  ]
  again = Plan.load(str(second))
  assert (again.policies, again.batch_per_device, again.micro_steps) == (
    plan.policies,
    plan.batch_per_device,
    plan.micro_steps,
  )
  assert (again.reduction, again.optimizer_update) == (plan.reduction, plan.optimizer_update)
  for key in ("chosen", "step_ms", "samples_per_s", "alternatives", "figures"):
    assert again.predictions[key] == plan.predictions[key], key


def test_plan_from_measurements_gives_the_group_measured_slower_less_batch(measured_run, tmp_path, capsys):
  """The run's latest record, hand-written: g1 (a GPU shared with another job, say) 3× slower."""
  import shutil

  run = tmp_path / "run"
  shutil.copytree(measured_run / "run", run)
  slow = {"g0": {"8": 1.0, "16": 2.0}, "g1": {"8": 3.0, "16": 6.0}}
  with open(run / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 99, "replan": {"step": 99, "measured_ms": slow}}) + "\n")
  out = tmp_path / "plan.json"
  assert (
    _plan_measured(measured_run, out, "--profile", str(measured_run / "cpu.json"), "--measured", str(run))
    == 0
  )
  assert "RMS error" in capsys.readouterr().out
  batches = Plan.load(str(out)).batch_per_device
  assert batches["g0"] > batches["g1"] > 0 and 4 * (batches["g0"] + batches["g1"]) == 128
  scales = {g: Profile.load(str(tmp_path / f"profile-{g}.json")).meta["calibration"]["scale"] for g in slow}
  assert scales["g1"] == pytest.approx(3 * scales["g0"])
  # without the measurements both groups are alike: equal batches
  assert (
    _plan_measured(measured_run, tmp_path / "type.json", "--profile", str(measured_run / "cpu.json")) == 0
  )
  assert Plan.load(str(tmp_path / "type.json")).batch_per_device == {"g0": 16, "g1": 16}


def test_plan_from_measurements_names_what_is_wrong_with_the_run(measured_run, tmp_path, capsys):
  import shutil

  d = measured_run
  empty, no_replan, no_checkpoint, bad = (
    tmp_path / name for name in ("empty", "no_replan", "no_ckpt", "bad")
  )
  empty.mkdir()
  no_replan.mkdir()
  (no_replan / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
  no_checkpoint.mkdir()
  shutil.copy(d / "run" / "metrics.jsonl", no_checkpoint / "metrics.jsonl")
  shutil.copytree(d / "run", bad)
  with open(bad / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 99, "replan": {"measured_ms": {"g0": {"8": -1.0}}}}) + "\n")
  (d / "other.json").write_text(json.dumps({"groups": [RUN_GROUPS[0], dict(RUN_GROUPS[1], name="g2")]}))
  blocked = tmp_path / "blocked"
  (blocked / "profile-g0.json").mkdir(parents=True)
  cases = [
    (tmp_path / "missing", "cluster.json", "is not a directory"),
    (empty, "cluster.json", "has no metrics.jsonl"),
    (no_replan, "cluster.json", "has no measurement of the groups' speeds"),
    (no_checkpoint, "cluster.json", "holds no checkpoint, so the plan it ran"),
    (bad, "cluster.json", "the measured_ms of group 'g0', {'8': -1.0}, is not"),
    (d / "run", "other.json", "ran groups {'g0': 4, 'g1': 4} (name: devices), but --cluster"),
  ]
  profile = ["--profile", str(d / "cpu.json")]
  for run, cluster, needle in cases:
    out = tmp_path / "plan.json"
    assert _plan_measured(d, out, *profile, "--measured", str(run), cluster=cluster) == 2, needle
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err and "Traceback" not in err, err
    assert not out.exists()
  assert _plan_measured(d, blocked / "plan.json", *profile, "--measured", str(d / "run")) == 2
  err = capsys.readouterr().err
  assert "profile-g0.json' is a directory, not a file" in err and "Fix:" in err
  # a group's calibrated profile names a group the cluster has, of its device type
  (tmp_path / "ok").mkdir()
  assert _plan_measured(d, tmp_path / "ok" / "plan.json", *profile, "--measured", str(d / "run")) == 0
  capsys.readouterr()
  g1 = str(tmp_path / "ok" / "profile-g1.json")
  assert _plan_measured(d, tmp_path / "x.json", "--profile", g1, cluster="other.json") == 2
  assert "calibrated for group 'g1', which cluster 'cluster' does not have" in capsys.readouterr().err


def test_plan_measured_skips_metrics_lines_that_are_not_utf8_with_one_warning(tmp_path):
  from planners.calibrate import read_run

  replan = {"step": 3, "replan": {"measured_ms": {"g0": {"8": 2.0}}}}
  (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00\n" + json.dumps(replan).encode() + b"\n\x80\n")
  # the measurements are read past the bad lines: what stops it is the missing checkpoint
  with pytest.warns(QsyncWarning, match=r"metrics.jsonl: line\(s\) 1, 3 are not UTF-8 text.*skipped"):
    with pytest.raises(PlanError, match="holds no checkpoint, so the plan it ran"):
      read_run(str(tmp_path))


# -- qsync plan --train-precision auto ------------------------------------------------------------


@pytest.fixture
def auto_files(tmp_path):
  """A measured cpu profile of MODEL whose Dense_0 and Dense_1 are faster at int8 than at bf16
  and whose Dense_2 is slower there, an indicator, and a cluster training on cpu (inference on a
  T4, modeled from that profile)."""
  import dataclasses

  speed = {"fp32": 1.0, "tf32": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.3, "fp8": 0.4}
  prof = fake_profile([(1.0, 1.0, 1.0)] * 3, batch=16, model="mlp", speed=speed, remainder_ms=0.3)
  slow = {leg: {**t, "int8": 0.6, "fp8": 0.6} for leg, t in prof.op_ms["Dense_2:dense"].items()}
  dataclasses.replace(prof, op_ms={**prof.op_ms, "Dense_2:dense": slow}).save(str(tmp_path / "cpu.json"))
  (tmp_path / "omega.json").write_text(json.dumps(fake_indicator(prof.op_names, [3.0, 1.0, 2.0])))
  groups = [
    {"name": "train", "device_type": "cpu", "count": 2, "memory_gb": 16, "batch_per_device": 16},
    {"name": "infer", "device_type": "T4", "count": 2, "memory_gb": 16, "batch_per_device": 16},
  ]
  (tmp_path / "cluster.json").write_text(json.dumps({"groups": groups}))
  return tmp_path


def _plan_auto(d, *extra, cluster="cluster.json"):
  args = ["plan", "--model", MODEL, "--cluster", str(d / cluster), "--indicator", str(d / "omega.json")]
  args += ["--profile", str(d / "cpu.json"), "--training-groups", "train"]
  return main([*args, *extra, "--out", str(d / "plan.json")])


def test_plan_auto_runs_the_training_groups_8bit_on_exactly_the_ops_measured_to_pay(auto_files, capsys):
  from planners.allocator.greedy import training_group_policy as training_policy

  d = auto_files
  assert _plan_auto(d, "--train-precision", "auto") == 0
  out = capsys.readouterr().out
  policy = Plan.load(str(d / "plan.json")).policy_for("train")
  assert policy == training_policy("bf16", {"Dense_0:dense": "int8", "Dense_1:dense": "int8"})
  assert [policy.lookup_name(f"Dense_{i}:dense").fwd for i in range(3)] == ["int8", "int8", "bf16"]
  alternatives = Plan.load(str(d / "plan.json")).predictions["alternatives"]
  assert alternatives and all(a["precisions"]["train"] == {"int8": 2, "bf16": 1} for a in alternatives)
  assert "bf16×1, int8×2" in out  # the training group's row of the table
  assert "training group train: 2 of 3 ops 8-bit (int8×2: Dense_0:dense, Dense_1:dense), the rest bf16" in out
  assert "where the profile's measured 8-bit time is below its bf16 time, within --train-budget 1" in out
  # the budget: Dense_1 alone spends Ω 1 of the 4 both would (it saves more ms per Ω)
  assert _plan_auto(d, "--train-precision", "auto", "--train-budget", "0.5") == 0
  policy = Plan.load(str(d / "plan.json")).policy_for("train")
  assert policy == training_policy("bf16", {"Dense_1:dense": "int8"})
  assert "training group train: 1 of 3 ops 8-bit" in capsys.readouterr().out


def test_plan_auto_refuses_a_training_group_without_measured_times_and_a_stray_budget(auto_files, capsys):
  d = auto_files
  spec = json.loads((d / "cluster.json").read_text())
  spec["groups"][0]["device_type"] = "A100"  # no A100 profile: modeled from the catalog
  (d / "a100.json").write_text(json.dumps(spec))
  assert _plan_auto(d, "--train-precision", "auto", cluster="a100.json") == 2
  err = capsys.readouterr().err
  assert (
    "--train-precision auto: training group 'train' (A100): the profile of 'mlp' on A100 is modeled" in err
  )
  assert "Fix: profile the model on a A100" in err and not (d / "plan.json").exists()
  assert _plan_auto(d, "--train-budget", "0.5") == 2
  assert "--train-budget applies to --train-precision auto alone. Fix:" in capsys.readouterr().err
  assert _plan_auto(d, "--train-precision", "auto", "--train-budget", "2") == 2
  assert "--train-budget 2.0 is outside [0, 1]. Fix:" in capsys.readouterr().err


# -- the walk through the code of one `qsync plan` -----------------------------------------------

LAYERS = ("qsync_jax", "planners", "qsync_cli")
"""The brief's layers a command's walk crosses, lowest first."""


def plan_walk(argv, entry="qsync_cli.plan:run", depth=2):
  """``(status, walk)`` of ``main(argv)``: the library functions (``LAYERS``, comprehensions
  folded into their function) that ``entry`` calls and that those call (down to ``depth``), each
  once, in the order first entered: what a reader follows from the command into the library."""
  import pathlib
  import sys

  root = pathlib.Path(__file__).resolve().parents[2]
  stack, walk = [], {}

  def module_of(code):
    path = pathlib.Path(code.co_filename).resolve()
    if not path.is_relative_to(root) or path.relative_to(root).parts[0] not in LAYERS:
      return None
    return ".".join(path.relative_to(root).with_suffix("").parts)

  def on_event(frame, event, arg):
    if event == "call":
      module, parent = module_of(frame.f_code), stack[-1] if stack else None
      name = f"{module}:{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"  # 3.11+
      level = 0 if name == entry else (parent + 1 if parent is not None else None)
      stack.append(level)
      if module and level is not None and 1 <= level <= depth and not frame.f_code.co_name.startswith("<"):
        walk.setdefault(name, None)
    elif event == "return" and stack:
      stack.pop()

  sys.setprofile(on_event)
  try:
    status = main(argv)
  finally:
    sys.setprofile(None)
  return status, list(walk)


def climbs(walk):
  """The steps of ``walk`` back up a layer (``LAYERS``): control handed up again after it went down."""
  layer = [LAYERS.index(name.split(".")[0]) for name in walk]
  return [(a, b) for a, b, la, lb in zip(walk, walk[1:], layer, layer[1:]) if lb > la]


def test_the_plan_command_is_a_short_walk_that_rarely_climbs(files, capsys):
  """`qsync plan` parses, calls one planner function, prints: at most 30 stays (functions entered
  within two calls of the command's `run`) and 3 climbs back up a layer."""
  d, cpu, t4, cluster, indicator = files
  argv = ["plan", "--model", MODEL, "--cluster", cluster, "--indicator", indicator, "--profile", cpu, t4]
  status, walk = plan_walk([*argv, "--out", str(d / "walk.json")])
  capsys.readouterr()
  assert status == 0 and "planners.planning:plan_cluster" in walk
  assert len(walk) <= 30 and len(climbs(walk)) <= 3, (walk, climbs(walk))
  # ...and the count sees a climb: a walk that goes into the planner and back into the CLI
  assert climbs(["qsync_cli.plan:x", "planners.planning:y", "qsync_jax.plan:z", "qsync_cli.common:w"]) == [
    ("qsync_jax.plan:z", "qsync_cli.common:w")
  ]


# -- what a plan shows -----------------------------------------------------------------------------


def test_plan_states_and_prints_its_optimizer_update_and_sync(files, capsys):
  d, cpu, t4, cluster, indicator = files
  args = ["plan", "--model", MODEL, "--cluster", cluster, "--indicator", indicator, "--profile", cpu, t4]
  path = d / "bf16_plan.json"
  assert main([*args, "--optimizer-update", "replicated", "--sync", "bf16", "--out", str(path)]) == 0
  out = capsys.readouterr().out
  plan = Plan.load(str(path))
  assert (plan.optimizer_update, plan.sync, plan.reduction) == ("replicated", "bf16", "flat")
  own = [a for a in plan.predictions["alternatives"] if not a.get("reference")]
  assert own and all(a["sync"] == "bf16" and a["optimizer_update"] == "replicated" for a in own)
  # the baselines at the other payloads are references: the gain is against the best of them all
  assert {a["sync"] for a in plan.predictions["alternatives"] if a.get("reference")} >= {
    "fp32",
    "global_qsgd",
  }
  line = next(x for x in out.splitlines() if x.startswith("optimizer update: "))
  assert (
    "replicated (every device updates every parameter" in line and "(--optimizer-update replicated)" in line
  )
  assert (
    "gradient sync: bf16 all-reduce (2 bytes a gradient element, summed in fp32), flat (--sync bf16)" in line
  )
  # the alternatives table: one row per alternative, its mode in a column of its own
  header, _, *rows, wrote = _alternatives(out)
  assert "mode (sync reduction, update)" in header and wrote.startswith("wrote ")
  names = [row.split("  ")[0].strip() for row in rows]
  assert len(names) == len(set(names)) and "dynamic batching" in names
  assert all("bf16 flat, replicated" in row for row in rows if "(reference)" not in row)
  # the search covers both updates by default, each candidate named once in the table
  assert main([*args, "--out", str(d / "auto_plan.json")]) == 0
  out = capsys.readouterr().out
  _, _, *rows, _ = _alternatives(out)
  names = [row.split("  ")[0].strip() for row in rows]
  assert len(names) == len(set(names)), rows
  alternatives = Plan.load(str(d / "auto_plan.json")).predictions["alternatives"]
  json_modes = {(a["optimizer_update"], a["sync"]) for a in alternatives if not a.get("reference")}
  assert json_modes == {("replicated", "fp32"), ("sharded", "fp32")}  # every mode stays in the plan's JSON


def _alternatives(out: str) -> list[str]:
  """The alternatives table's header, rule and rows, and the line after it."""
  return out[out.index("\nalternatives") :].splitlines()[2:]


def test_plan_refuses_a_sharded_update_with_a_sync_it_cannot_run_before_any_work(files, capsys):
  d, cpu, t4, cluster, indicator = files
  args = [
    "plan",
    "--model",
    "no_such_model",
    "--cluster",
    cluster,
    "--indicator",
    indicator,
    "--profile",
    cpu,
  ]
  out = d / "sharded_qsgd.json"
  assert main([*args, "--optimizer-update", "sharded", "--sync", "global_qsgd", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "--optimizer-update sharded with --sync global_qsgd" in err and "Fix: pass --optimizer-update" in err
  assert not out.exists()


def test_plan_and_predict_name_the_same_limiting_group(files, capsys):
  d, cpu, t4, cluster, indicator = files
  path = str(d / "limit_plan.json")
  common = ["--model", MODEL, "--cluster", cluster, "--profile", cpu, t4]
  assert main(["plan", *common, "--indicator", indicator, "--out", path]) == 0
  planned = [x for x in capsys.readouterr().out.splitlines() if "limited by: straggler" in x]
  assert main(["predict", *common, "--plan", path]) == 0
  predicted = [x for x in capsys.readouterr().out.splitlines() if "limited by: straggler" in x]
  assert len(planned) == len(predicted) == 1
  assert planned[0].split("limited by: ")[1] == predicted[0].split("limited by: ")[1]
  assert Plan.load(path).predictions["limited_by"]["straggler"] in predicted[0]


def test_plan_says_why_no_op_went_8bit(files, auto_files, capsys):
  d, cpu, t4, cluster, indicator = files
  args = ["plan", "--model", MODEL, "--cluster", cluster, "--indicator", indicator, "--profile", cpu, t4]
  assert main([*args, "--out", str(d / "why.json")]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("no op runs 8-bit: ") and lines[1].startswith("group ")  # before the table
  assert "train (A100) is a training group at bf16 (--train-precision auto runs 8 bits" in lines[0]
  # the T4's modeled int8 legs (quantization included) cost more than its fp16 ones
  assert "infer (T4, modeled costs): its 3 ops take " in lines[0] and "costs more than" in lines[0]
  # where an op runs 8-bit (the training group's, measured to pay) nothing is said
  assert _plan_auto(auto_files, "--train-precision", "auto") == 0
  assert "no op runs 8-bit" not in capsys.readouterr().out


def test_plan_refuses_an_out_that_is_one_of_its_inputs_and_keeps_the_input(files, tmp_path, capsys):
  d, cpu, t4, cluster, indicator = files
  args = ["plan", "--model", MODEL, "--cluster", cluster, "--indicator", indicator, "--profile", cpu, t4]
  for flag, path in (("--cluster", cluster), ("--indicator", indicator), ("--profile", t4)):
    before = open(path).read()
    assert main([*args, "--out", path]) == 2
    err = capsys.readouterr().err
    assert f"--out {path!r} is the {flag} file" in err and "Fix: write the output to another path" in err
    assert open(path).read() == before
  link = tmp_path / "link.json"
  link.symlink_to(cluster)  # another name of the same file is that file
  assert main([*args, "--out", str(link)]) == 2
  assert "is the --cluster file" in capsys.readouterr().err


def test_predict_refuses_a_plan_that_changes_the_global_batch(files, capsys):
  d, cpu, t4, cluster, indicator = files
  plan = d / "short.json"
  plan.write_text(json.dumps({"policies": {}, "batch_per_device": {"train": 16, "infer": 8}}))
  assert main(["predict", "--model", MODEL, "--cluster", cluster, "--plan", str(plan), "--profile", cpu]) == 2
  err = capsys.readouterr().err
  assert "add up to a global batch of 48" in err and "trains on 64 examples a step" in err and "Fix:" in err
