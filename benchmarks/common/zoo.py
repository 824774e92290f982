"""The benchmark models, each defined once: builders with parameters, and the named sizes the
benchmarks run (``MODELS``).

Builders (each returns a ``qsync_jax.Task``):

* ``mlp_task`` — ``MLP`` (``depth`` ReLU Dense layers of ``width``, a 10-way head) on standard-
  normal features and uniform labels;
* ``gpt`` — the examples' ``TransformerLM`` (pre-LN GPT blocks) at a width, depth, head count and
  sequence length: byte-level on the Python standard library's source (``vocab=None``,
  ``examples.tasks.language.stdlib_lm``) or on uniform random tokens of ``vocab``
  (``synthetic_lm``);
* ``llama`` — the examples' ``TransformerLM`` with Llama-style blocks (RMSNorm, attention and SwiGLU without biases) on
  uniform random tokens;
* ``resnet`` — the examples' ResNet on scikit-learn digits (``image_size=None``) or on random
  images of ``image_size`` (``resnet_synthetic``); ``vgg`` — the examples' VGG on digits;
* ``digits_cnn`` — two convolutions and two Dense layers on digits (``benchmarks.comm``);
* ``with_dtype`` — a task with its modules computing in another dtype (``benchmarks.e2e``'s bf16).

``MODELS`` names the sizes shared across benchmarks: ``get(name)`` is ``(task, per-device batch)``
and ``get(name, tiny=True)`` the same family at a CPU size (batch ``TINY_BATCH``). Three families
are functions of a width rather than entries: ``e2e_gpt``, ``e2e_llama`` and ``e2e_resnet50``
(``benchmarks.e2e``'s bf16 cells, their own tiny sizes kept as its committed CPU rows ran them). ``bert_ops`` is the one
model that is an op graph, not a Flax model (``benchmarks.allocator``: nothing runs).

Every builder draws its data from ``seed`` alone, so committed results stay comparable: the
same shapes, initial parameters, batches and op names for the same name and seed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from examples.data import digits
from examples.models.transformer import TransformerLM
from examples.tasks.language import (
  SyntheticLMConfig,
  lm_inputs,
  lm_loss,
  stdlib_lm,
  synthetic_lm,
  uniform_token_batches,
)
from examples.tasks.vision import classification_task, resnet_digits, resnet_synthetic, vgg_digits
from planners.ops import OpShape
from planners.profile import Profile
from qsync_jax.train.task import Task

# -- builders ---------------------------------------------------------------------------------


class MLP(nn.Module):
  """``depth`` ReLU Dense layers of ``width``, then a Dense head of ``classes``."""

  width: int = 1024
  depth: int = 3
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(self.classes)(x)


def mlp_task(features: int = 512, width: int = 1024, depth: int = 3, accuracy: bool = False) -> Task:
  """``MLP(width, depth)`` on ``{"x": normal [n, features], "label": int [n] in 0..9}``, cross-entropy
  loss; ``accuracy`` adds the batch accuracy as a metric (``benchmarks.trainer``'s step computes
  it, the predictor's does not)."""

  def batches(n, seed):
    rng = np.random.default_rng(seed)
    while True:
      yield {
        "x": rng.normal(size=(n, features)).astype(np.float32),
        "label": rng.integers(0, 10, n).astype(np.int32),
      }

  def loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    if not accuracy:
      return ce, {}
    return ce, {"accuracy": jnp.mean((jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32))}

  return Task("mlp", MLP(width, depth), lambda b: (b["x"],), loss, batches)


def with_dtype(task: Task, dtype) -> Task:
  """``task`` with every module computing in ``dtype`` (parameters stay float32)."""
  return dataclasses.replace(task, model=task.model.clone(dtype=dtype))


def gpt(
  width: int = 64,
  depth: int = 2,
  heads: int = 4,
  seq: int = 64,
  *,
  vocab: int | None = None,
  max_bytes: int | None = None,
  dtype=None,
  block: str = "gpt",
) -> Task:
  """A GPT of ``depth`` pre-LN blocks of ``width`` with ``heads`` attention heads over ``seq``
  tokens (``examples.models.transformer.TransformerLM``): byte-level on the standard library's
  source (``vocab=None``; its first ``max_bytes``, default 2 MB), or on uniform random tokens of a
  ``vocab``-sized vocabulary. ``dtype``: the modules' compute dtype (``with_dtype``). ``block``:
  ``"llama"`` for Llama-style blocks (RMSNorm, SwiGLU, no biases; byte-level only)."""
  shape = dict(d_model=width, num_heads=heads, num_layers=depth, seq_len=seq)
  if vocab is None:
    task = stdlib_lm(**shape, block=block, **({} if max_bytes is None else {"max_bytes": max_bytes}))
  elif block != "gpt":
    raise ValueError(
      "gpt: block='llama' is built for the byte corpus; random tokens (vocab=...) run GPT blocks."
    )
  elif max_bytes is not None:
    raise ValueError("gpt: max_bytes is the byte corpus's size; random tokens (vocab=...) have none.")
  else:
    task = synthetic_lm(vocab_size=vocab, **shape)
  return task if dtype is None else with_dtype(task, dtype)


def llama(width: int, depth: int, heads: int, seq: int, vocab: int, dtype=None) -> Task:
  """The examples' ``TransformerLM`` with Llama-style blocks (``block="llama"``: RMSNorm, a SwiGLU
  MLP of ``swiglu_hidden(width)``, no biases) of ``depth`` blocks of ``width`` (``heads`` heads) on
  uniform random tokens of a ``vocab``-sized vocabulary, sequences of ``seq``."""
  cfg = SyntheticLMConfig(vocab_size=vocab, d_model=width, num_heads=heads, num_layers=depth, seq_len=seq)
  model = TransformerLM(vocab, width, heads, depth, seq, dtype, block="llama")
  return Task("llama_synthetic", model, lm_inputs, lm_loss, functools.partial(uniform_token_batches, cfg))


def resnet(image_size: int | None = None, **config) -> Task:
  """The examples' ResNet: on scikit-learn digits (``image_size=None``; ``resnet_digits``'s
  options), else on random images of ``image_size``² (``resnet_synthetic``'s options)."""
  return resnet_digits(**config) if image_size is None else resnet_synthetic(image_size=image_size, **config)


def vgg(**config) -> Task:
  """The examples' VGG on scikit-learn digits (``vgg_digits``'s options)."""
  return vgg_digits(**config)


class DigitsCNN(nn.Module):
  """Two convolutions and two dense layers (~140k parameters)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
    x = nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1))))
    return nn.Dense(10)(x)


def digits_cnn() -> Task:
  """``DigitsCNN`` on scikit-learn digits (20 % held out, split seed 0), no mutable state."""
  train, test = digits.load(0.2, 0)
  return dataclasses.replace(classification_task("digits_cnn", DigitsCNN(), train, test), mutable=())


# -- named sizes ------------------------------------------------------------------------------

RESNET50 = dict(
  image_size=224,
  stage_sizes=(3, 4, 6, 3),
  widths=(64, 128, 256, 512),
  num_classes=1000,
  imagenet_stem=True,
  block="bottleneck",
)
"""ResNet-50 on random 224×224 images (bottleneck blocks, ImageNet stem, 1000 classes)."""
RESNET18 = dict(stage_sizes=(2, 2, 2, 2), widths=(64, 128, 256, 512))
BERT_BASE = dict(width=768, depth=12, heads=12, vocab=30522)
"""A BERT-base-sized causal LM on random tokens (its sequence length apart)."""
GPT2_MEDIUM = dict(width=1024, depth=24, heads=16, seq=1024, vocab=50257)
GPT2_LARGE = dict(width=1280, depth=36, heads=20, seq=1024, vocab=50257)
"""GPT-2 large's shape: 774 M parameters (3.1 GB in fp32, its Adam state twice that: no T4 holds it
with its gradient and state at 16 bits unless the state is sharded)."""
GPT_25M = dict(width=512, depth=8, heads=8, seq=256, max_bytes=24_000_000)
"""``benchmarks.accuracy_gpu``'s testbed: 25.3 M parameters on the first 24 MB of the standard
library's source."""
TINY_BATCH = 2


