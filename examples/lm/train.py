"""Trains the byte-level causal transformer LM on the Python standard library's source.

Examples:
  >>> from examples.lm.train import Config, train_and_evaluate
  >>> result = train_and_evaluate(Config(steps=1), log=None)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

from examples import train_loop
from examples.tasks.language import stdlib_lm


@dataclasses.dataclass(frozen=True)
class Config(train_loop.LoopConfig):
  """Defaults: a 2-layer, 64-wide LM on 64-byte windows."""

  steps: int = 300
  batch_size: int = 32
  learning_rate: float = 3e-3
  eval_max_batches: int | None = 8  # held-out windows: 8 × eval_batch_size
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 64


def train_and_evaluate(config: Config, log=print) -> dict[str, Any]:
  task = stdlib_lm(
    d_model=config.d_model,
    num_heads=config.num_heads,
    num_layers=config.num_layers,
    seq_len=config.seq_len,
  )
  loop_fields = {f.name for f in dataclasses.fields(train_loop.LoopConfig)}
  loop_config = train_loop.LoopConfig(
    **{k: v for k, v in dataclasses.asdict(config).items() if k in loop_fields}
  )
  result = train_loop.train_and_evaluate(task, loop_config, log)
  if result["eval"]:
    result["eval"]["perplexity"] = train_loop.perplexity(result["eval"]["loss"])
    if log is not None:
      log(f"held-out perplexity {result['eval']['perplexity']:.3f}")
  return result
