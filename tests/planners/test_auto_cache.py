"""The on-disk key of ``auto_policy``'s results (planners.allocator.auto_cache): the same case
finds its result; a changed model, batch, device, version or budget does not; a damaged file is
measured over."""

import dataclasses
import types

import flax.linen as nn
import jax

from planners.allocator import auto_cache
from planners.profiler import timing
from qsync_jax.policy import PrecisionPolicy
from tests.planners import tiny


class GeluMLP(tiny.MLP):
  """``tiny.MLP`` with GELU for ReLU: the same ops, shapes and parameters."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(self.hidden)(x))
    x = nn.gelu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.classes)(x)


def _fingerprint(task, batch_size=4):
  return auto_cache.model_fingerprint(
    task, PrecisionPolicy.uniform("bf16"), timing.device_batch(task, batch_size)
  )


def test_the_model_fingerprint_changes_with_the_models_structure_and_the_batch_but_not_between_traces():
  task = tiny.mlp()
  first = _fingerprint(task)
  assert first == _fingerprint(tiny.mlp())  # the same model traced again
  assert _fingerprint(dataclasses.replace(task, model=tiny.MLP(hidden=32))) != first  # other shapes
  assert _fingerprint(dataclasses.replace(task, model=GeluMLP())) != first  # same shapes, other ops
  assert _fingerprint(task, batch_size=8) != first


def test_a_result_is_found_under_its_own_key_only(tmp_path, monkeypatch):
  d = str(tmp_path)
  fields = auto_cache.key_fields("abc", 8, "bf16", ("int8", "fp8"), 0.2, {"method": "gradient", "steps": 50})
  assert (
    fields["device_kind"] == jax.devices()[0].device_kind and fields["versions"]["jax"] == jax.__version__
  )
  path = auto_cache.save(d, fields, {"winner": "frontier"})
  assert auto_cache.load(d, fields) == {"winner": "frontier"}
  # each changed field is another key: nothing found
  for change in (
    {"model": "abd"},
    {"batch_per_device": 16},
    {"budget": "speed"},
    {"presets": ["int8"]},
    {"indicator": {"table": "f00"}},
    {"versions": {**fields["versions"], "qsync_jax": "9.9"}},
  ):
    assert auto_cache.load(d, {**fields, **change}) is None, change
  # another device: key_fields reads the local device's kind
  other = types.SimpleNamespace(device_kind="NVIDIA H200", platform="gpu")
  monkeypatch.setattr(auto_cache.jax, "devices", lambda: [other])
  moved = auto_cache.key_fields("abc", 8, "bf16", ("int8", "fp8"), 0.2, {"method": "gradient", "steps": 50})
  assert moved["device_kind"] == "NVIDIA H200" and auto_cache.load(d, moved) is None
  monkeypatch.undo()
  # a damaged file, or one written under other fields at this path, is not a result
  with open(path, "w") as f:
    f.write("{not json")
  assert auto_cache.load(d, fields) is None
  auto_cache.save(d, fields, {"winner": "base"})
  assert auto_cache.load(d, fields) == {"winner": "base"}


def test_the_default_directory_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("QSYNC_CACHE_DIR", str(tmp_path / "q"))
  assert auto_cache.default_dir() == str(tmp_path / "q" / "auto")
  monkeypatch.delenv("QSYNC_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
  assert auto_cache.default_dir() == str(tmp_path / "x" / "qsync-jax" / "auto")
