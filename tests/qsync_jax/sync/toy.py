"""A tiny two-layer classifier and random data, shared by the SelSync / QSDP / checkpoint tests."""

import jax
import jax.numpy as jnp

FEATURES, HIDDEN, CLASSES = 24, 64, 5


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {
    "hidden": {
      "kernel": jax.random.normal(k1, (FEATURES, HIDDEN)) / FEATURES**0.5,
      "bias": jnp.zeros((HIDDEN,)),
    },
    "out": {"kernel": jax.random.normal(k2, (HIDDEN, CLASSES)) / HIDDEN**0.5, "bias": jnp.zeros((CLASSES,))},
  }


def logits(params, x):
  h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  return h @ params["out"]["kernel"] + params["out"]["bias"]


def loss_fn(params, batch, key):
  """Mean cross-entropy of the local batch (``key`` unused: the model is deterministic)."""
  del key
  logp = jax.nn.log_softmax(logits(params, batch["x"]))
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def make_batch(key, size):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (size, FEATURES))
  y = jax.random.randint(ky, (size,), 0, CLASSES)
  return {"x": x, "y": y}
