"""Model adapters: ``quantize(model, policy)`` for ``flax.linen`` and ``flax.nnx`` models, through
Flax's own hooks (``dot_general=``, ``conv_general_dilated=``, einsum hooks)."""
