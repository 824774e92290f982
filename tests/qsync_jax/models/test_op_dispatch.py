"""The interceptors' dispatch tables (``flax_quant.LINEN_OP_HOOKS``, ``nnx_quant.NNX_OP_HOOKS``) and
the quantized op of each kind (``quant_ops.QUANTIZED_OP_OF_KIND``) cover every op kind a policy
can name, each once: a kind added to ``OP_KINDS`` without a handler fails here."""

from __future__ import annotations

import collections

import flax.linen as nn
from flax import nnx

from qsync_jax.models.flax_quant import LINEN_OP_HOOKS
from qsync_jax.models.nnx_quant import NNX_OP_HOOKS, hook_of
from qsync_jax.ops.quant_ops import QUANTIZED_OP_OF_KIND
from qsync_jax.policy import OP_KINDS


def _kind_counts(hooks) -> dict[str, int]:
  return dict(collections.Counter(kind for hook in hooks for kind in hook.kinds))


def test_every_op_kind_has_one_handler_and_one_quantized_op():
  assert set(QUANTIZED_OP_OF_KIND) == set(OP_KINDS)
  assert _kind_counts(LINEN_OP_HOOKS) == dict.fromkeys(OP_KINDS, 1)
  assert _kind_counts(NNX_OP_HOOKS) == dict.fromkeys(OP_KINDS, 1)


def test_each_linen_module_method_has_one_entry():
  keys = [(hook.module_type, hook.method) for hook in LINEN_OP_HOOKS]
  assert len(keys) == len(set(keys))
  assert (nn.Embed, "attend") in keys and (nn.Embed, "__call__") in keys


def test_an_nnx_embed_with_its_own_lookup_is_left_alone():
  class OwnLookup(nnx.Embed):
    def __call__(self, inputs):
      return self.embedding[...][inputs] * 2

  plain = nnx.Embed(4, 3, rngs=nnx.Rngs(0))
  assert hook_of(plain).kinds == ("embed", "embed_attend")
  assert hook_of(OwnLookup(4, 3, rngs=nnx.Rngs(0))) is None
  assert hook_of(nnx.Dropout(0.5)) is None
