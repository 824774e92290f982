"""``benchmarks/common/zoo.py``: every model builds and runs a forward pass at its tiny size on the
CPU, and the named sizes keep the parameter counts the committed results were measured at."""

import jax
import numpy as np
import pytest

from benchmarks.common import zoo


def _forward(task, batch_size: int, seed: int = 0):
  """``(logits, batch)``: the model initialised from ``seed`` on its first batch of ``seed``."""
  batch = next(task.train_batches(batch_size, seed))
  inputs = task.inputs(batch)
  variables = task.model.init(jax.random.key(seed), *inputs, **task.train_kwargs)
  out = task.model.apply(variables, *inputs, **task.train_kwargs, mutable=task.mutable or False)
  return (out[0] if task.mutable else out), batch


def _outputs(entry: zoo.Entry, batch: int) -> tuple[int, ...]:
  """The logits' shape the entry's family gives at its tiny size."""
  cfg = entry.tiny
  if entry.build is zoo.gpt:
    return (batch, cfg["seq"], cfg.get("vocab") or 256)  # byte-level without a vocabulary
  return (batch, cfg.get("num_classes", 10))  # digits, the MLP's labels: 10 classes


@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_every_model_runs_a_forward_pass_at_its_tiny_size(name):
  task, batch_size = zoo.get(name, tiny=True)
  assert batch_size == zoo.TINY_BATCH
  logits, batch = _forward(task, batch_size)
  assert logits.shape == _outputs(zoo.MODELS[name], batch_size)
  assert np.isfinite(np.asarray(logits)).all()
  loss, _ = task.loss(logits, batch)
  assert np.isfinite(float(loss))
  again = next(zoo.get(name, tiny=True)[0].train_batches(batch_size, 0))  # seeded: the same data
  assert all(np.array_equal(batch[k], again[k]) for k in batch)


@pytest.mark.standard_promotion  # Flax's norms promote bf16 activations to float32
@pytest.mark.parametrize("family", [lambda: zoo.e2e_gpt(32, tiny=True), lambda: zoo.e2e_resnet50(tiny=True)])
def test_the_e2e_families_run_in_bf16_at_their_tiny_size(family):
  task, batch_size = family()
  logits, _ = _forward(task, batch_size)
  assert task.model.dtype == jax.numpy.bfloat16 and logits.shape[0] == batch_size
  assert np.isfinite(np.asarray(logits)).all()
  # the head computes in bf16: its float32 logits are bf16 values
  np.testing.assert_array_equal(logits, logits.astype(jax.numpy.bfloat16).astype(logits.dtype))


PARAMETERS = {  # the named sizes' parameter counts (traced abstractly, nothing allocated)
  "resnet50": 25_557_032,
  "resnet18_224": 11_689_512,
  "bert_s128": 132_066_618,
  "gpt_350m": 406_336_593,
  "gpt_25m": 25_613_568,
  "lm_base": 28_943_104,
  "mlp_base": 37_801_994,
}


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_named_sizes_keep_their_parameter_counts(name):
  entry = zoo.MODELS[name]
  config = dict(entry.config)
  if "max_bytes" in config:  # the byte corpus's size sets no parameter: read less of it
    config["max_bytes"] = 100_000
  task = entry.build(**config)
  inputs = task.inputs(next(task.train_batches(1, 0)))
  variables = jax.eval_shape(lambda: task.model.init(jax.random.key(0), *inputs, **task.train_kwargs))
  assert sum(x.size for x in jax.tree.leaves(variables["params"])) == PARAMETERS[name]


def test_the_op_graph_and_unknown_names():
  ops = zoo.bert_ops()
  assert len(ops) == 98 and ops[0].kind == "embed" and ops[-1].name == "qa_head:dense"
  assert zoo.bert_profile().ops == tuple(ops)
  with pytest.raises(SystemExit, match="unknown model 'nope'"):
    zoo.get("nope")
  with pytest.raises(ValueError, match="max_bytes"):
    zoo.gpt(vocab=64, max_bytes=1000)
