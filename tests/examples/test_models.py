"""The example models at their published sizes (shapes only: nothing is computed)."""

import jax
import jax.numpy as jnp
import pytest

from examples.models.resnet import ResNet


def _param_count(model, *args, **kwargs) -> int:
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
  return sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))


@pytest.mark.parametrize(
  "stage_sizes, block, params",
  [((2, 2, 2, 2), "basic", 11_689_512), ((3, 4, 6, 3), "bottleneck", 25_557_032)],
  ids=["resnet18", "resnet50"],
)
def test_resnet_parameter_counts_match_the_published_models(stage_sizes, block, params):
  model = ResNet(stage_sizes, (64, 128, 256, 512), num_classes=1000, imagenet_stem=True, block=block)
  assert _param_count(model, jnp.zeros((1, 224, 224, 3)), train=False) == params


def test_resnet_rejects_an_unknown_block():
  with pytest.raises(ValueError, match="block='wide'"):
    _param_count(ResNet(block="wide"), jnp.zeros((1, 8, 8, 1)), train=False)


def test_gpt2_medium_sized_synthetic_lm_has_355m_parameters():
  from examples.tasks.language import synthetic_lm

  task = synthetic_lm(vocab_size=50257, d_model=1024, num_heads=16, num_layers=24, seq_len=1024)
  batch = next(task.train_batches(2, 0))
  assert batch["tokens"].shape == (2, 1025) and batch["tokens"].max() < 50257
  # GPT-2 medium ties its head to the token embedding (354.8M); this model's head is untied.
  assert _param_count(task.model, *task.inputs(batch)) == pytest.approx(355e6 + 50257 * 1024, rel=0.01)
