"""benchmarks/e2e.py at tiny sizes on the CPU: the rows it writes and the table it prints."""

import json

import pytest

from benchmarks import e2e
from benchmarks.common import e2e_inspect, zoo
from qsync_jax import OpPolicy, PrecisionPolicy, Rule

pytestmark = pytest.mark.standard_promotion  # optax's AdamW and Flax's bf16 LayerNorm


def rows_of(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_tiny_gpt_cells_write_their_rows(tmp_path, capsys):
  out = tmp_path / "e2e.jsonl"
  e2e.main(
    ["--tiny", "--plan", "gpt:32:plain+int8_dense", "--steps", "4", "--categories", "--out-jsonl", str(out)]
  )
  rows = rows_of(out)
  assert {r["benchmark"] for r in rows} == {"e2e"}
  assert len({r["run"] for r in rows}) == 1
  by = {(r["case"], r["metric"]): r for r in rows}
  for policy in ("plain", "int8_dense"):
    case = f"gpt/d32/{policy}"
    step, comp, program, peak = (by[(case, m)] for m in ("step_ms", "compile_s", "program", "peak_bytes"))
    assert step["value"] > 0 and step["step_ms_min"] <= step["value"] <= step["step_ms_max"]
    stages = [comp[k] for k in ("trace_s", "lower_s", "compile_s", "first_call_s")]
    assert all(s > 0 for s in stages) and comp["value"] == pytest.approx(sum(stages))
    assert program["value"] > 0 and peak["value"] > 0
    assert step["device"] and step["jax_version"] and step["policy"] == policy
  plain, int8 = by[("gpt/d32/plain", "step_ms")], by[("gpt/d32/int8_dense", "step_ms")]
  # ratios against plain bf16 of the same run
  assert int8["baseline"] == plain["value"]
  assert int8["speed"] == pytest.approx(plain["value"] / int8["value"])
  assert by[("gpt/d32/int8_dense", "compile_s")]["baseline"] == by[("gpt/d32/plain", "compile_s")]["value"]
  # the quantized Dense products run on 8-bit operands; the plain model has none
  assert by[("gpt/d32/int8_dense", "program")]["dot_generals_8bit"] > 0
  assert by[("gpt/d32/plain", "program")]["dot_generals_8bit"] == 0
  assert set(int8["categories"]) == set(e2e_inspect.STEP_CATEGORIES) and int8["ceiling_ms"] <= int8["value"]
  out = capsys.readouterr().out
  table = out.split("cell", 1)[-1]
  assert "gpt/d32/plain" in table and "gpt/d32/int8_dense" in table and "kernel ms by category" in out


def test_auto_cell_measures_its_policy_and_compares_with_the_cudnn_attention_baseline(tmp_path, monkeypatch):
  """The auto cell runs the policy ``auto_policy`` returns (here a stand-in quantizing the head:
  the real search is tested in tests/planners/test_payoff.py) and records what it measured."""
  from planners.allocator.payoff import AutoPolicy, OpPayoff

  def fake_auto_policy(task, batch, progress=None):
    policy = PrecisionPolicy(rules=(Rule("head", OpPolicy.preset("int8")),), default=OpPolicy.preset("bf16"))
    payoffs = (OpPayoff("head:dense", 2.0, {"int8": 1.0}),)
    chosen = {"head:dense": "int8"}
    return AutoPolicy(
      policy,
      chosen,
      "bf16",
      "cpu",
      batch,
      payoffs,
      {"base": {}, "paying": chosen},
      {"base": 2.0, "paying": 1.5},
      {"base": [2.0], "paying": [1.5]},
      "paying",
      "wall",
    )

  monkeypatch.setattr(e2e, "auto_policy", fake_auto_policy)
  out = tmp_path / "e2e.jsonl"
  e2e.main(["--tiny", "--plan", "gpt:32:plain_cudnn_attn+auto", "--steps", "3", "--out-jsonl", str(out)])
  by = {(r["case"], r["metric"]): r for r in rows_of(out)}
  base, auto = by[("gpt/d32/plain_cudnn_attn", "step_ms")], by[("gpt/d32/auto", "step_ms")]
  assert auto["baseline_case"] == "gpt/d32/plain_cudnn_attn" and auto["baseline"] == base["value"]
  assert base["baseline_case"] == "gpt/d32/plain"  # the baseline itself: against plain (not in this run)
  found = auto["auto"]
  assert found["winner"] == "paying" and found["chosen"] == {"head:dense": "int8"} and found["measure_s"] >= 0
  assert by[("gpt/d32/auto", "program")]["dot_generals_8bit"] > 0  # the stand-in's int8 head ran
  # the baseline's attention is jax.nn.dot_product_attention (float32 logits): fused, not einsums
  assert by[("gpt/d32/plain_cudnn_attn", "program")]["dot_generals_8bit"] == 0


def test_budget_skips_units_with_a_row_saying_so(tmp_path, monkeypatch):
  out = tmp_path / "e2e.jsonl"
  monkeypatch.setattr(e2e, "estimate_s", lambda unit, done, backend: 10.0)
  e2e.main(["--tiny", "--plan", "gpt:32:plain,conv", "--budget-s", "5", "--out-jsonl", str(out)])
  rows = rows_of(out)
  assert [r["metric"] for r in rows] == ["skipped", "skipped"]
  assert all("budget" in r["reason"] for r in rows)


def test_unknown_plan_unit_and_policy_are_clear_errors(tmp_path):
  with pytest.raises(SystemExit, match="unknown unit 'gtp'"):
    e2e.main(["--tiny", "--plan", "gtp", "--out-jsonl", str(tmp_path / "x.jsonl")])
  with pytest.raises(SystemExit, match="unknown policy 'int4'"):
    e2e.main(["--tiny", "--plan", "gpt:32:int4", "--out-jsonl", str(tmp_path / "x.jsonl")])
  (tmp_path / "a_file").write_text("")
  with pytest.raises(SystemExit, match="cannot be written"):
    e2e.main(["--tiny", "--plan", "gpt:32:plain", "--out-jsonl", str(tmp_path / "a_file" / "x.jsonl")])


def test_micro_benchmarks_report_every_case(tmp_path):
  out = tmp_path / "e2e.jsonl"
  e2e.main(["--tiny", "--plan", "attention:16", "--steps", "2", "--out-jsonl", str(out)])
  rows = {r["case"].rsplit("/", 1)[1]: r for r in rows_of(out)}
  assert set(rows) == {"bf16_einsum", "int8", "int8_fwd", "fp8", "xla_mask", "xla_causal"}
  for name, r in rows.items():
    assert r["value"] > 0, (name, r.get("error"))
    assert r["baseline"] == rows["bf16_einsum"]["value"]
    # every attention computes the same gradients up to its precision's rounding
    assert r["rel_err"] < (0.1 if name == "fp8" else 0.03)


def test_steps_lower_for_cuda_without_a_gpu(capsys):
  """e2e_inspect.lower_for_cuda: the int8 step lowered for CUDA holds Triton custom calls, one
  body per distinct kernel, and per quantized op only Flax's key fold-in (the op's legs' keys
  and stochastic rounding's seeds draw nothing); the plain step none of them."""
  from benchmarks.common import e2e_inspect

  task, batch = zoo.e2e_gpt(32, tiny=True)
  plain = e2e_inspect.lower_for_cuda(task, batch, e2e.POLICIES["plain"], e2e.optimizer())
  int8 = e2e_inspect.lower_for_cuda(task, batch, e2e.POLICIES["int8_dense"], e2e.optimizer())
  assert plain["distinct_custom_call_bodies"] == {} and plain.get("pallas_calls", 0) == 0
  triton = int8["distinct_custom_call_bodies"]["__gpu$xla.gpu.triton"]
  assert 0 < int8["distinct_pallas_kernels"] <= triton <= int8["custom_calls"]["__gpu$xla.gpu.triton"]
  assert sum(int8["kernels"].values()) == int8["pallas_calls"]
  dense_ops = 2 * 6 + 1  # per block: query, key, value, out, MLP up and down; 2 blocks; the head
  assert int8["threefry_calls"] == plain["threefry_calls"] + dense_ops
  assert e2e.main(["--tiny", "--plan", "gpt:32:int8_dense", "--lower-for-cuda"]) == 0
  out = capsys.readouterr().out
  assert "gpt/d32/int8_dense" in out and "quantize_tiled_int8_both" in out


def test_tiny_llama_cell_carries_kernel_categories_and_the_ceiling(tmp_path, capsys):
  """The Llama-style family runs the same cells; ``--categories`` adds each step's kernel time
  by category (none on a CPU: its trace holds no GPU kernel, so the ceiling is the step)."""
  out = tmp_path / "e2e.jsonl"
  e2e.main(
    ["--tiny", "--plan", "llama:32:int8_dense", "--steps", "2", "--categories", "--out-jsonl", str(out)]
  )
  by = {(r["case"], r["metric"]): r for r in rows_of(out)}
  step = by[("llama/d32/int8_dense", "step_ms")]
  assert step["baseline_case"] == "llama/d32/plain" and step["model"] == "llama"
  assert set(step["categories"]) == set(e2e_inspect.STEP_CATEGORIES)
  overhead = sum(step["categories"][c]["ms"] for c in ("quantize", "cast_transpose"))
  assert step["ceiling_ms"] == step["value"] - overhead
  assert by[("llama/d32/int8_dense", "program")]["dot_generals_8bit"] > 0
  assert "llama/d32/int8_dense" in capsys.readouterr().out


@pytest.mark.parametrize(
  "name, stack, want",
  [
    ("anonymous_mosaic_gpu_kernel", "", "gemm"),
    ("nvjet_sm90_hss_192x96_64x5_1x2_h_bz_NTT", "jit(step)/transpose(jvp(M))/head/dot_general", "gemm"),
    ("quantize_pair_int8__1", "", "quantize"),
    ("input_reduce_fusion_3", "jit(step)/jvp(M)/block0/mlp_in/quantize_absmax/reduce_max", "quantize"),
    ("input_reduce_fusion_4", "jit(step)/transpose(jvp(M))/mlp_in/jit(pair_scales)/reduce_max", "quantize"),
    ("wrapped_transpose_2", "jit(step)/jvp(M)/mlp_in/jit(quantize_tiled)/pallas_call", "cast_transpose"),
    ("loop_convert_fusion_7", "jit(step)/jvp(M)/block0/ln2/convert_element_type", "cast_transpose"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "", "attention"),
    ("loop_add_fusion_13", "jit(step)/add", "optimizer"),
    ("input_add_reduce_fusion_10", "jit(step)/jvp(M)/block0/ln2/reduce_sum", "norm_elementwise"),
  ],
)
def test_step_kernels_fall_in_the_first_matching_category(name, stack, want):
  assert e2e_inspect.step_category(name, stack) == want
