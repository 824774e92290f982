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
