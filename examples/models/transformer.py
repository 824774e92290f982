"""A decoder-only (causal) transformer LM from stock Flax layers.

``nn.Embed`` (tokens and learned positions), pre-LayerNorm blocks of
``nn.MultiHeadDotProductAttention`` (causal mask) and a GELU MLP of ``nn.Dense``, and a
``nn.Dense`` head. Defaults are tiny for a CPU; BERT-base-sized is
``TransformerLM(d_model=768, num_heads=12, num_layers=12, max_len=512)``.
Module paths read ``embed``, ``pos_embed``, ``block0/attn/query``, ``block0/mlp_in``, ``head``.

``block="llama"``: Llama-style blocks instead (``LlamaBlock``: RMSNorm, SwiGLU, no biases
anywhere, the final norm RMSNorm and the head without bias); positions stay learned embeddings
(no rotary embedding), so the attention is the stock module Flax fuses. Its MLP's paths read
``block0/mlp_gate``, ``block0/mlp_up``, ``block0/mlp_down``.
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


def swiglu_hidden(d_model: int) -> int:
  """The SwiGLU width of ``LlamaBlock``: 8/3 of ``d_model`` (the parameters of a 4× GELU MLP),
  rounded up to a multiple of 256 (or of ``d_model`` when smaller), as Llama rounds it."""
  multiple = min(256, d_model)
  return -(-int(8 * d_model / 3) // multiple) * multiple


class LlamaBlock(nn.Module):
  """A pre-norm block as Llama's: RMSNorm, attention without biases, RMSNorm, a SwiGLU MLP
  (``mlp_down(silu(mlp_gate(h)) * mlp_up(h))``) without biases."""

  d_model: int
  num_heads: int
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x, mask):
    h = nn.RMSNorm(dtype=self.dtype, name="norm1")(x)
    h = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads,
      qkv_features=self.d_model,
      use_bias=False,
      dtype=self.dtype,
      deterministic=True,
      name="attn",
    )(h, mask=mask)
    x = x + h
    h = nn.RMSNorm(dtype=self.dtype, name="norm2")(x)
    hidden = swiglu_hidden(self.d_model)
    gate = nn.Dense(hidden, use_bias=False, dtype=self.dtype, name="mlp_gate")(h)
    up = nn.Dense(hidden, use_bias=False, dtype=self.dtype, name="mlp_up")(h)
    return x + nn.Dense(self.d_model, use_bias=False, dtype=self.dtype, name="mlp_down")(nn.silu(gate) * up)


BLOCKS = {"gpt": Block, "llama": LlamaBlock}
"""``TransformerLM.block``: the block each name builds."""


class TransformerLM(nn.Module):
  """Token ids int[B, T] → next-token logits float32[B, T, vocab_size]."""

  vocab_size: int = 256
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  max_len: int = 256
  dtype: jnp.dtype | None = None
  block: str = "gpt"

  @nn.compact
  def __call__(self, tokens):
    if self.block not in BLOCKS:
      raise ValueError(f"TransformerLM: block={self.block!r} is unknown. Fix: use one of {sorted(BLOCKS)}.")
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
    llama = self.block == "llama"
    for i in range(self.num_layers):
      x = BLOCKS[self.block](self.d_model, self.num_heads, dtype=self.dtype, name=f"block{i}")(x, mask)
    x = (nn.RMSNorm if llama else nn.LayerNorm)(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.vocab_size, use_bias=not llama, dtype=self.dtype, name="head")(x).astype(jnp.float32)
