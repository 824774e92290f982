"""Bad input through the Python API: a named error with the fix, before any work."""

import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from qsync_jax import quantize
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.devices import device_type_of
from qsync_jax.errors import (
  ClusterSpecError,
  OutputPathError,
  PlanError,
  PolicyError,
  QsyncError,
  QsyncWarning,
)
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.precision import OpPolicy
from qsync_jax.train.distributed import check_device_types
from qsync_jax.train.outputs import check_dir, check_file, check_run_dir
from qsync_jax.train.run_log import drop_metrics_after

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


class TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))


class NnxTwoDense(nnx.Module):
  def __init__(self, rngs):
    self.first, self.second = nnx.Linear(2, 4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.second(nnx.relu(self.first(x)))


def test_a_misspelled_rule_behind_a_default_is_named_by_quantize_train_plan_and_predict():
  """With a ``__default__`` every op gets a policy, so nothing else shows that a rule matched no op:
  ``quantize`` warns (one policy may serve several models), the commands refuse."""
  from planners.inputs import check_profiles_fit
  from qsync_jax.train.trainer import check_plan_matches_model
  from tests.planners.fakes import fake_profile
  from tests.qsync_jax.train.tiny import make_task

  misspelled = {"rules": [{"path": "Dnse_1", "policy": "fp32"}], "__default__": "bf16"}
  x = jax.random.normal(jax.random.key(0), (2, 2))
  needle = r"rule path\(s\) \['Dnse_1'\] match none of the model's 2 .*run the __default__ instead.*Fix"
  qmodel = quantize(TwoDense(), misspelled)
  with pytest.warns(QsyncWarning, match="quantize.*" + needle):
    variables = qmodel.init(jax.random.key(0), x)
  with pytest.warns(QsyncWarning, match=needle):
    qmodel.apply(variables, x)
  with pytest.warns(QsyncWarning, match=needle):
    quantize(NnxTwoDense(nnx.Rngs(0)), misspelled)
  plan = Plan.from_json({"policies": {"g": misspelled}})
  task = make_task()
  batch = next(task.train_batches(4, 0))
  with pytest.raises(PlanError, match="plan: group 'g': " + needle):  # qsync train
    check_plan_matches_model(task, plan, task.model.init(jax.random.key(0), batch["x"]), batch)
  cluster = ClusterSpec((DeviceGroup("g", "cpu", 1, 16, 8),))
  with pytest.raises(PlanError, match="plan: group 'g': " + needle):  # qsync plan --measured, qsync predict
    check_profiles_fit({"cpu": fake_profile([(1.0, 1.0, 1.0)] * 2)}, cluster, plan)


def test_a_sync_option_of_the_wrong_type_is_named_with_its_type_and_an_example():
  from qsync_jax.sync import make_grad_sync, make_step_strategy

  with pytest.raises(
    QsyncError, match=r"option delta='abc' is of type str, but delta takes a number.*delta=0\.3"
  ):
    make_step_strategy("selsync", None, None, None, delta="abc")
  with pytest.raises(QsyncError, match=r"bucket_size='x' .* takes an integer or null.*bucket_size=1024"):
    make_grad_sync("global_qsgd", bucket_size="x")
  with pytest.raises(
    QsyncError, match=r"full_precision=3 .* a Python function.*--sync-option cannot give one"
  ):
    make_step_strategy("qsdp", None, None, None, full_precision=3)
  make_grad_sync("global_qsgd", bucket_size=None, payload="int8")  # the declared types pass


def test_resume_keeps_metrics_lines_that_are_not_utf8_and_says_so(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": 1}).encode(), b"\xff\xfe\x00garbage", json.dumps({"step": 2}).encode()]
  path.write_bytes(b"\n".join(lines) + b"\n" + b'{"step": 3')  # and a line a kill cut short
  with pytest.warns(QsyncWarning, match=r"metrics.jsonl: line\(s\) 2 are not UTF-8 text.*kept as they are"):
    drop_metrics_after(str(path), 1)
  assert path.read_bytes() == lines[0] + b"\n" + lines[1] + b"\n"  # step 2 dropped, the bytes kept


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
