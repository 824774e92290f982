"""Learning-rate schedules, weight decay and clipping as ``qsync train`` and ``make_optimizer`` build
them: the values, the ``lr`` and ``grad_norm`` metrics, and bad values refused before any work."""

import json

import jax
import numpy as np
import optax
import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import QsyncError
from qsync_jax.plan import Plan
from qsync_jax.train.optimizers import check_optimizer_options, learning_rate_schedule, make_optimizer
from qsync_jax.train.train_step import make_train_step
from tests.qsync_jax.train.tiny import make_task

pytestmark = pytest.mark.standard_promotion  # optax's adam under strict promotion (tests/conftest.py)

CLUSTER = ClusterSpec((DeviceGroup("a", "A100", 2, 40, 3), DeviceGroup("t", "T4", 1, 16, 1)))


def test_schedules_warm_up_linearly_then_hold_or_decay_to_zero():
  steps = np.arange(11)
  constant = learning_rate_schedule(0.2, "constant", warmup_steps=4)
  np.testing.assert_allclose([constant(s) for s in steps], [0, 0.05, 0.1, 0.15] + [0.2] * 7, atol=1e-7)
  linear = learning_rate_schedule(0.2, "linear", warmup_steps=2, total_steps=10)
  np.testing.assert_allclose(
    [linear(s) for s in steps], [0, 0.1, 0.2, 0.175, 0.15, 0.125, 0.1, 0.075, 0.05, 0.025, 0.0], atol=1e-7
  )
  cosine = learning_rate_schedule(0.2, "cosine", warmup_steps=2, total_steps=10)
  want = [0, 0.1] + [0.1 * (1 + np.cos(np.pi * (s - 2) / 8)) for s in range(2, 11)]
  np.testing.assert_allclose([cosine(s) for s in steps], want, atol=1e-7)
  assert learning_rate_schedule(0.2)(1000) == pytest.approx(0.2)  # no warmup: lr from step 0


def test_a_constant_rate_is_the_plain_optax_optimizer():
  params = {"w": np.ones((3,), np.float32)}
  plain, made = optax.adam(1e-3).init(params), make_optimizer("adam", 1e-3).init(params)
  assert jax.tree.structure(made) == jax.tree.structure(plain)  # its checkpoints resume with optax.adam
  warm = make_optimizer("adam", 1e-3, warmup_steps=2).init(params)
  assert float(warm.hyperparams["learning_rate"]) == 0.0  # a schedule: the rate kept in the state


def test_adamw_weight_decay_is_decoupled_and_scaled_by_the_learning_rate():
  params = {"w": np.full((3,), 2.0, np.float32)}
  optimizer = make_optimizer("adamw", 0.1, weight_decay=0.5)
  updates, _ = optimizer.update({"w": np.zeros((3,), np.float32)}, optimizer.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)  # zero gradient: decay alone


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_step_logs_the_learning_rate_the_update_used(mode):
  task = make_task()
  optimizer = make_optimizer("sgd", 0.1, "linear", warmup_steps=2, total_steps=4)
  program = make_train_step(task, CLUSTER, Plan(optimizer_update=mode), optimizer, devices=jax.devices()[:3])
  batches = task.train_batches(CLUSTER.global_batch, 0)
  state = program.init(0, next(task.train_batches(CLUSTER.global_batch, 0)))
  rates = []
  for _ in range(4):
    before = jax.device_get(program.params_of(state))
    batch = next(batches)
    state, metrics = program(state, program.shard(batch))
    rates.append(float(metrics["lr"]))
  np.testing.assert_allclose(rates, [0.0, 0.05, 0.1, 0.05], atol=1e-7)
  # the last update moved the params by lr · gradient: the rate logged is the rate applied
  grads = jax.grad(lambda p: _loss(task, p, batch))(before)
  after = jax.device_get(program.params_of(state))
  np.testing.assert_allclose(
    after["Dense_1"]["bias"], before["Dense_1"]["bias"] - 0.05 * grads["Dense_1"]["bias"], rtol=1e-5
  )


def _loss(task, params, batch):
  out = task.model.apply({"params": params}, batch["x"])
  return ((out - batch["y"]) ** 2).mean()


@pytest.mark.parametrize(
  "kwargs, needle",
  [
    ({"lr": float("nan")}, "--lr nan is not a learning rate: it must be a finite number above 0"),
    ({"lr": -1e-3}, "must be a finite number above 0"),
    ({"warmup_steps": -1}, "--warmup-steps / warmup_steps=-1 must be an integer ≥ 0"),
    ({"warmup_steps": 20, "total_steps": 10}, "is longer than the run"),
    ({"schedule": "cosine", "warmup_steps": 10, "total_steps": 10}, "the warmup must end before the decay"),
    ({"schedule": "linear"}, "decays to 0 at total_steps"),
    ({"weight_decay": 0.01}, "decoupled weight decay is adamw's. Fix: use --optimizer adamw"),
    ({"name": "adamw", "weight_decay": -0.1}, "must be a number ≥ 0"),
    ({"name": "lamb"}, "optimizer 'lamb' is not one of"),
  ],
)
def test_bad_optimizer_options_are_refused_with_the_fix(kwargs, needle):
  args = {"name": "adam", "lr": 1e-3, **kwargs}
  with pytest.raises(QsyncError, match="Fix:") as e:
    check_optimizer_options(args.pop("name"), args.pop("lr"), **args)
  assert needle in str(e.value)


@pytest.mark.parametrize(
  "flags, needle",
  [
    (["--schedule", "cosine", "--warmup-steps", "5"], "--warmup-steps 5 with --schedule cosine over 3 steps"),
    (["--clip-norm", "-1"], "clip_norm=-1.0 must be > 0"),
    (["--weight-decay", "0.1"], "decoupled weight decay is adamw's"),
  ],
)
def test_cli_refuses_bad_training_options_before_the_model_loads(tmp_path, capsys, flags, needle):
  # no_such_pkg: the task would fail to load, so this error proves the check came first
  code = cli.main(
    ["train", "--model", "no_such_pkg.mod:make", "--steps", "3", "--out", str(tmp_path / "r"), *flags]
  )
  err = capsys.readouterr().err
  assert code == 2 and needle in err and "Fix:" in err and "Traceback" not in err, err
  assert not (tmp_path / "r").exists()


def test_cli_trains_with_a_schedule_clipping_and_weight_decay(tmp_path, capsys):
  cluster = tmp_path / "c.json"
  ClusterSpec.uniform("cpu", 8, 1).save(str(cluster))
  flags = ["--optimizer", "adamw", "--weight-decay", "0.01", "--lr", "0.02", "--schedule", "cosine"]
  flags += ["--warmup-steps", "1", "--clip-norm", "0.5"]
  args = ["train", "--model", "tests.qsync_jax.train.tiny:make_task", "--cluster", str(cluster)]
  args += ["--steps", "3"]
  assert cli.main([*args, "--out", str(tmp_path / "run"), *flags]) == 0
  capsys.readouterr()
  lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  cosine = learning_rate_schedule(0.02, "cosine", warmup_steps=1, total_steps=3)
  np.testing.assert_allclose([line["lr"] for line in lines], [cosine(s) for s in range(3)], atol=1e-8)
  assert all(line["grad_norm"] > 0 for line in lines)
