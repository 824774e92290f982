"""A model's ops traced abstractly, and the cost-free profile the catalog costs them from.

``benchmarks.diagnosis.roofline`` records a model as ``{"model", "device_type",
"batch_per_device", "param_bytes", "ops": [OpShape JSON]}`` (plus its timings), and
``benchmarks.hybrid`` plans the same records: ``base_profile`` turns one into a ``Profile`` with
no costs, which ``planners.predictor.modeled.modeled_profile`` costs for any device of the catalog.
"""

from __future__ import annotations

import jax

from benchmarks.common import zoo
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


def traced_memory(task, data) -> dict[str, int]:
  """The model's memory at the batch ``data`` by its shapes (nothing allocated): parameters, Adam
  state and the batch. ``other_bytes`` (the rest of the step: logits, the loss's buffers, XLA's
  temporaries) is 0: ``qsync profile`` fits it to a compiled step, and the only compiler at hand
  here is the CPU's, whose unfused fp32 attention keeps tens of GB a GPU never holds."""
  optimizer = timing.default_optimizer()
  variables = jax.eval_shape(lambda: init_variables(task, 0, data)[0])
  return memory_sizes(variables["params"], jax.eval_shape(optimizer.init, variables["params"]), data)


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
