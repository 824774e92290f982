"""An interrupted profile resumes from its checkpoint; a foreign or broken checkpoint is refused."""

import json

import pytest

from planners.profiler import measure
from planners.profiler.partial_profile import load_partial
from qsync_jax.errors import CheckpointError
from tests.planners import tiny

OPTIONS = dict(precisions=("fp32", "bf16"), repeats=2, step_repeats=2, clock="cpu")


class Stop(Exception):
  pass


def stop_at(message_start: str):
  def progress(msg):
    if msg.startswith(message_start):
      raise Stop(msg)

  return progress


def counting_measure_leg(monkeypatch):
  calls = []
  real = measure.measure_leg

  def measure_leg(*args, **kwargs):
    calls.append(args[2:6])  # (batch, m, k, n) of the op timed
    return real(*args, **kwargs)

  monkeypatch.setattr(measure, "measure_leg", measure_leg)
  return calls


@pytest.mark.standard_promotion  # optax's Adam in the profiled fp32 step
def test_an_interrupted_profile_resumes_with_the_ops_already_timed(tmp_path, monkeypatch):
  path = str(tmp_path / "mlp.partial.json")
  task = tiny.mlp()
  with pytest.raises(Stop):  # interrupted as the third op starts: two ops are in the checkpoint
    measure.measure_profile(task, 16, progress=stop_at("[3/3]"), checkpoint=path, **OPTIONS)
  with open(path) as f:
    saved = json.load(f)
  assert list(saved["op_ms"]) == ["Dense_0:dense", "Dense_1:dense"]

  calls = counting_measure_leg(monkeypatch)
  messages = []
  prof = measure.measure_profile(task, 16, progress=messages.append, checkpoint=path, **OPTIONS)
  assert any("2 of 3 ops already timed" in m for m in messages)
  assert prof.op_names == ("Dense_0:dense", "Dense_1:dense", "Dense_2:dense")
  for name in ("Dense_0:dense", "Dense_1:dense"):
    assert prof.op_ms[name] == saved["op_ms"][name]  # read back, not re-timed
  last = prof.ops[2]
  assert calls and set(calls) == {(last.batch, last.m, last.k, last.n)}  # only the third op was timed
  assert not any(m.startswith(("[1/3]", "[2/3]")) for m in messages)
  assert not (tmp_path / "mlp.partial.json").exists()  # removed once the profile is complete


@pytest.mark.standard_promotion
def test_a_profile_interrupted_in_its_step_fits_keeps_its_op_timings(tmp_path):
  # the fit step comes after the ops; a run killed there (a device call's time limit) must not
  # lose the ops, the longest part: the checkpoint goes only once the profile is complete
  path = str(tmp_path / "mlp.partial.json")
  with pytest.raises(Stop):
    measure.measure_profile(tiny.mlp(), 16, progress=stop_at("fit step"), checkpoint=path, **OPTIONS)
  with open(path) as f:
    assert list(json.load(f)["op_ms"]) == ["Dense_0:dense", "Dense_1:dense", "Dense_2:dense"]


def test_a_checkpoint_of_other_settings_is_refused_with_what_differs(tmp_path):
  path = tmp_path / "p.json"
  settings = {"model": "mlp", "repeats": 10, "ops": ["a"]}
  path.write_text(
    json.dumps({"format": "qsync-profile-partial/1", "settings": settings, "op_ms": {}, "unrunnable": []})
  )
  assert load_partial(str(path), settings) == ({}, [])
  with pytest.raises(CheckpointError, match=r"repeats: saved 10, now 5.*Fix: rerun with the saved settings"):
    load_partial(str(path), {**settings, "repeats": 5})


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "qsync-profile/1"}), "[]"])
def test_a_broken_checkpoint_is_refused_naming_the_file_and_the_fix(tmp_path, content):
  path = tmp_path / "p.json"
  path.write_text(content)
  with pytest.raises(CheckpointError, match=rf"{path} cannot be read.*Fix: delete it"):
    load_partial(str(path), {"model": "mlp"})
  assert load_partial(str(tmp_path / "absent.json"), {"model": "mlp"}) == ({}, [])
