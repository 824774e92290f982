"""Small stock-nnx models for the nnx tests (no qsync code inside), twins of ``linen_models.py``."""

import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  """Pre-norm block: causal MultiHeadAttention (with attention dropout) and a GELU MLP."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, width, dropout_rate=0.1, decode=False, rngs=rngs)
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.down = nnx.Linear(2 * width, width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, h, train: bool):
    mask = nnx.make_causal_mask(h[..., 0])
    h = h + self.attn(self.norm(h), mask=mask, deterministic=not train)
    return h + self.drop(self.down(nnx.gelu(self.up(h))), deterministic=not train)


class LM(nnx.Module):
  """Embed → 2 blocks (an nnx.List) → Einsum → tied-embedding logits."""

  def __init__(self, rngs: nnx.Rngs, vocab: int = 16, width: int = 32):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, rngs) for _ in range(2)])
    self.mix = nnx.Einsum("btd,de->bte", (width, width), rngs=rngs)

  def __call__(self, ids, train: bool = False):
    h = self.embed(ids)
    for block in self.blocks:
      h = block(h, train)
    return self.embed.attend(self.mix(h))


LM_OPS = {
  "embed:embed",
  "embed:embed_attend",
  "mix:einsum",
  *(
    f"blocks/{i}/{op}"
    for i in range(2)
    for op in (
      "attn/query:dense_general",
      "attn/key:dense_general",
      "attn/value:dense_general",
      "attn/out:dense_general",
      "attn:attention_qk",
      "attn:attention_pv",
      "up:dense",
      "down:dense",
    )
  ),
}


class CNN(nnx.Module):
  """Conv + BatchNorm + Conv + LinearGeneral over the flattened features."""

  def __init__(self, rngs: nnx.Rngs, classes: int = 4):
    self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(2, 2), rngs=rngs)
    self.head = nnx.LinearGeneral((4, 4, 8), classes, axis=(-3, -2, -1), rngs=rngs)

  def __call__(self, x, train: bool = True):
    x = nnx.relu(self.norm(self.conv1(x), use_running_average=not train))
    return self.head(nnx.relu(self.conv2(x)))


CNN_OPS = {"conv1:conv", "conv2:conv", "head:dense_general"}


def lm_ids(n: int = 4, length: int = 12, vocab: int = 16):
  """Sequences counting up modulo ``vocab``."""
  return (jnp.arange(length)[None, :] + jnp.arange(n)[:, None]) % vocab
