"""Unmodified ``flax.linen`` models of the examples."""
