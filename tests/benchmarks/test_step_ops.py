"""``benchmarks/diagnosis/step_ops.py``: charging a traced step's instructions to ops, and the script end to
end on the CPU (XLA:CPU's per-instruction events stand for the GPU's kernels)."""

import json

import pytest

from benchmarks.diagnosis import step_ops
from planners.ops import OpShape
from tests.planners.test_step_hlo import HLO


def test_the_table_names_ops_short_and_keeps_the_legs_with_time():
  ops = [OpShape("block0/mlp_out:dense", "dense", 1, 4, 8, 3)]
  got = step_ops.flat_per_op_ms(HLO, {"relayout": 2.0, "plain": 1.0, "dot.1": 3.0, "unnamed": 0.5}, ops)
  assert got == {"block0/mlp_out|bwd": 3.0, "rest|fwd": 3.5}


def test_ops_that_share_a_module_path_keep_their_full_names_in_the_tables():
  ops = [
    OpShape("block0/attn:attention_qk", "attention_qk", 1, 4, 8, 3),
    OpShape("block0/attn:attention_pv", "attention_pv", 1, 4, 8, 3),
    OpShape("block0/mlp_out:dense", "dense", 1, 4, 8, 3),
  ]
  assert step_ops.table_names(ops) == {
    "block0/attn:attention_qk": "block0/attn:attention_qk",
    "block0/attn:attention_pv": "block0/attn:attention_pv",
    "block0/mlp_out:dense": "block0/mlp_out",
  }


@pytest.mark.standard_promotion  # optax's Adam in the traced step
def test_the_script_writes_every_plans_per_op_times(tmp_path, capsys):
  out = tmp_path / "per_op.json"
  assert (
    step_ops.main(["--model", "mlp", "--plans", "fp32", "int8", "--repeats", "2", "--out", str(out)]) == 0
  )
  result = json.loads(out.read_text())
  assert set(result) == {"fp32", "int8"}
  for plan, table in result.items():
    parts = sum(ms for key, ms in table.items() if key != "total")
    assert table["total"] > 0 and parts == pytest.approx(table["total"]), plan
    assert table.get("Dense_1|fwd", 0) > 0 and table.get("Dense_1|bwd", 0) > 0, plan
  assert "Dense_1" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="unknown plans"):
    step_ops.main(["--model", "mlp", "--plans", "int4", "--out", str(out)])
