"""``auto_policy``'s result on disk, so that a second search of the same case loads it.

A result is keyed by everything that decides it (``key_fields``): the model's structure (a hash of
the training loss's jaxpr under the all-base policy: every op, shape and dtype, the attention's
implementation; and of the batch's shapes), the batch per device, the device kind and platform,
the library versions (qsync-jax, jax, jaxlib), the base precision, the presets tried, the accuracy
budget and the indicator's source (its settings, or a hash of a given table). A changed model,
batch, device, version or option is another key, so it is measured anew. One file per key,
``DIR/auto-<key>.json``, written atomically; a file that cannot be read or whose fields differ
from the key's is ignored (and measured over).

The default directory (``default_dir``) is ``$QSYNC_CACHE_DIR/auto``, else
``$XDG_CACHE_HOME/qsync-jax/auto``, else ``~/.cache/qsync-jax/auto``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax

from qsync_jax.errors import PlanError
from qsync_jax.jsonio import write_text_atomic

FORMAT = "qsync-auto-policy/1"


def default_dir() -> str:
  """The cache directory ``qsync train --plan auto`` uses (module docstring)."""
  if os.environ.get("QSYNC_CACHE_DIR"):
    return os.path.join(os.environ["QSYNC_CACHE_DIR"], "auto")
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "qsync-jax", "auto")


def digest(obj: Any) -> str:
  """SHA-256 of ``obj`` as canonical JSON (sorted keys)."""
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def model_fingerprint(task, policy, batch, seed: int = 0) -> str:
  """SHA-256 of the jaxpr of ``task``'s training loss under ``policy`` on abstract variables and
  ``batch``'s shapes (traced, nothing computed or compiled), with object addresses removed."""
  from qsync_jax.train.task_step import task_loss
  from qsync_jax.train.train_step import init_variables

  variables = jax.eval_shape(lambda b: init_variables(task, seed, b)[0], batch)
  loss = task_loss(task, policy)
  jaxpr = jax.make_jaxpr(lambda v, b, k: loss(v, b, k)[0])(variables, batch, jax.random.key(seed))
  return hashlib.sha256(_ADDRESS.sub("", str(jaxpr)).encode()).hexdigest()


def versions() -> dict[str, str]:
  import jaxlib

  import qsync_jax

  return {"qsync_jax": qsync_jax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def key_fields(
  fingerprint: str,
  batch_per_device: int,
  base: str,
  presets,
  budget: float | str,
  indicator: Mapping[str, Any],
) -> dict[str, Any]:
  """The fields a cached result must match (module docstring); ``indicator``: the measured
  indicator's settings, or ``{"table": digest(table)}`` for a given one."""
  device = jax.devices()[0]
  return {
    "format": FORMAT,
    "model": fingerprint,
    "batch_per_device": batch_per_device,
    "device_kind": device.device_kind,
    "platform": device.platform,
    "versions": versions(),
    "base": base,
    "presets": list(presets),
    "budget": budget,
    "indicator": dict(indicator),
  }


def path_of(cache_dir: str, fields: Mapping[str, Any]) -> str:
  return os.path.join(cache_dir, f"auto-{digest(fields)[:24]}.json")


def load(cache_dir: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
  """The result saved under ``fields`` (``save``), or None: no file, or one that cannot be read or
  was saved under other fields."""
  try:
    with open(path_of(cache_dir, fields)) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(saved, dict) or saved.get("key") != json.loads(json.dumps(dict(fields), default=str)):
    return None
  return saved.get("result")


def save(cache_dir: str, fields: Mapping[str, Any], result: Mapping[str, Any]) -> str:
  """Writes ``result`` under ``fields`` atomically; returns its path."""
  path = path_of(cache_dir, fields)
  os.makedirs(cache_dir, exist_ok=True)
  text = json.dumps({"key": dict(fields), "result": dict(result)}, indent=1, default=str) + "\n"
  write_text_atomic(path, text, "auto policy cache", PlanError)
  return path
