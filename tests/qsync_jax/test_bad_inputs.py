"""Bad input through the Python API: a named error with the fix, before any work."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from qsync_jax import quantize
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import device_type_of
from qsync_jax.errors import ClusterSpecError, OutputPathError, PlanError, PolicyError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.train.distributed import check_device_types
from qsync_jax.train.outputs import check_dir, check_file, check_run_dir

READ_ONLY_DIR = "/sys"  # no file can be created there, not even by root


def test_op_policy_without_every_leg_is_refused_like_the_json():
  with pytest.raises(PolicyError, match=r"missing leg\(s\) \['drhs'\].*Fix"):
    OpPolicy(fwd="int8", dlhs="int8")
  with pytest.raises(PolicyError, match=r"missing leg\(s\) \['drhs'\]"):
    OpPolicy.from_json({"fwd": "int8", "dlhs": "int8"})
  assert OpPolicy(fwd="int8", dlhs="int8", drhs="fp32").drhs == "fp32"


def test_empty_json_file_is_called_empty(tmp_path):
  empty = tmp_path / "plan.json"
  empty.write_text("\n")
  with pytest.raises(PlanError, match=r"plan.json is empty\. Fix"):
    Plan.load(str(empty))
  with pytest.raises(PolicyError, match="is empty"):
    PrecisionPolicy.load(str(empty))


class GroupedConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3))(x)
    return nn.Conv(8, (3, 3), feature_group_count=2, name="grouped")(x)


class NnxGroupedConvNet(nnx.Module):
  def __init__(self, rngs):
    self.plain = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.grouped = nnx.Conv(4, 8, (3, 3), feature_group_count=2, rngs=rngs)

  def __call__(self, x):
    return self.grouped(self.plain(x))


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_grouped_conv_at_int8_names_the_layer_and_the_float_rule_while_ops_lists_it(flavour):
  x = jnp.ones((2, 8, 8, 3))
  model = GroupedConvNet() if flavour == "linen" else NnxGroupedConvNet(nnx.Rngs(0))
  qmodel = quantize(model, "int8_fwd")
  variables = qmodel.init(jax.random.key(0), x) if flavour == "nnx" else model.init(jax.random.key(0), x)
  ops = qmodel.ops(variables, x)
  plain, grouped = ("Conv_0", "grouped") if flavour == "linen" else ("plain", "grouped")
  assert set(ops) == {f"{plain}:conv", f"{grouped}:conv"}
  with pytest.raises(PolicyError, match=rf"'{grouped}:conv' is a grouped convolution.*Fix: keep it in float"):
    qmodel.apply(variables, x)
  keep_float = PrecisionPolicy.from_json(
    {"rules": [{"path": grouped, "kind": "conv", "policy": "fp32"}], "__default__": "int8_fwd"}
  )
  out = quantize(model, keep_float).apply(variables, x)  # the fix in the message works
  assert out.shape[0] == 2 and out.shape[-1] == 8


def test_a_rule_matching_no_op_is_named():
  policy = PrecisionPolicy.from_json({"rules": [{"path": "Dense_9", "policy": "int8"}]})
  with pytest.raises(PolicyError, match=r"plan: group 'g': rule path\(s\) \['Dense_9'\] match none.*Fix"):
    policy.check_rules_match(["Dense_0:dense", "Dense_1:dense"], "plan: group 'g'")
  policy.check_rules_match(["Dense_9:dense"])  # used: no error


def test_output_paths(tmp_path):
  a_file = tmp_path / "f.json"
  a_file.write_text("{}")
  full = tmp_path / "full"
  full.mkdir()
  (full / "x").write_text("")
  check_file("--out", str(a_file))  # an existing file is replaced
  check_dir("--out", str(tmp_path / "new" / "deeper"))  # missing parents are created
  cases = [
    (check_file, str(tmp_path), "is a directory, not a file"),
    (check_file, str(tmp_path / "missing" / "f.json"), "does not exist"),
    (check_file, f"{READ_ONLY_DIR}/f.json", "not writable"),
    (check_dir, str(a_file), "is a file, not a directory"),
    (check_dir, str(full), "not empty"),
    (check_dir, str(a_file / "sub"), "is a file, so no directory can be created"),
    (check_dir, f"{READ_ONLY_DIR}/qsync_out", "not writable"),
  ]
  for check, path, needle in cases:
    with pytest.raises(OutputPathError, match=needle):
      check("--out", path)


def test_run_directory(tmp_path):
  run = tmp_path / "run"
  check_run_dir("--out", str(run), resume=False)
  with pytest.raises(OutputPathError, match="holds no checkpoint to resume from.*drop --resume"):
    check_run_dir("--out", str(run), resume=True)
  (run / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save cut short
  with pytest.raises(OutputPathError, match="not empty and holds no run to resume"):
    check_run_dir("--out", str(run), resume=False)
  (run / "checkpoints" / "2").mkdir()
  check_run_dir("--out", str(run), resume=True)
  with pytest.raises(OutputPathError, match="already holds checkpoints.*--resume"):
    check_run_dir("--out", str(run), resume=False)


def _gpu(kind, process=0):
  return types.SimpleNamespace(platform="gpu", device_kind=kind, process_index=process)


def test_device_kind_must_match_the_group_on_gpus_only():
  assert device_type_of(_gpu("NVIDIA H100 80GB HBM3")) == "H100"
  assert device_type_of(_gpu("NVIDIA H100 PCIe")) == "H100-PCIe"
  assert device_type_of(_gpu("Tesla T4")) == "T4"
  cluster = ClusterSpec((DeviceGroup("fast", "A100", 1, 40, 4), DeviceGroup("slow", "T4", 1, 16, 2)))
  check_device_types(cluster, [_gpu("NVIDIA A100-SXM4-80GB"), _gpu("Tesla T4")])
  with pytest.raises(ClusterSpecError, match=r"\('Tesla T4'.*group 'fast'.*'A100'.*--simulate-device-types"):
    check_device_types(cluster, [_gpu("Tesla T4"), _gpu("NVIDIA A100-SXM4-80GB")])
  check_device_types(cluster, [_gpu("Tesla T4"), _gpu("NVIDIA A100-SXM4-80GB")], simulate=True)
  check_device_types(cluster, jax.devices()[:2])  # CPU devices simulate any type
  check_device_types(cluster, [_gpu("Tesla T4", process=1), _gpu("Tesla T4")])  # another process's GPU
