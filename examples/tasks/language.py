"""Causal language modelling: on the Python standard library's source (byte-level), or on
random tokens (step timing)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import optax

from examples.data import stdlib_text
from examples.models.transformer import TransformerLM
from examples.tasks.config import make_config
from qsync_jax.task import Task


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


def stdlib_lm(**overrides) -> Task:
  cfg = make_config(LMConfig, overrides, "lm")
  train, test = stdlib_text.load(cfg.max_bytes, cfg.holdout_fraction)
  model = TransformerLM(
    vocab_size=stdlib_text.VOCAB_SIZE,
    d_model=cfg.d_model,
    num_heads=cfg.num_heads,
    num_layers=cfg.num_layers,
    max_len=cfg.seq_len,
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
  )


@dataclasses.dataclass(frozen=True)
class LMSyntheticConfig:
  """A GPT-style causal LM on uniform random tokens, for step timing (no held-out split: the
  tokens are noise)."""

  vocab_size: int = 256
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 64


def random_token_batches(cfg: LMSyntheticConfig, batch_size: int, seed: int):
  """Uniform random ``{"tokens": int32[batch, seq_len + 1]}``, deterministic given ``seed``, forever."""
  rng = np.random.default_rng(seed)
  while True:
    yield {"tokens": rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)).astype(np.int32)}


def synthetic_lm(**overrides) -> Task:
  cfg = make_config(LMSyntheticConfig, overrides, "lm_synthetic")
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
    train_batches=functools.partial(random_token_batches, cfg),
  )
