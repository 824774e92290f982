"""The traced models' ``other_bytes`` fitted to XLA:GPU's compiled peak (``benchmarks.diagnosis.traced_memory_gpu``)
and their use in ``benchmarks.hybrid``'s profiles (``benchmarks.common.op_profile.fitted_memory``)."""

import json

import jax
from jax.sharding import SingleDeviceSharding

from benchmarks import hybrid
from benchmarks.common import op_profile, zoo
from benchmarks.diagnosis import traced_memory_gpu
from planners.predictor.memory_model import memory_bytes
from planners.predictor.modeled import modeled_profile
from planners.profile import GroupCost
from planners.profiler.measure import step_memory
from qsync_jax.precision import PRESETS

SHAPES = {"param_bytes": 1000, "opt_state_bytes": 2000, "batch_bytes": 64, "other_bytes": 0}


def _record(batch: int = 2) -> dict:
  task, data, _ = op_profile.build("mlp", tiny=True)
  ops, param_bytes = op_profile.model_ops(task, data)
  return {
    "model": "m",
    "device_type": "cpu",
    "batch_per_device": batch,
    "ops": [o.to_json() for o in ops],
    "param_bytes": param_bytes,
    "memory": dict(SHAPES),
  }


def _write(path, models: dict) -> str:
  path.write_text(json.dumps({"compiled_for": "sm80", "jax_version": "x", "models": models}))
  return str(path)


def test_a_fitted_entry_gives_the_profile_its_other_bytes_and_the_memory_model_counts_them(
  tmp_path, monkeypatch, capsys
):
  path = _write(
    tmp_path / "gpu.json", {"m": {"batch_per_device": 2, "other_bytes": 700, "other_bytes_16bit": 300}}
  )
  monkeypatch.setattr(op_profile, "GPU_MEMORY_FILE", path)
  monkeypatch.setattr(hybrid, "traced_record", lambda name, tiny=False: _record())
  profile = op_profile.base_profile(hybrid.traced("m"))
  assert capsys.readouterr().out == ""
  assert profile.memory == {**SHAPES, "other_bytes": 700, "other_bytes_16bit": 300}
  unfitted = op_profile.base_profile(_record())
  for preset, extra in (("fp32", 700), ("bf16", 300)):
    policies = {o.name: PRESETS[preset] for o in profile.ops}
    fitted_b, zero_b = (memory_bytes(GroupCost("g", p, policies, 2)) for p in (profile, unfitted))
    assert fitted_b - zero_b == extra


def test_a_missing_stale_or_failed_entry_is_said_and_counts_nothing(tmp_path):
  models = {
    "stale": {"batch_per_device": 4, "other_bytes": 1, "other_bytes_16bit": 1},
    "failed": {"batch_per_device": 2, "error": "bf16 step: cuDNN not found."},
  }
  path = _write(tmp_path / "gpu.json", models)
  for model, why in (
    ("absent", "no entry"),
    ("stale", "an entry at batch 4, not 2"),
    ("failed", "bf16 step: cuDNN not found."),
  ):
    said = []
    assert op_profile.fitted_memory(model, SHAPES, 2, said.append, path) == SHAPES
    assert len(said) == 1 and f"{model}: other_bytes not fitted ({path}: {why})" in said[0]
    assert "Fix: run python -m benchmarks.diagnosis.traced_memory_gpu" in said[0]
  said = []
  op_profile.fitted_memory("m", SHAPES, 2, said.append, str(tmp_path / "none.json"))
  assert "no entry" in said[0]


def test_the_committed_file_fits_every_hybrid_model_at_the_zoos_batch_by_the_librarys_fit():
  data = json.load(open(op_profile.GPU_MEMORY_FILE))
  assert data["compiled_for"].startswith(traced_memory_gpu.TARGET_ARCH)
  for name in zoo.HYBRID_MODELS:
    entry = data["models"][name]
    assert "error" not in entry, (name, entry.get("error"))
    assert entry["batch_per_device"] == zoo.MODELS[name].batch
    assert entry["fp32_xla_peak_bytes"] > sum(entry["memory_by_shapes"].values())
  # one model refitted from its recorded peaks: the file holds fit_memory's corrections of the
  # profile modeled for the target's device, which predicts the peaks back at the profiled batch
  entry = data["models"]["bert_s128"]
  record = op_profile.traced_record("bert_s128")
  assert record["memory"] == entry["memory_by_shapes"]
  peaks = entry["fp32_xla_peak_bytes"], entry["bf16_xla_peak_bytes"]
  fitted = traced_memory_gpu.corrections(record, *peaks)
  assert fitted == {k: entry[k] for k in ("other_bytes", "other_bytes_16bit")}
  profile = modeled_profile(
    op_profile.base_profile({**record, "memory": {**record["memory"], **fitted}}), "A100"
  )
  for preset, peak in zip(("fp32", "bf16"), peaks):
    policies = {o.name: PRESETS[preset] for o in profile.ops}
    assert abs(memory_bytes(GroupCost("g", profile, policies, entry["batch_per_device"])) - peak) <= 1
  assert any("cudnn$fmha" in k for k in entry["bf16_kernels"])  # the fused attention a GPU runs


def test_compiled_peak_compiles_the_profilers_step_for_the_shardings_device():
  task, data, _ = op_profile.build("mlp", tiny=True)
  ops, _ = op_profile.model_ops(task, data)
  peak, kernels = traced_memory_gpu.compiled_peak(task, data, "fp32", SingleDeviceSharding(jax.devices()[0]))
  assert peak == step_memory(task, data, ops)[0] and isinstance(kernels, list)