@dataclasses.dataclass(frozen=True)
class Entry:
  """A named model: ``build(**config)`` at ``batch`` per device; ``tiny``: the builder's options
  at a CPU size (the same family, for smoke runs and tests)."""

  build: Callable[..., Task]
  config: dict
  batch: int
  tiny: dict


_TINY_LM = dict(width=16, depth=1, heads=2, seq=16, max_bytes=100_000)
_TINY_VGG = dict(stages=((4,), (8,)), hidden=8)
_TINY_RESNET = dict(stage_sizes=(1,), widths=(4,))

MODELS: dict[str, Entry] = {
  # benchmarks.predictor's CPU sizes (a step of tens of ms) ...
  "mlp": Entry(mlp_task, {}, 128, dict(features=8, width=16, depth=2)),
  "lm": Entry(gpt, dict(width=128, depth=2, heads=4, seq=64, max_bytes=200_000), 16, _TINY_LM),
  "vgg": Entry(vgg, {}, 64, _TINY_VGG),
  "resnet": Entry(resnet, {}, 64, _TINY_RESNET),
  # ... and its GPU sizes: a 4096-wide MLP, VGGs with 64-256 and 128-512 channels on digits, a
  # BERT-base-wide LM (4 layers) and ResNet-18 on digits and on 224×224 images
  "mlp_base": Entry(mlp_task, dict(features=1024, width=4096), 4096, dict(features=8, width=16)),
  # its H100 step is paced by the host: 0.57 ms of kernels in 1.3-1.6 ms
  "vgg_base": Entry(vgg, dict(stages=((64, 64), (128, 128), (256, 256)), hidden=512), 512, _TINY_VGG),
  # twice the channels, twice the batch: kernel-bound on an H100
  "vgg_wide": Entry(vgg, dict(stages=((128, 128), (256, 256), (512, 512)), hidden=1024), 1024, _TINY_VGG),
  "lm_base": Entry(gpt, dict(width=768, depth=4, heads=12, seq=256, max_bytes=2_000_000), 16, _TINY_LM),
  "resnet18": Entry(resnet, RESNET18, 256, _TINY_RESNET),
  # ResNet-18 at ImageNet size (synthetic 224×224 images, 1000 classes): a GPU-sized CNN
  "resnet18_224": Entry(
    resnet,
    dict(image_size=224, **RESNET18, num_classes=1000, imagenet_stem=True),
    64,
    dict(image_size=16, stage_sizes=(1,), widths=(4,), num_classes=10),
  ),
  # the hybrid-pool study's models at real size (benchmarks.hybrid, benchmarks.diagnosis.roofline)
  "resnet50": Entry(
    resnet,
    RESNET50,
    32,
    dict(image_size=16, stage_sizes=(1, 1), widths=(8, 16), num_classes=10, block="bottleneck"),
  ),
  "bert_s128": Entry(gpt, dict(BERT_BASE, seq=128), 32, dict(vocab=64, width=32, heads=2, depth=1, seq=16)),
  "bert_s512": Entry(gpt, dict(BERT_BASE, seq=512), 8, dict(vocab=64, width=32, heads=2, depth=1, seq=16)),
  "gpt_350m": Entry(gpt, GPT2_MEDIUM, 8, dict(vocab=96, width=32, heads=2, depth=2, seq=32)),
  "gpt_774m": Entry(gpt, GPT2_LARGE, 8, dict(vocab=96, width=32, heads=2, depth=2, seq=32)),
  # benchmarks.accuracy_gpu's testbed (batch: the global 64 sequences of a step)
  "gpt_25m": Entry(gpt, GPT_25M, 64, _TINY_LM),
  # benchmarks.comm's (batch: the global batch over its 8 simulated devices)
  "digits_cnn": Entry(digits_cnn, {}, 64, {}),
}
"""Every named model: name → ``Entry``."""

