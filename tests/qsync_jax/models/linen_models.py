"""Small stock-Flax models used by the foundation tests (no qsync code inside)."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class SmallCNN(nn.Module):
  """Conv + BatchNorm + Dense."""

  classes: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
    x = nn.relu(x)
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.classes)(x)


class SmallTransformer(nn.Module):
  """Embed → stock MultiHeadDotProductAttention (causal) → MLP → tied-embedding logits."""

  vocab: int = 16
  width: int = 32

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(self.vocab, self.width)
    h = embed(ids) + self.param("pos", nn.initializers.normal(0.02), (ids.shape[-1], self.width))
    mask = nn.make_causal_mask(ids)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(nn.LayerNorm()(h), mask=mask)
    y = nn.LayerNorm()(h)
    h = h + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(y)))
    h = nn.Einsum((self.width, self.width), "btd,de->bte", name="mix")(h)
    return embed.attend(nn.LayerNorm()(h))


def cnn_data(key, n=64):
  """Images whose class is the argmax of a fixed random projection (learnable)."""
  kx, kp = jax.random.split(key)
  x = jax.random.normal(kx, (n, 8, 8, 1), jnp.float32)
  proj = jax.random.normal(jax.random.key(42), (64, 4), jnp.float32)
  y = jnp.argmax(x.reshape(n, -1) @ proj, axis=-1)
  return x, y


def lm_data(key, n=32, length=12, vocab=16):
  """Sequences counting up modulo ``vocab`` from a random start: next token is learnable."""
  start = jax.random.randint(key, (n, 1), 0, vocab)
  return (start + jnp.arange(length + 1)[None, :]) % vocab
