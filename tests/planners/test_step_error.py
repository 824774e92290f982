"""The multi-device step error the planner prints is the derivation of the committed benchmark rows."""

import json
import pathlib

import pytest

from planners.predictor.step_error import MULTI_DEVICE_STEP_ERROR, StepError, step_error_for, step_error_of

ROWS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results" / "multigpu.jsonl"


def test_the_printed_error_is_the_derivation_of_the_committed_multigpu_rows():
  rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
  assert step_error_of(rows) == MULTI_DEVICE_STEP_ERROR


def test_which_rows_count_and_what_the_band_means():
  def row(case, measured, modeled, groups=(2,), ratio=1.0):
    return {
      "benchmark": "multigpu",
      "case": case,
      "metric": "step_ms",
      "device": "GPU x2",
      "groups": list(groups),
      "value": measured,
      "modeled_step_ms": modeled,
      "modeled_ratio": ratio,
    }

  rows = [
    row("modes/2dev/flat/replicated", 12.0, 6.0),
    row("modes/2dev/flat/sharded", 9.0, 10.0),
    row("modes/1dev/flat/replicated", 30.0, 10.0, groups=(1,)),  # one device: no collectives
    row("modes/2dev/flat/replicated/micro2", 40.0, 10.0),  # modeled as the single pass
    row("modes/2dev/flat/replicated/micro2", 11.0, 10.0, ratio=1.2),  # micro-steps priced
    {**row("predictor/bf16/n2", 50.0, 10.0)},  # another case
  ]
  error = step_error_of(rows)
  assert error == StepError(0.9, 2.0, 3, "2 × GPU")
  assert error.step_range(10.0) == pytest.approx((9.0, 20.0))
  assert error.samples_range(100.0) == pytest.approx((50.0, 100 / 0.9))
  assert error.covers_gain(2.0) and not error.covers_gain(2.3)  # inside while below 2.0 / 0.9
  assert step_error_for(1) is None and step_error_for(2) is MULTI_DEVICE_STEP_ERROR
  with pytest.raises(ValueError, match="no multigpu modes rows"):
    step_error_of(rows[2:4])


class _Limits:
  def line(self) -> str:
    return "limited by g0"


def test_the_summary_shows_the_range_and_says_when_the_gain_is_inside_the_error():
  from planners.allocator.summary import Summary

  def summary(gain):
    return Summary(100.0 * gain, "dynamic batching", 100.0, gain, 400.0, 0.5, _Limits())

  error = MULTI_DEVICE_STEP_ERROR
  lo, hi = error.samples_range(105.0)
  inside = summary(1.05).lines(error)
  assert f"105.0 samples/s ({lo:.1f}–{hi:.1f} at the measured error)" in inside[0]
  assert len(inside) == 4 and "the gain 1.05× is inside the error" in inside[3]
  assert len(summary(3.0).lines(error)) == 3  # a gain beyond the error's spread
  alone = summary(1.05).lines()  # one device: no range, no line
  assert len(alone) == 3 and "at the measured error" not in alone[0]
