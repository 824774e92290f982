"""A decoder-only (causal) transformer LM from stock Flax layers.

``nn.Embed`` (tokens and learned positions), pre-LayerNorm blocks of
``nn.MultiHeadDotProductAttention`` (causal mask) and a GELU MLP of ``nn.Dense``, and a
``nn.Dense`` head. Defaults are tiny for a CPU; BERT-base-sized is
``TransformerLM(d_model=768, num_heads=12, num_layers=12, max_len=512)``.
Module paths read ``embed``, ``pos_embed``, ``block0/attn/query``, ``block0/mlp_in``, ``head``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class Block(nn.Module):
  d_model: int
  num_heads: int
  mlp_ratio: int = 4
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
    h = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads, qkv_features=self.d_model, dtype=self.dtype, deterministic=True, name="attn"
    )(h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * self.d_model, dtype=self.dtype, name="mlp_in")(h))
    return x + nn.Dense(self.d_model, dtype=self.dtype, name="mlp_out")(h)


class TransformerLM(nn.Module):
  """Token ids int[B, T] → next-token logits float32[B, T, vocab_size]."""

  vocab_size: int = 256
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  max_len: int = 256
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, tokens):
    seq_len = tokens.shape[-1]
    if seq_len > self.max_len:
      raise ValueError(
        f"TransformerLM: sequence length {seq_len} exceeds max_len={self.max_len}. "
        "Fix: raise max_len or shorten the sequences."
      )
    x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
    # Positions per example (0..T-1 of each row), derived from the tokens so that, inside a
    # data-parallel shard_map, they vary over the data axis like every other activation.
    positions = jnp.cumsum(jnp.ones_like(tokens), axis=-1) - 1
    x = x + nn.Embed(self.max_len, self.d_model, name="pos_embed")(positions)
    mask = nn.make_causal_mask(tokens)
    for i in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, dtype=self.dtype, name=f"block{i}")(x, mask)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x).astype(jnp.float32)
