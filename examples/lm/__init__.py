"""Causal language-model example on the Python standard library's source."""
