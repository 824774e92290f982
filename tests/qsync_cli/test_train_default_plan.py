"""``qsync train`` without ``--plan`` runs each group at its device type's 16-bit training precision
(``qsync_jax.devices.training_precision``, the rule ``qsync plan`` uses for training groups), and its
first line says so. The trainer is stopped at its construction: nothing is compiled."""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import pytest

from qsync_cli import main as cli
from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.policy import PrecisionPolicy
from qsync_jax.train import trainer
from tests.qsync_jax.train.tiny import make_task


class Built(Exception):
  """Raised by the stubbed Trainer with the plan it was given."""


@pytest.fixture
def built_plan(monkeypatch):
  def init(self, task, cluster, plan, *args, **kwargs):
    raise Built(plan)

  monkeypatch.setattr(trainer.Trainer, "__init__", init)

  def run(*argv):
    with pytest.raises(Built) as e:
      cli.main(["train", "--steps", "1", *argv])
    return e.value.args[0]

  return run


class NoOps(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(x) @ self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 3))


def no_ops_task():
  """``tiny.make_task`` with a model that calls no quantizable op."""
  return dataclasses.replace(make_task(), model=NoOps())


def test_each_group_runs_its_16bit_training_precision_and_the_first_line_says_so(
  built_plan, tmp_path, capsys
):
  model = ["--model", "tests.qsync_jax.train.tiny:make_task", "--out", str(tmp_path / "r")]
  plan = built_plan(*model)  # the 8 simulated CPU devices: bf16
  assert plan.policies == {"all": PrecisionPolicy.uniform("bf16")}
  assert (
    "group 'all' 8 × cpu at 8 per device, bf16; plan: each group's 16-bit default" in capsys.readouterr().err
  )
  spec = tmp_path / "c.json"
  ClusterSpec((DeviceGroup("v", "V100", 4, 32, 2), DeviceGroup("a", "A100", 4, 40, 2))).save(str(spec))
  plan = built_plan(*model, "--cluster", str(spec))
  assert plan.policies == {"v": PrecisionPolicy.uniform("fp16"), "a": PrecisionPolicy.uniform("bf16")}
  assert plan.needs_fp16_loss_scaling  # the trainer scales the loss
  # a strategy that builds its own step has no loss scaling: the V100s run the model as written
  plan = built_plan(*model, "--cluster", str(spec), "--sync", "selsync")
  assert plan.policies == {"a": PrecisionPolicy.uniform("bf16")}
  plan = built_plan(
    "--model", "tests.qsync_cli.test_train_default_plan:no_ops_task", "--out", str(tmp_path / "r")
  )
  assert plan.policies == {}  # nothing to run at 16 bits: the model as written
  assert "group 'all' 8 × cpu at 8 per device, float" in capsys.readouterr().err
