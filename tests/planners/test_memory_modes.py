"""The memory model against what the trainer's compiled step allocates, per optimizer-update mode
and with accumulation, on 2-, 3- and 4-group simulated pools, and on a 3-group pool whose groups
run different branches: XLA's buffer assignment of ``make_train_step``'s program (the state
donated, as on GPUs) within 10 % of the model's peak."""

import jax
import optax
import pytest

from planners.predictor import predict
from planners.predictor.memory_model import memory_bytes, program_memory_bytes
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import group_costs
from planners.profiler.measure import traced_profile
from planners.profiler.timing import xla_peak_bytes
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train.train_step import make_train_step
from tests.planners import tiny

BATCH = 16
CASES = {  # pool (devices per group) → the modes compiled there (the replicated update's terms do not
  # depend on the groups: compiled once; the sharded one's 1/N does)
  (1, 1): ("replicated", "sharded", "2 micro-steps"),
  (1, 1, 2): ("sharded",),
  (2, 2, 2, 2): ("sharded", "2 micro-steps"),
}
MODES = {"replicated": ("replicated", 1), "sharded": ("sharded", 1), "2 micro-steps": ("replicated", 2)}
TOLERANCE = 0.10  # the model's terms are whole buffers; XLA reuses parts of some between them


@pytest.fixture(scope="module")
def task_and_profile():
  """An MLP whose parameters and Adam state outweigh its activations (the modes' terms dominate),
  its profile traced and fitted to its one-device step on this CPU."""
  task = tiny.mlp(features=64, hidden=256)
  return task, traced_profile(task, BATCH)


def compiled_peak(task, cluster, plan) -> int:
  ts = make_train_step(
    task, cluster, plan, optax.adam(1e-3), devices=jax.devices()[: cluster.num_devices], donate=True
  )
  batch = next(task.train_batches(ts.global_batch, 0))
  return xla_peak_bytes(ts.step.lower(ts.init(0, batch), ts.shard(batch)).compile())


@pytest.mark.parametrize("pool", CASES, ids=[f"{len(p)} groups" for p in CASES])
def test_the_memory_model_holds_what_the_compiled_step_allocates_in_every_mode(task_and_profile, pool):
  task, profile = task_and_profile
  cluster = ClusterSpec(tuple(DeviceGroup(f"g{i}", "cpu", n, 16, BATCH) for i, n in enumerate(pool)))
  models = {}
  for name in CASES[pool]:
    update, micro = MODES[name]
    plan = Plan(
      optimizer_update=update, micro_steps={g: micro for g in cluster.group_names} if micro > 1 else {}
    )
    peak = compiled_peak(task, cluster, plan)
    shards = cluster.num_devices if update == "sharded" else 1
    groups = group_costs(cluster, {"cpu": profile}, plan)
    models[name] = max(memory_bytes(g, optimizer_shards=shards, devices=cluster.num_devices) for g in groups)
    assert abs(models[name] / peak - 1) <= TOLERANCE, (name, models[name], peak)
    # the replay predicts the model's figure for the plan
    predicted = predict(cluster, {"cpu": modeled_profile(profile, "cpu")}, plan).memory_bytes
    assert max(predicted.values()) == models[name]
  # what the sharded update saves: 1/N of the Adam state on each device, less its shards
  params, adam = profile.memory["param_bytes"], profile.memory["opt_state_bytes"]
  n = cluster.num_devices
  sharded = models["sharded"]
  plain = memory_bytes(group_costs(cluster, {"cpu": profile}, Plan())[0], devices=n)
  assert plain - sharded == pytest.approx(adam - adam / n - params / n, abs=2)


def test_every_device_of_a_mixed_plan_holds_its_costliest_branch():
  """Groups at different policies and batches compile one program with a branch each: every
  device holds the largest branch's buffers and the input padded to the largest batch, not its
  own branch's (which the model of the small groups alone would give: about 0.6 of the peak)."""
  task = tiny.mlp(features=64, hidden=128)  # activations outweigh parameters at 256 examples
  big = 256
  profile = traced_profile(task, big)
  pool = (("fp32", 1, big), ("bf16", 1, 64), ("int8", 2, 32))
  cluster = ClusterSpec(tuple(DeviceGroup(f"g{i}", "cpu", n, 16, b) for i, (_, n, b) in enumerate(pool)))
  plan = Plan(policies={f"g{i}": PrecisionPolicy.uniform(p) for i, (p, _, _) in enumerate(pool)})
  peak = compiled_peak(task, cluster, plan)
  groups = group_costs(cluster, {"cpu": profile}, plan)
  n = cluster.num_devices
  modeled = program_memory_bytes(groups, devices=n)
  for name, need in modeled.items():
    assert abs(need / peak - 1) <= TOLERANCE, (name, need, peak)
  alone = {g.name: memory_bytes(g, devices=n) for g in groups}
  assert alone["g2"] < 0.7 * peak  # what the groups' own branches would have said
  assert predict(cluster, {"cpu": modeled_profile(profile, "cpu")}, plan).memory_bytes == modeled
