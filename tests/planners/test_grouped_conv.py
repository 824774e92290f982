"""A grouped convolution through the planning stages: the indicator scores it at float
precisions only, profiles hold no 8-bit legs for it, the allocator keeps it in float, and the
plan runs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planners.allocator.greedy import make_problem
from planners.allocator.joint import joint_plan, plan_of
from planners.indicator import compute
from planners.ops import collect_ops
from planners.predictor.modeled import modeled_profile
from planners.profile import Profile
from qsync_jax import quantize
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.train.task import Task


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=2, name="grouped")(x))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _batches(n, seed):
  rng = np.random.default_rng(seed)
  while True:
    yield {"x": rng.normal(size=(n, 6, 6, 2)).astype(np.float32), "y": rng.integers(0, 3, size=n)}


def _loss(logits, batch):
  onehot = jax.nn.one_hot(batch["y"], 3)
  return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1)), {}


TASK = Task("grouped", Net(), lambda b: (b["x"],), _loss, _batches)


def test_grouped_conv_is_planned_in_float():
  batch = next(_batches(4, 0))
  variables = TASK.model.init(jax.random.key(0), batch["x"])
  ops = {o.name: o for o in collect_ops(TASK.model, variables, batch["x"])}
  assert not ops["grouped:conv"].runs_8bit and ops["Conv_0:conv"].runs_8bit
  table = compute(TASK, variables, [next(_batches(4, s)) for s in (1, 2)], ("gradient",), ("int8", "fp16"))
  omega = table["gradient"]["omega"]
  assert set(omega["grouped:conv"]) == {"fp32", "fp16"} and "int8" in omega["Conv_0:conv"]
  base = Profile(
    "grouped",
    "cpu",
    "traced",
    4,
    tuple(ops.values()),
    {},
    {},
    0.0,
    {},
    {"param_bytes": 4000, "opt_state_bytes": 8000, "batch_bytes": 0, "other_bytes": 0},
  )
  t4 = modeled_profile(base, "T4")
  assert "int8" not in t4.op_ms["grouped:conv"]["fwd"] and "int8" in t4.op_ms["Conv_0:conv"]["fwd"]
  cluster = ClusterSpec((DeviceGroup("train", "V100", 1, 32.0, 4), DeviceGroup("infer", "T4", 1, 16.0, 4)))
  problem = make_problem(cluster, {"V100": modeled_profile(base, "V100"), "T4": t4}, table["gradient"])
  j = problem.op_names.index("grouped:conv")
  assert [p for p, _ in problem.ladders[0][j]] == ["fp16", "fp32"]
  chosen, _, _ = joint_plan(problem)
  plan = plan_of(problem, chosen)
  policy = plan.policy_for("infer")
  assert policy.resolve(problem.op_names)["grouped:conv"].fwd in ("fp16", "fp32")
  out = quantize(TASK.model, policy).apply(variables, batch["x"])  # runs: no grouped-conv error
  assert out.shape == (4, 3) and bool(jnp.all(jnp.isfinite(out)))


def test_a_where_supported_rule_runs_8bit_where_a_kernel_exists_and_falls_through_elsewhere():
  from flax import nnx

  from qsync_jax import Plan, PolicyError, PrecisionPolicy, UnsupportedPrecisionError
  from qsync_jax.train.train_step import plan_branches

  obj = {
    "rules": [{"path": ".*", "kind": "conv", "policy": "int8", "where_supported": True}],
    "__default__": "fp16",
  }
  policy = PrecisionPolicy.from_json(obj)
  assert PrecisionPolicy.from_json(policy.to_json()) == policy
  x = jnp.zeros((2, 6, 6, 2))
  linen = quantize(Net(), policy)
  variables = linen.init(jax.random.key(0), x)
  ops = linen.ops(variables, x)  # the grouped conv has no 8-bit kernel: the default (fp16)
  assert (ops["Conv_0:conv"].fwd, ops["grouped:conv"].fwd, ops["Dense_0:dense"].fwd) == (
    "int8",
    "fp16",
    "fp16",
  )
  jax.eval_shape(lambda v: linen.apply(v, x), variables)  # traces: no grouped-conv PolicyError
  depthwise = nnx.Conv(2, 2, (3, 3), feature_group_count=2, rngs=nnx.Rngs(0))
  assert quantize(depthwise, policy).ops(quantize(depthwise, policy).init(None), x)[":conv"].fwd == "fp16"
  # a device type without int8 (a V100) runs the rest of the policy, and the trainer's branch does too
  policy.validate_for_device("V100")
  with pytest.raises(UnsupportedPrecisionError, match="V100"):
    PrecisionPolicy.from_json(
      {**obj, "rules": [{**obj["rules"][0], "where_supported": False}]}
    ).validate_for_device("V100")
  cluster = ClusterSpec((DeviceGroup("v", "V100", 1, 32, 2), DeviceGroup("t", "T4", 1, 16, 2)))
  branches, _ = plan_branches(cluster, Plan(policies={"v": policy, "t": policy}))
  assert [(b.groups, len(b.policy.rules)) for b in branches] == [(("v",), 0), (("t",), 1)]
  with pytest.raises(PolicyError, match="where_supported must be true or false.*Fix"):
    PrecisionPolicy.from_json({"rules": [{**obj["rules"][0], "where_supported": "yes"}]})
