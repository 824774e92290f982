"""Causal language modelling on the Python standard library's source (byte-level)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import optax

from examples.data import stdlib_text
from examples.models.transformer import BLOCKS, TransformerLM
from examples.tasks.config import make_config
from qsync_jax.errors import QsyncError
from qsync_jax.train.task import Task


def lm_inputs(batch):
  return (jnp.asarray(batch["tokens"])[:, :-1],)


def lm_loss(logits, batch):
  """Mean next-token cross-entropy (nats; perplexity = exp(loss)) and token accuracy."""
  logits = logits.astype(jnp.float32)
  targets = jnp.asarray(batch["tokens"])[:, 1:]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Byte-level causal LM. BERT-base-sized: d_model=768, num_heads=12, num_layers=12, seq_len=512."""

  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 64
  max_bytes: int = 2_000_000
  holdout_fraction: float = 0.1
  block: str = "gpt"
  """``TransformerLM.block``: ``gpt`` (pre-LayerNorm, GELU MLP) or ``llama`` (RMSNorm, SwiGLU, no biases)."""


def stdlib_lm(**overrides) -> Task:
  cfg = make_config(LMConfig, overrides, "lm")
  if cfg.block not in BLOCKS:
    raise QsyncError(f"task 'lm': block={cfg.block!r} is unknown. Fix: use one of {sorted(BLOCKS)}.")
  train, test = stdlib_text.load(cfg.max_bytes, cfg.holdout_fraction)
  model = TransformerLM(
    vocab_size=stdlib_text.VOCAB_SIZE,
    d_model=cfg.d_model,
    num_heads=cfg.num_heads,
    num_layers=cfg.num_layers,
    max_len=cfg.seq_len,
    block=cfg.block,
  )
  return Task(
    name="lm",
    model=model,
    inputs=lm_inputs,
    loss=lm_loss,
    train_batches=lambda global_batch, seed: stdlib_text.train_windows(
      train, cfg.seq_len, global_batch, seed
    ),
    eval_batches=functools.partial(stdlib_text.eval_windows, test, cfg.seq_len),
    tokens_per_example=cfg.seq_len,
  )


@dataclasses.dataclass(frozen=True)
class SyntheticLMConfig:
  """Causal LM on uniform random tokens, for step timing and planning at real size (the loss
  cannot fall below log(vocab_size): there is nothing to learn, and no held-out split).

  GPT-2 medium (355M parameters): ``vocab_size=50257, d_model=1024, num_heads=16,
  num_layers=24, seq_len=1024``; BERT-base-sized: ``vocab_size=30522, d_model=768,
  num_heads=12, num_layers=12, seq_len=128`` (or 512).
  """

  vocab_size: int = 256
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 64


def uniform_token_batches(cfg: SyntheticLMConfig, batch_size: int, seed: int):
  """``{"tokens": int32[batch, seq_len + 1]}`` drawn uniformly, deterministic given ``seed``, forever."""
  rng = np.random.default_rng(seed)
  while True:
    yield {"tokens": rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)).astype(np.int32)}


def synthetic_lm(**overrides) -> Task:
  cfg = make_config(SyntheticLMConfig, overrides, "lm_synthetic")
  model = TransformerLM(
    vocab_size=cfg.vocab_size,
    d_model=cfg.d_model,
    num_heads=cfg.num_heads,
    num_layers=cfg.num_layers,
    max_len=cfg.seq_len,
  )
  return Task(
    name="lm_synthetic",
    model=model,
    inputs=lm_inputs,
    loss=lm_loss,
    train_batches=functools.partial(uniform_token_batches, cfg),
    tokens_per_example=cfg.seq_len,
  )
