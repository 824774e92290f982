"""``qsync train --plan auto``: the policy measured on the local device runs every group; a
resumed run reuses it; what it cannot do is refused before any model is built."""

import json
import os

import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy


def _train(out, *extra):
  return cli.main(["train", "--model", "tests.qsync_jax.train.tiny:make_task", "--out", str(out), *extra])


def test_auto_in_a_multi_process_job_is_refused_before_jax_starts(tmp_path, capsys):
  code = _train(
    tmp_path / "run", "--steps", "2", "--plan", "auto", "--coordinator", "localhost:1", "--num-processes", "2"
  )
  err = capsys.readouterr().err
  assert code == 2 and "--plan auto measures one host's device" in err and "Fix" in err
  assert not (tmp_path / "run").exists()


def test_auto_on_a_pool_of_other_device_types_is_refused_with_the_fix(tmp_path, capsys):
  path = tmp_path / "c8.json"
  ClusterSpec((DeviceGroup("a", "A100", 4, 40, 2), DeviceGroup("t", "T4", 4, 16, 1))).save(str(path))
  code = _train(tmp_path / "run", "--steps", "2", "--plan", "auto", "--cluster", str(path))
  err = capsys.readouterr().err
  assert code == 2 and "device types ['A100', 'T4']" in err and "`qsync plan`" in err


@pytest.mark.parametrize(
  "extra, message",
  [
    (
      ("--plan", "auto", "--accuracy-budget", "-1"),
      "--accuracy-budget '-1' is outside [0, 1]. Fix: give a fraction",
    ),
    (
      ("--plan", "auto", "--accuracy-budget", "fast"),
      "--accuracy-budget 'fast' is neither a number nor 'speed'",
    ),
    (("--accuracy-budget", "0.5"), "--accuracy-budget applies to --plan auto alone. Fix"),
  ],
)
def test_a_bad_accuracy_budget_is_refused_before_jax_starts(tmp_path, capsys, extra, message):
  assert _train(tmp_path / "run", "--steps", "2", *extra) == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


@pytest.mark.standard_promotion  # optax's update promotes bf16 with float32
def test_auto_plan_is_measured_written_reused_on_resume_and_loaded_by_the_next_run(
  tmp_path, capsys, monkeypatch
):
  monkeypatch.setenv("QSYNC_CACHE_DIR", str(tmp_path / "cache"))
  out = tmp_path / "run"
  assert _train(out, "--steps", "2", "--plan", "auto") == 0
  err = capsys.readouterr().err
  assert "auto policy on cpu (measured" in err
  assert "accuracy budget 0.2 of the speed-only Ω (Ω: gradient indicator" in err
  plan = Plan.load(str(out / "plan.json"))
  measured = json.loads((out / "auto_policy.json").read_text())
  policy = PrecisionPolicy.from_json(measured["policy"])
  assert measured["measured"] is True and measured["base"] == "bf16"
  assert set(plan.policies) == {"all"} and plan.policy_for("all") == policy
  stamp = os.stat(out / "auto_policy.json").st_mtime_ns
  assert _train(out, "--steps", "3", "--plan", "auto", "--resume") == 0
  err = capsys.readouterr().err
  assert "auto policy on" not in err and f"resuming with {out / 'plan.json'}" in err  # not measured again
  assert os.stat(out / "auto_policy.json").st_mtime_ns == stamp
  assert Plan.load(str(out / "plan.json")) == plan
  # a new run of the same model on the same device loads the search's result from the cache
  assert _train(tmp_path / "next", "--steps", "1", "--plan", "auto") == 0
  err = capsys.readouterr().err
  assert "auto policy loaded from " + str(tmp_path / "cache" / "auto") in err
  assert Plan.load(str(tmp_path / "next" / "plan.json")) == plan
