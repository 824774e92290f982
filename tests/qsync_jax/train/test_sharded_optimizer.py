"""The sharded optimizer update (plan optimizer_update="sharded", ZeRO-1) against the replicated one.

On XLA:CPU the reduce-scatter adds the devices' gradients in the same order as the all-reduce
(device order), and the optimizer's elementwise arithmetic is the same per element, so the two
updates agree bit for bit and the tests compare exactly. (A backend whose collectives sum in
another order, e.g. NCCL rings, would differ by fp32 rounding of the reduction only.)
"""

import re

import jax
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import QsyncError
from qsync_jax.plan import Plan
from qsync_jax.sync import make_grad_sync
from qsync_jax.train.checkpoint import CheckpointStore
from qsync_jax.train.train_step import make_train_step
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import make_task

pytestmark = pytest.mark.standard_promotion  # optax's adam under strict promotion (tests/conftest.py)

# Two groups, unequal per-device batches (3, 3 and 1), 3 devices: the MLP's leaves (6→16→3: 96,
# 16, 48 and 3 values) are cut into 3 shards of 32, 6, 16 and 1 (Dense_0's bias padded 16 → 18).
CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 2, 40, 3), DeviceGroup("t", "T4", 1, 16, 1)))
FP16 = {"policies": {"t": "fp16"}}  # an fp16 leg: dynamic loss scaling
NAN_STEP = 2  # the third step's batch holds a NaN: its gradient is not finite


def _plan(mode: str, **fields) -> Plan:
  return Plan.from_json({**FP16, "optimizer_update": mode, **fields})


def _batches(task, n: int):
  batches = task.train_batches(CLUSTER.global_batch, 0)
  out = [next(batches) for _ in range(n)]
  out[NAN_STEP]["x"][0, 0] = np.nan  # row 0: the first device's
  return out


@pytest.fixture(scope="module")
def runs():
  """``{mode: (program, [state after each step], [metrics of each step])}`` for 4 adamw steps
  with dynamic loss scaling (the plan's fp16 leg), the third on a batch holding a NaN."""
  task = make_task()
  batches = _batches(task, 4)
  out = {}
  for mode in ("replicated", "sharded"):
    program = make_train_step(task, CLUSTER, _plan(mode), optax.adamw(0.05), devices=jax.devices()[:3])
    state = program.init(0, batches[0])
    states, metrics = [state], []
    for batch in batches:
      state, m = program(state, program.shard(batch))
      states.append(state)
      metrics.append(jax.device_get(m))
    out[mode] = (program, states, metrics)
  return out


def _full(program, state):
  full = program.full_state(state)
  return jax.device_get((full.params, full.opt_state))


def test_sharded_update_equals_replicated_bit_for_bit(runs):
  program, states, metrics = runs["sharded"]
  ref_program, ref_states, ref_metrics = runs["replicated"]
  assert program.plan.optimizer_update == "sharded"
  # The state holds each device's shard, stacked over "data": adam's mu of Dense_0's kernel
  # (6·16 = 96 values) is 3 rows of 32, the step count one copy per device.
  adam = states[-1].opt_state[0]
  assert adam.mu["Dense_0"]["kernel"].shape == (3, 32) and adam.count.shape == (3,)
  assert adam.mu["Dense_0"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("data")
  for state, ref_state in zip(states[1:], ref_states[1:]):
    for a, b in zip(jax.tree.leaves(_full(program, state)), jax.tree.leaves(_full(ref_program, ref_state))):
      np.testing.assert_array_equal(a, b)
    assert jax.tree.map(np.shape, program.params_of(state)) == jax.tree.map(np.shape, ref_state.params)
  np.testing.assert_array_equal(
    [m["loss"] for m in metrics], [m["loss"] for m in ref_metrics]
  )  # NaN at NAN_STEP


def test_non_finite_step_is_skipped_on_every_shard(runs):
  program, states, metrics = runs["sharded"]
  # Step 0 overflows fp16 at the initial loss scale (halved then); step NAN_STEP has the NaN.
  assert [float(m["skipped"]) for m in metrics] == [1.0, 0.0, 1.0, 0.0]
  changed = (
    _full(program, states[2])[0]["Dense_0"]["kernel"] != _full(program, states[1])[0]["Dense_0"]["kernel"]
  )
  assert changed.all()  # a finite step updates every element
  before, after = _full(program, states[NAN_STEP]), _full(program, states[NAN_STEP + 1])
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)  # params and every shard of the optimizer state kept
  assert float(metrics[NAN_STEP + 1]["loss_scale"]) == float(metrics[NAN_STEP]["loss_scale"]) / 2
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_full(program, states[-1])))


def _collectives(hlo: str) -> dict[str, list[int]]:
  """Element counts of every array each collective of the compiled ``hlo`` returns, by op."""
  out: dict[str, list[int]] = {}
  for line in hlo.splitlines():
    match = re.search(r"= (.*?) (all-reduce|reduce-scatter|all-gather)(-start)?\(", line)
    if match:
      shapes = re.findall(r"[a-z]+\d+\[([\d,]*)\]", match.group(1))
      sizes = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
      out.setdefault(match.group(2), []).extend(sizes)
  return out