HYBRID_MODELS = ("resnet50", "bert_s128", "bert_s512", "gpt_350m", "gpt_774m")
"""The models the hybrid-pool study plans (ResNet-50 at 224², a BERT-base-sized transformer at
sequence 128 and 512, GPT-2-medium- and GPT-2-large-sized LMs at sequence 1024)."""


def get(name: str, tiny: bool = False) -> tuple[Task, int]:
  """``(task, per-device batch)`` of the model ``name`` (``MODELS``); ``tiny``: its CPU size at
  batch ``TINY_BATCH``. An unknown name is a SystemExit naming the known ones."""
  if name not in MODELS:
    raise SystemExit(f"unknown model {name!r}. Fix: use one of {sorted(MODELS)}.")
  entry = MODELS[name]
  if tiny:
    return entry.build(**entry.tiny), TINY_BATCH
  return entry.build(**entry.config), entry.batch


def task(name: str) -> Task:
  """The task of the model ``name`` at its size (``get``)."""
  return get(name)[0]


def e2e_gpt(width: int, tiny: bool = False) -> tuple[Task, int]:
  """``(task with bf16 modules, batch size)`` of ``benchmarks.e2e``'s GPT at ``width``: random
  tokens of a 32768 vocabulary, 4 blocks, heads of 64 (width ≤ 1024) or 128 dims, sequence 1024
  × batch 8; ``tiny``: vocabulary 256, 2 blocks, heads of 16, sequence 32 × batch 4."""
  if tiny:
    return gpt(width, 2, max(1, width // 16), 32, vocab=256, dtype=jnp.bfloat16), 4
  return gpt(width, 4, width // (64 if width <= 1024 else 128), 1024, vocab=32768, dtype=jnp.bfloat16), 8


def e2e_llama(width: int, tiny: bool = False) -> tuple[Task, int]:
  """``(task with bf16 modules, batch size)`` of ``benchmarks.e2e``'s Llama-style model at
  ``width`` (``llama``): as ``e2e_gpt`` (4 blocks, heads of 64 or 128 dims, 32768 tokens of
  vocabulary, sequence 1024 × batch 8); ``tiny``: as ``e2e_gpt``'s tiny size."""
  if tiny:
    return llama(width, 2, max(1, width // 16), 32, 256, jnp.bfloat16), 4
  return llama(width, 4, width // (64 if width <= 1024 else 128), 1024, 32768, jnp.bfloat16), 8


def e2e_resnet50(tiny: bool = False) -> tuple[Task, int]:
  """``(task with bf16 modules, batch size)`` of ``benchmarks.e2e``'s ResNet-50 (``RESNET50``,
  batch 32); ``tiny``: two bottleneck stages of 4 and 8 channels on 16×16 images, batch 2."""
  if tiny:
    cfg = dict(image_size=16, stage_sizes=(1, 1), widths=(4, 8), block="bottleneck", num_classes=10)
    return with_dtype(resnet(**cfg), jnp.bfloat16), 2
  return with_dtype(resnet(**RESNET50), jnp.bfloat16), 32


# -- op graphs --------------------------------------------------------------------------------


def bert_ops(batch=12, seq=384, d=768, heads=12, layers=12, ff=3072, vocab=30522) -> list[OpShape]:
  """The quantizable ops of BERT-base (SQuAD-like: sequence 384, a 2-way QA head) as canonical
  GEMMs (``planners.ops``): embedding, Q/K/V/out projections, both attention products, the MLP."""
  t = batch * seq

  def dense(name, k, n, kind="dense_general"):
    return OpShape(name, kind, 1, t, k, n, 1, t * k, k * n, t * n)

  ops = [OpShape("embed:embed", "embed", 1, t, vocab, d, 1, t * vocab, vocab * d, t * d)]
  bh = batch * heads
  for i in range(layers):
    p = f"layer_{i}"
    ops += [dense(f"{p}/attn/{x}:dense_general", d, d) for x in ("query", "key", "value")]
    ops.append(
      OpShape(
        f"{p}/attn:attention_qk", "attention_qk", bh, seq, d // heads, seq, 1, t * d, t * d, bh * seq * seq
      )
    )
    ops.append(
      OpShape(
        f"{p}/attn:attention_pv", "attention_pv", bh, seq, seq, d // heads, 1, bh * seq * seq, t * d, t * d
      )
    )
    ops.append(dense(f"{p}/attn/out:dense_general", d, d))
    ops.append(dense(f"{p}/mlp/up:dense", d, ff, "dense"))
    ops.append(dense(f"{p}/mlp/down:dense", ff, d, "dense"))
  ops.append(dense("qa_head:dense", d, 2, "dense"))
  return ops


def bert_profile(batch=12) -> Profile:
  """``bert_ops`` as a profile with no costs (what ``planners.predictor.modeled`` costs), 110 M
  fp32 parameters."""
  ops = tuple(bert_ops(batch))
  params = 110_000_000 * 4
  memory = {"param_bytes": params, "opt_state_bytes": 2 * params, "batch_bytes": 0, "other_bytes": 0}
  return Profile("bert-base", "traced", "traced", batch, ops, {}, {}, 0.0, {}, memory)
