"""A plan mixing precisions across groups compiles to one conditional whose branches each hold one
policy's work, with every convolution in XLA:CPU's canonical order, in the hybrid step and in the
SelSync and QSDP steps (structure, not timing: ``benchmarks/mixed_plan.py`` times it)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.ops.vma import shard_map
from qsync_jax.plan import Plan
from qsync_jax.train.branch import device_switch, plan_branches
from qsync_jax.train.canonical_convs import canonical_convs
from qsync_jax.train.strategy_step import branch_loss_fn, make_strategy_step
from qsync_jax.train.task import Task
from qsync_jax.train.task_step import task_loss
from qsync_jax.train.train_step import make_train_step

pytestmark = pytest.mark.standard_promotion  # optax's adam under strict promotion (tests/conftest.py)

POLICIES = {"g0": "fp32", "g1": "bf16", "g2": "int8_fwd"}
CLUSTER = ClusterSpec(tuple(DeviceGroup(g, "cpu", 1, 16, 2) for g in POLICIES))
CANONICAL_2D = "b01f_01io->b01f"  # NHWC / HWIO / NHWC: what XLA:CPU's fast convolution takes
# SelSync and QSDP have no loss scaling: their int8 group's gradient legs run in bf16, not fp16
STRATEGY_PLAN = Plan.from_json(
  {"policies": {**POLICIES, "g2": {"__default__": {"fwd": "int8", "dlhs": "bf16", "drhs": "bf16"}}}}
)


class TinyConv(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))  # 40 params
    return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))  # 15 params


def _batches(n, seed):
  rng = np.random.default_rng(seed)
  while True:
    yield {
      "x": rng.normal(size=(n, 6, 6, 1)).astype(np.float32),
      "y": rng.normal(size=(n, 3)).astype(np.float32),
    }


def _task():
  return Task(
    "tiny_conv", TinyConv(), lambda b: (b["x"],), lambda out, b: (jnp.mean((out - b["y"]) ** 2), {}), _batches
  )


def _computations(hlo: str) -> dict[str, str]:
  """Every computation's body in an HLO module's text, by name."""
  out, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
    if header:
      name, out[header.group(1)] = header.group(1), ""
    elif name is not None:
      out[name] += line + "\n"
  return out


def _reachable(computations: dict[str, str], root: str) -> set[str]:
  """``root`` and every computation it calls (fusions, branches, loop bodies…), transitively."""
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    todo += re.findall(
      r"%([\w.\-]+)",
      " ".join(
        re.findall(
          r"(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%[\w.\-]+)", computations[name]
        )
      ),
    )
  return seen


@pytest.fixture(scope="module")
def hlo():
  task = _task()
  program = make_train_step(
    task, CLUSTER, Plan.from_json({"policies": POLICIES}), optax.adam(1e-3), devices=jax.devices()[:3]
  )
  batch = next(task.train_batches(program.global_batch, 0))
  state = program.init(0, batch)
  return program.step.lower(state, program.shard(batch)).compile().as_text()


def test_each_device_runs_only_its_own_policy(hlo):
  computations = _computations(hlo)
  switches = re.findall(r"conditional\(.*branch_computations=\{([^}]*)\}", hlo)
  per_branch = [re.findall(r"%([\w.\-]+)", s) for s in switches if len(re.findall(r"%", s)) == len(POLICIES)]
  assert len(per_branch) == 1, switches  # one switch on the device's branch, one branch per policy
  reach = [_reachable(computations, name) for name in per_branch[0]]
  # the int8 policy's quantized operands (s8) are computed in one branch only: the other devices'
  # branches hold no int8 work, so no device executes another's policy
  with_int8 = [i for i, names in enumerate(reach) if any("s8[" in computations[n] for n in names)]
  assert len(with_int8) == 1, with_int8


def test_every_convolution_is_in_the_canonical_order(hlo):
  labels = re.findall(r"convolution\(.*dim_labels=([\w>\-]+)", hlo)
  assert labels  # the fp32 and bf16 branches' forward and backward convolutions
  assert set(labels) == {CANONICAL_2D}, labels


def test_canonical_convs_computes_the_same_values():
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(2, 5, 5, 3)).astype(np.float32), rng.normal(size=(3, 3, 3, 4)).astype(np.float32)

  def grads(x, w):  # the weight gradient contracts over the batch: a non-canonical convolution
    return jax.grad(lambda x, w: jnp.sum(jnp.tanh(_conv(x, w))), argnums=(0, 1))(x, w)

  direct, rewritten = jax.jit(grads)(x, w), jax.jit(canonical_convs(grads))(x, w)
  for a, b in zip(direct, rewritten):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # the same sums, another kernel's order
  eqns = jax.make_jaxpr(canonical_convs(grads))(x, w).jaxpr.eqns
  specs = [e.params["dimension_numbers"] for e in eqns if e.primitive.name == "conv_general_dilated"]
  assert len(specs) == 3 and all(tuple(s) == ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)) for s in specs)


def _conv(x, w):
  return jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.mark.parametrize("sync", ["selsync", "qsdp"])
def test_a_strategy_steps_convolutions_are_in_the_canonical_order_too(sync):
  task = _task()
  program = make_strategy_step(task, CLUSTER, STRATEGY_PLAN, optax.sgd(1e-3), sync, devices=jax.devices()[:3])
  batch = next(task.train_batches(program.global_batch, 0))
  state = program.init(0, batch)
  hlo = program.step.lower(state, program.shard(batch)).compile().as_text()
  labels = re.findall(r"convolution\(.*dim_labels=([\w>\-]+)", hlo)
  assert len(labels) == 4  # the fp32 and bf16 branches' forward and weight-gradient convolutions
  assert set(labels) == {CANONICAL_2D}, labels


def test_a_strategys_branch_gradient_equals_the_switchs():
  """``branch_loss_fn``'s gradient (each branch's own, computed inside the switch and scaled by
  the cotangent) is the gradient of the switch of the branches' losses."""
  task, devices = _task(), jax.devices()[:3]
  mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
  branches, device_branch = plan_branches(CLUSTER, STRATEGY_PLAN)
  losses = [task_loss(task, b.policy, params_only=True) for b in branches]
  plain = device_switch(losses, device_branch)  # each branch takes its device's whole shard of 2 rows
  batch = next(task.train_batches(6, 0))
  params = task.model.init(jax.random.key(0), batch["x"][:1])["params"]
  P = jax.sharding.PartitionSpec

  def gradients(loss_fn, cotangent=1.0):
    def local(params, batch):
      grads = jax.grad(lambda p: cotangent * loss_fn(p, batch, jax.random.key(1)))(params)
      return jax.tree.map(lambda g: jax.lax.all_gather(g, "data"), grads)

    mapped = shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    return jax.tree.leaves(jax.jit(mapped)(params, batch))

  expected = gradients(plain)
  for a, b in zip(expected, gradients(branch_loss_fn(task, branches, device_branch, "gpu"))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # Scaled by the cotangent after the branch's backward, not before: low-precision legs round the
  # same values. With canonical convolutions the bf16 branch's weight gradient is rounded to bf16,
  # as its policy says, where the switch's own order lets XLA:CPU keep it in fp32 (excess
  # precision): they differ by one bf16 rounding.
  for a, b in zip(expected, gradients(branch_loss_fn(task, branches, device_branch, "cpu"), 3.0)):
    np.testing.assert_allclose(3.0 * a, b, rtol=2**-8, atol=1e-7)
