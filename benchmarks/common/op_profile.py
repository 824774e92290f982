"""A model's ops traced abstractly, and the cost-free profile the catalog costs them from.

``benchmarks.diagnosis.roofline`` records a model as ``{"model", "device_type",
"batch_per_device", "param_bytes", "ops": [OpShape JSON]}`` (plus its timings), and
``benchmarks.hybrid`` plans the same records of real-size models (``traced_record``, their memory
completed by ``fitted_memory``): ``base_profile`` turns one into a ``Profile`` with no costs, which
``planners.predictor.modeled.modeled_profile`` costs for any device of the catalog.
"""

from __future__ import annotations

import json
import os

import jax

from benchmarks.common import zoo
from benchmarks.common.result_rows import script_dir
from planners.ops import OpShape, collect_ops
from planners.profile import Profile
from planners.profiler import timing
from planners.profiler.measure import memory_sizes
from qsync_jax.train.train_step import init_variables


def build(name: str, tiny: bool):
  """``(task, batch on the device, per-device batch)`` of the zoo's model ``name`` (``tiny``: its
  CPU size)."""
  task, batch = zoo.get(name, tiny)
  data = timing.device_batch(task, batch)
  return task, data, batch


def model_ops(task, data) -> tuple[list[OpShape], int]:
  """The model's quantizable ops at this batch and its parameter bytes (fp32)."""
  variables = jax.eval_shape(lambda: init_variables(task, 0, data)[0])
  ops = collect_ops(
    task.model, variables, *task.inputs(data), **task.train_kwargs, mutable=task.mutable or False
  )
  return ops, timing.tree_bytes(variables["params"])


def traced_record(name: str, tiny: bool = False) -> dict:
  """The zoo's model ``name`` at its real size and per-device batch (``tiny``: its CPU size) as a
  cost-free record (``base_profile`` reads it): its ops and its memory by its shapes (``traced_memory``)."""
  task, data, batch = build(name, tiny=tiny)
  ops, param_bytes = model_ops(task, data)
  return {
    "model": name,
    "device_type": "cpu",
    "batch_per_device": batch,
    "ops": [o.to_json() for o in ops],
    "param_bytes": param_bytes,
    "memory": traced_memory(task, data),
  }


GPU_MEMORY_FILE = os.path.join(script_dir("hybrid"), "traced_memory_gpu.json")
"""The traced models' ``other_bytes`` / ``other_bytes_16bit`` fitted to XLA:GPU's compiled peak of
their step (``benchmarks.diagnosis.traced_memory_gpu`` writes it)."""


def traced_memory(task, data) -> dict[str, int]:
  """The model's memory at the batch ``data`` by its shapes (nothing allocated): parameters, Adam
  state and the batch. ``other_bytes`` (the rest of the step: logits, the loss's buffers, XLA's
  temporaries) is 0 here: the CPU's compiler, whose unfused fp32 attention keeps tens of GB a GPU
  never holds, cannot fit it (``fitted_memory`` adds the corrections fitted to XLA:GPU's peak)."""
  optimizer = timing.default_optimizer()
  variables = jax.eval_shape(lambda: init_variables(task, 0, data)[0])
  return memory_sizes(variables["params"], jax.eval_shape(optimizer.init, variables["params"]), data)


def fitted_memory(model: str, memory: dict[str, int], batch_per_device: int, say=print, path=None) -> dict:
  """``memory`` (``traced_memory`` of ``model`` at ``batch_per_device``) with the ``other_bytes``
  and ``other_bytes_16bit`` fitted to XLA:GPU's compiled peak of its step (``path``, default
  ``GPU_MEMORY_FILE``). Where the file has no fitted entry for the model at that batch, ``memory``
  is returned as it is (``other_bytes`` 0) and ``say`` is told why."""
  path = path or GPU_MEMORY_FILE
  fix = "Fix: run python -m benchmarks.diagnosis.traced_memory_gpu (its docstring says where)."
  entry = None
  if os.path.exists(path):
    with open(path) as f:
      entry = json.load(f)["models"].get(model)
  if entry is None or "error" in entry or entry["batch_per_device"] != batch_per_device:
    why = (
      "no entry"
      if entry is None
      else entry.get("error") or f"an entry at batch {entry['batch_per_device']}, not {batch_per_device}"
    )
    say(f"{model}: other_bytes not fitted ({path}: {why}); the rest of the step is counted as 0. {fix}")
    return dict(memory)
  return {**memory, "other_bytes": entry["other_bytes"], "other_bytes_16bit": entry["other_bytes_16bit"]}


def base_profile(measured: dict) -> Profile:
  """The model's ops and memory as a profile with no costs (what ``modeled_profile`` needs): its
  ``memory`` where the record has it (``traced_memory``), else the parameters and Adam state
  alone (a ``benchmarks.diagnosis.roofline`` record)."""
  ops = tuple(OpShape.from_json(o) for o in measured["ops"])
  pb = measured["param_bytes"]
  memory = measured.get("memory") or {
    "param_bytes": pb,
    "opt_state_bytes": 2 * pb,
    "batch_bytes": 0,
    "other_bytes": 0,
  }
  return Profile(
    measured["model"],
    measured["device_type"],
    "traced",
    measured["batch_per_device"],
    ops,
    {},
    {},
    0.0,
    {},
    dict(memory),
  )
