"""A grouped convolution through the planning stages: the indicator scores it at float
precisions only, profiles hold no 8-bit legs for it, the allocator keeps it in float, and the
plan runs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
