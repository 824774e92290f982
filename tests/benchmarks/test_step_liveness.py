"""``benchmarks/diagnosis/step_liveness.py``: where a compiled step's live temporaries peak, on the CPU."""

import gzip

import pytest

from benchmarks.common import zoo
from benchmarks.diagnosis import step_liveness
from planners.profiler.measure import task_ops


@pytest.mark.standard_promotion  # optax's Adam in the compiled step
def test_the_script_compiles_saves_and_rereads_the_steps_with_the_same_peak(tmp_path, capsys):
  assert step_liveness.main(["--model", "mlp", "--plans", "fp32", "int8", "--save-hlo", str(tmp_path)]) == 0
  compiled = capsys.readouterr().out
  saved = sorted(tmp_path.iterdir())
  assert [p.name for p in saved] == ["mlp_fp32.hlo.gz", "mlp_int8.hlo.gz"]
  assert step_liveness.main(["--model", "mlp", "--hlo", *map(str, saved)]) == 0
  reread = capsys.readouterr().out
  # the same live peak from the module compiled here and from its saved text
  for plan, name in (("fp32", "mlp_fp32.hlo.gz"), ("int8", "mlp_int8.hlo.gz")):
    live_line = next(line for line in compiled.splitlines() if line.startswith(f"== mlp {plan}:"))
    reread_line = next(line for line in reread.splitlines() if line.startswith(f"== mlp {name}:"))
    assert live_line.split(";")[0].split(":")[1] == reread_line.split(";")[0].split(":")[1]
  assert "XLA" in compiled and "liveness" in compiled  # XLA's own peak beside, where compiled


@pytest.mark.standard_promotion
def test_the_report_charges_every_op_and_its_largest_buffers_fit_in_the_peak(tmp_path):
  step_liveness.main(["--model", "mlp", "--plans", "int8", "--save-hlo", str(tmp_path)])
  task, batch = zoo.get("mlp")
  ops = task_ops(task, batch)[2]
  report = step_liveness.liveness_report(gzip.open(tmp_path / "mlp_int8.hlo.gz", "rt").read(), ops, top=3)
  assert report["peak"] > 0 and len(report["largest"]) == 3
  assert sum(size for size, *_ in report["largest"]) <= report["peak"]
  assert set(report["per_op"]) == {op.name for op in ops}
  assert all(legs["fwd"] > 0 and legs["bwd"] > 0 for legs in report["per_op"].values())
