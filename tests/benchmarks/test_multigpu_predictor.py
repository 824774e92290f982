"""The multi-GPU benchmark's predictor table and its offline replay, on a hand-built profile.

These are the parts of ``benchmarks/multigpu.py`` that run after the GPUs are gone (the device
time that measured the steps cannot be spent again), so they are tested here on the CPU.
"""

import jax
import pytest

from benchmarks import multigpu
from benchmarks.common.link import LinkModel
from benchmarks.diagnosis import multigpu_replay
from tests.benchmarks import result, write_rows
from tests.planners.fakes import fake_profile

ELEMS = 156250  # 625 kB of fp32 weights per op


@pytest.fixture
def profile():
  return fake_profile([(1, 2, 3), (1, 2, 3)], rhs_elems=ELEMS, device_type="H100", remainder_ms=1.0)


def _by_case(rows):
  return {r["case"]: r for r in rows}


def test_predictor_rows_fit_fp32_per_device_count_and_evaluate_the_rest(profile):
  measured = {  # seconds, as multigpu.py keeps them
    ("fp32", 1): 0.030,
    ("bf16", 1): 0.012,
    ("mixed", 1): 0.011,
    ("fp32", 2): 0.040,
    ("bf16", 2): 0.020,
    ("bf16-tree", 2): 0.021,  # the same collectives as the default: never replayed
  }
  links = {2: LinkModel(2, 8.0, 0.0, 0.0)}
  rows = _by_case(
    multigpu.predictor_rows(profile, {"fp32", "bf16", "fp16", "int8"}, links, measured, 8, "test")
  )
  assert not [c for c in rows if "fp32" in c or "tree" in c]  # fp32 is the fit, not a prediction
  for n in (1, 2):
    raw, fit = rows[f"predictor/bf16/n{n}"], rows[f"predictor-fit/bf16/n{n}"]
    assert raw["baseline"] == fit["baseline"] == pytest.approx(1e3 * measured[("bf16", n)])
    # the refit moves every plan by the fp32 step's miss on that device count
    fp32 = multigpu.predict_case(profile, "fp32", n, 8, links.get(n)).step_ms
    assert fit["value"] - raw["value"] == pytest.approx(1e3 * measured[("fp32", n)] - fp32)
  errors = [abs(rows[f"predictor-fit/{c}"]["ratio"] - 1) for c in ("bf16/n1", "mixed/n1", "bf16/n2")]
  assert rows["predictor-fit/all"]["value"] == pytest.approx(sum(errors) / 3)
  # fit1: every device count moves by the one-device fp32 miss; the replay alone adds the rest
  one = 1e3 * measured[("fp32", 1)] - multigpu.predict_case(profile, "fp32", 1, 8).step_ms
  for case in ("bf16/n1", "mixed/n1", "bf16/n2"):
    assert rows[f"predictor-fit1/{case}"]["value"] - rows[f"predictor/{case}"]["value"] == pytest.approx(one)
  assert rows["predictor-fit1/bf16/n2"]["value"] != pytest.approx(rows["predictor-fit/bf16/n2"]["value"])


def test_replay_reads_both_step_sets_of_one_run(tmp_path):
  step, gpus = "step_time_ms_median", "H100 x4"
  path = write_rows(
    tmp_path / "multigpu.jsonl",
    [
      result("r1", "scaling/bf16/n2", step, 5.0, gpus),
      result("r1", "multiprocess/bf16/p2", step, 4.0, gpus),
      result("r1", "scaling/bf16/n2", "weak_scaling_efficiency", 0.8, gpus),
      result("r1", "scaling/bf16/n2", "step_time_ms_pipelined", 3.5, gpus),
      result("r0", "scaling/bf16/n4", step, 9.0, gpus),
    ],
  )
  single, multi, device, _ = multigpu_replay.measured_steps(path, "r1")
  assert single == {("bf16", 2): pytest.approx(0.005)}
  assert multi == {("bf16", 2): pytest.approx(0.004)}
  assert device == "H100 x4"
  pipelined, multi, _, _ = multigpu_replay.measured_steps(path, "r1", "pipelined")
  assert pipelined == {("bf16", 2): pytest.approx(0.0035)} and multi == {}


def test_stepper_feeds_each_step_the_last_state_and_cycles_the_batches():
  seen = []

  def step(state, batch, *key):
    seen.append(len(key))
    return state + batch, None

  run, current = multigpu.stepper(step, 0, [1, 10])
  assert [run() for _ in range(3)] == [1, 11, 12] and current() == 12
  run, _ = multigpu.stepper(step, 0, [1], key=jax.random.key(0))
  run()
  assert seen == [0, 0, 0, 1]  # with a key, each step also gets fold_in(key, i)
