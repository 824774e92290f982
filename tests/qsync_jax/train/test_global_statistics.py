"""Statistics over the whole gradient under the sharded (ZeRO-1) optimizer update.

The step's own global-norm clip (``clip_norm``) takes the norm over the whole gradient in both
update modes; an optax optimizer whose update reads across elements (a global-norm clip, LAMB's
trust ratios, Adafactor) or chooses by a leaf's shape is refused for the sharded update before
anything compiles, and elementwise ones are accepted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import PlanError, QsyncError
from qsync_jax.plan import Plan
from qsync_jax.train.sharded_update import check_sharded_optimizer
from qsync_jax.train.train_step import make_train_step
from qsync_jax.train.trainer import Trainer
from tests.qsync_jax.train.tiny import make_task

pytestmark = pytest.mark.standard_promotion  # optax's adam under strict promotion (tests/conftest.py)

# 4 devices, unequal per-device batches; the MLP's leaves (96, 16, 48, 3 values) cut into 4 shards.
CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 2, 40, 3), DeviceGroup("t", "T4", 2, 16, 1)))
CLIP = 0.5  # below the tiny MLP's gradient norm (about 2-5) at every step: every step clips
STEPS = 3


def _run(mode: str, optimizer, clip_norm=None):
  task = make_task()
  program = make_train_step(
    task, CLUSTER, Plan(optimizer_update=mode), optimizer, devices=jax.devices()[:4], clip_norm=clip_norm
  )
  batches = task.train_batches(CLUSTER.global_batch, 0)
  first = next(batches)
  state = program.init(0, first)
  initial = jax.device_get(program.params_of(state))
  metrics = []
  for batch in [first] + [next(batches) for _ in range(STEPS - 1)]:
    state, m = program(state, program.shard(batch))
    metrics.append(jax.device_get(m))
  return jax.device_get(program.params_of(state)), metrics, (initial, first)


@pytest.fixture(scope="module")
def runs():
  sgd = optax.sgd(0.1, momentum=0.9)  # not scale-invariant (unlike adam): the clip changes the update
  return {
    "optax": _run("replicated", optax.chain(optax.clip_by_global_norm(CLIP), sgd)),
    "replicated": _run("replicated", sgd, CLIP),
    "sharded": _run("sharded", sgd, CLIP),
    "unclipped": _run("replicated", sgd),
  }


def test_clip_norm_is_optax_global_norm_clip_in_both_update_modes(runs):
  reference, _, _ = runs["optax"]
  replicated, metrics, _ = runs["replicated"]
  sharded, sharded_metrics, _ = runs["sharded"]
  for a, b in zip(jax.tree.leaves(replicated), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(a, b)  # the same arithmetic as optax's clip, on the same tree
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(reference)):
    # the sharded norm sums the shards' sums of squares (another fp32 summation order)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  norms = [float(m["grad_norm"]) for m in metrics]
  assert all(n > CLIP for n in norms)  # every step clipped
  np.testing.assert_allclose([float(m["grad_norm"]) for m in sharded_metrics], norms, rtol=1e-6)
  unclipped, unclipped_metrics, _ = runs["unclipped"]
  assert "grad_norm" not in unclipped_metrics[0]
  assert not np.allclose(unclipped["Dense_0"]["kernel"], reference["Dense_0"]["kernel"], atol=1e-3)


def test_grad_norm_is_the_global_norm_of_the_combined_gradient(runs):
  _, metrics, (params, batch) = runs["sharded"]
  task = make_task()

  def loss(params):  # the full-batch mean loss (the step's weighting of the devices' losses)
    out = task.model.apply({"params": params}, batch["x"])
    return jnp.mean(jnp.square(out - batch["y"]))

  grads = jax.grad(loss)(params)
  expected = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(float(metrics[0]["grad_norm"]), expected, rtol=1e-5)


PARAMS = {
  "Dense_0": {
    "kernel": jax.ShapeDtypeStruct((6, 16), jnp.float32),
    "bias": jax.ShapeDtypeStruct((16,), jnp.float32),
  },
  "Dense_1": {
    "kernel": jax.ShapeDtypeStruct((16, 3), jnp.float32),
    "bias": jax.ShapeDtypeStruct((3,), jnp.float32),
  },
}
FIXED_MASK = {"Dense_0": {"kernel": True, "bias": False}, "Dense_1": {"kernel": True, "bias": False}}


def _by_rank(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


@pytest.mark.parametrize(
  "optimizer, needle",
  [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "reads across array elements"),
    (optax.lamb(1e-3), "reads across array elements"),
    (optax.adafactor(1e-3), "reads across array elements"),
    (optax.adamw(1e-3, mask=_by_rank), "runs other operations than on the params' shapes"),
  ],
  ids=["clip_by_global_norm", "lamb", "adafactor", "adamw_mask_by_rank"],
)
def test_sharded_update_refuses_an_optimizer_reading_global_statistics_or_shapes(optimizer, needle):
  with pytest.raises(QsyncError, match=needle) as e:
    check_sharded_optimizer(optimizer, PARAMS, 4)
  assert "Fix:" in str(e.value) and "optimizer_update to 'replicated'" in str(e.value)
  if "across" in needle:
    assert "clip_norm=" in str(e.value) and "--clip-norm" in str(e.value)


@pytest.mark.parametrize(
  "optimizer",
  [
    optax.sgd(0.1),
    optax.sgd(0.1, momentum=0.9),
    optax.adam(1e-3),
    optax.adamw(1e-3),
    optax.adamw(1e-3, mask=FIXED_MASK),
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1),
  ],
  ids=["sgd", "momentum", "adam", "adamw", "adamw_fixed_mask", "adamw_schedule"],
)
def test_sharded_update_accepts_elementwise_optimizers(optimizer):
  check_sharded_optimizer(optimizer, PARAMS, 4)


def test_step_refuses_a_global_clip_before_compiling():
  program = make_train_step(
    make_task(),
    CLUSTER,
    Plan(optimizer_update="sharded"),
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    devices=jax.devices()[:4],
  )
  with pytest.raises(QsyncError, match="optimizer_update='sharded'.*Fix: clip with the step's clip_norm="):
    program.init(0, next(make_task().train_batches(CLUSTER.global_batch, 0)))


@pytest.mark.parametrize("clip_norm", [-1.0, 0.0, float("nan"), "1"])
def test_bad_clip_norm_is_refused(clip_norm):
  with pytest.raises(QsyncError, match="clip_norm=.*Fix:"):
    Trainer(make_task(), CLUSTER, devices=jax.devices()[:4], clip_norm=clip_norm, progress=None)


def test_step_builder_strategy_refuses_clip_norm():
  with pytest.raises(QsyncError, match="clip_norm=1.0 with sync strategy 'selsync'.*Fix:"):
    Trainer(
      make_task(), CLUSTER, grad_sync="selsync", devices=jax.devices()[:4], clip_norm=1.0, progress=None
    )


def test_cli_refuses_a_sharded_plan_with_a_sync_before_the_model_loads(tmp_path, capsys):
  cluster, plan = tmp_path / "c.json", tmp_path / "p.json"
  CLUSTER.save(str(cluster))
  Plan(optimizer_update="sharded").save(str(plan))
  for sync in ("global_qsgd", "selsync", "qsdp"):
    # no_such_pkg: the task would fail to load, so a plan error proves the check came first
    args = ["--model", "no_such_pkg.mod:make", "--cluster", str(cluster), "--plan", str(plan), "--sync", sync]
    code = cli.main(["train", "--steps", "2", "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2 and f"optimizer_update='sharded' with sync '{sync}'" in err and "Fix:" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_step_builder_fp16_refusal_names_a_precision_each_device_runs():
  plan = Plan.from_json({"policies": {"a": "fp16", "t": "fp16"}})
  with pytest.raises(PlanError) as e:
    Trainer(make_task(), CLUSTER, plan, grad_sync="qsdp", devices=jax.devices()[:4], progress=None)
  message = str(e.value)
  assert "group 'a' (A100) in bf16" in message and "group 't' (T4) in fp32, as it has no bf16" in message
  assert "gradient-hook strategy (fp32, bf16, fp16, global_qsgd), whose step scales the loss" in message