def test_compiled_step_reduce_scatters_and_gathers_and_all_reduces_no_gradient(runs):
  program, states, _ = runs["sharded"]
  batch = program.shard(next(make_task().train_batches(CLUSTER.global_batch, 0)))
  found = _collectives(program.step.lower(states[0], batch).compile().as_text())
  # Each leaf's shard of the sum (96/3, 16 padded to 18 → 6, 48/3, 3/3) and its gather.
  assert sorted(found["reduce-scatter"]) == [1, 6, 16, 32]
  assert sorted(found["all-gather"]) == [3, 18, 48, 96]
  # What is still all-reduced: the metrics (loss, mae) and the finite flag, no gradient.
  assert found.get("all-reduce") and max(found["all-reduce"]) <= 2


def test_checkpoints_move_between_sharded_and_replicated_runs(tmp_path):
  task, out = make_task(), str(tmp_path / "run")

  def trainer(mode, **kwargs):
    return Trainer(
      task,
      CLUSTER,
      Plan(optimizer_update=mode),
      optax.adamw(0.05),
      seed=3,
      progress=None,
      devices=jax.devices()[:3],
      **kwargs,
    )

  def assert_same(sharded, replicated):
    full = sharded.program.full_state(sharded.state)
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(replicated.state)):
      np.testing.assert_array_equal(x, y)

  sharded = trainer("sharded", out_dir=out)
  sharded.run(2)  # checkpoint 2, written by the sharded run: the optimizer state whole
  _, meta = CheckpointStore(f"{out}/checkpoints").read_meta(2)
  mu_kernel = [s for s in meta["state"] if s[0] == "['opt_state']['0']['mu']['Dense_0']['kernel']"]
  assert mu_kernel == [["['opt_state']['0']['mu']['Dense_0']['kernel']", "(6, 16)", "float32"]]

  replicated = trainer("replicated", out_dir=out, resume=True)  # from the sharded run's checkpoint
  assert replicated.step == 2
  assert_same(sharded, replicated)
  replicated.run(4)  # checkpoint 4, written by the replicated run

  assert sharded.resume(4) and sharded.step == 4  # from the replicated run's checkpoint
  assert sharded.state.opt_state[0].mu["Dense_0"]["kernel"].shape == (3, 32)
  assert_same(sharded, replicated)
  sharded.run(6)
  replicated.run(6)
  assert_same(sharded, replicated)


def test_state_moves_through_its_full_form_to_other_devices(runs):
  program, states, _ = runs["sharded"]
  # The same plan with group "a" sitting out: 1 device of group "t" runs it.
  other = make_train_step(
    make_task(),
    CLUSTER,
    _plan("sharded", batch_per_device={"a": 0, "t": 7}),  # the global batch kept: 2 × 3 + 1 × 1
    optax.adamw(0.05),
    devices=jax.devices()[:3],
  )
  assert other.mesh.size == 1
  moved = other.from_full_state(program.full_state(states[-1]))
  assert moved.opt_state[0].mu["Dense_0"]["kernel"].shape == (1, 96)
  for a, b in zip(jax.tree.leaves(_full(other, moved)), jax.tree.leaves(_full(program, states[-1]))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "fields, grad_sync, needle",
  [
    ({"reduction": "two_level"}, None, "optimizer_update='sharded' with reduction='two_level'.*Fix:"),
    ({}, make_grad_sync("bf16"), "optimizer_update='sharded' with sync .*Fix: leave the sync unset"),
  ],
)
def test_sharded_update_refuses_what_it_cannot_run(fields, grad_sync, needle):
  with pytest.raises(QsyncError, match=needle):
    make_train_step(make_task(), CLUSTER, _plan("sharded", **fields), optax.adamw(0.05), grad_sync)


@pytest.mark.parametrize("strategy", ["selsync", "qsdp"])
def test_trainer_refuses_sharded_update_with_a_step_builder_strategy(strategy):
  with pytest.raises(QsyncError, match=f"optimizer_update='sharded' with sync '{strategy}'.*Fix:"):
    Trainer(make_task(), CLUSTER, Plan(optimizer_update="sharded"), grad_sync=strategy, progress=None)


def test_each_device_holds_its_share_of_the_adam_moments_as_the_memory_model_charges(runs):
  # the memory model charges a sharded plan opt_state_bytes / N per device
  # (planners.predictor.memory_model.memory_bytes): here each device holds ⌈size / 3⌉ of every
  # moment leaf, so 1/3 of the state up to the padding of each leaf to a multiple of 3
  replicated, sharded = (runs[mode][1][-1].opt_state[0] for mode in ("replicated", "sharded"))
  full_bytes = 0
  per_device = dict.fromkeys(jax.devices()[:3], 0)
  for moments in ("mu", "nu"):
    whole, cut = getattr(replicated, moments), getattr(sharded, moments)
    for full, shards in zip(jax.tree.leaves(whole), jax.tree.leaves(cut)):
      full_bytes += full.nbytes
      assert all(s.data.size == full.size for s in full.addressable_shards)  # replicated: all of it
      assert len(shards.addressable_shards) == 3
      for s in shards.addressable_shards:
        assert s.data.size == -(-full.size // 3)
        per_device[s.device] += s.data.nbytes
  assert full_bytes == 2 * 4 * (96 + 16 + 48 + 3)
  padding = 2 * 4 * 2  # of the leaves of 96, 16, 48 and 3 values only Dense_0's bias pads, 16 → 18
  assert set(per_device.values()) == {(full_bytes + padding) // 3}
