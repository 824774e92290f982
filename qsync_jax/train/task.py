"""A training task: the model, how to call it, its loss and its data.

The trainer, the planner and the examples all speak this one small interface, so a user's
own Flax model plugs in by writing one ``Task`` (``qsync train --model pkg.module:make_task``).

Batches are pytrees of numpy / jax arrays whose leaves share a leading batch axis.
The model is called as::

    outputs = model.apply(variables, *task.inputs(batch), **task.train_kwargs,
                          mutable=task.mutable, rngs=...)          # training
    outputs = model.apply(variables, *task.inputs(batch), **task.eval_kwargs)  # evaluation

and ``task.loss(outputs, batch)`` returns ``(scalar mean loss, {metric name: scalar})``.

Tasks by name or by import path: what ``--model`` accepts on every ``qsync`` command.

``load_task(spec, **overrides)`` returns a ``qsync_jax.train.task.Task`` from either

* ``package.module:attr`` — ``package.module`` imported from the Python path; ``attr`` is a
  ``Task`` or a function returning one (called with the overrides as keyword arguments); or
* a registered name — ``get_task(name, **overrides)``: the factory that an installed package
  declares under the entry-point group ``qsync_jax.tasks`` (``ENTRY_POINT_GROUP``), e.g. in
  its ``pyproject.toml``::

    [project.entry-points."qsync_jax.tasks"]
    vgg = "examples.tasks.vision:vgg_digits"

Only the named entry point is imported. This package imports no task module itself: the
registry is filled by whoever installs one (this project's examples, or a user's package).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import flax.linen as nn

from qsync_jax.errors import QsyncError

Batch = Any


@dataclasses.dataclass(frozen=True)
class Task:
  """Everything needed to train and evaluate one model.

  Attributes:
    name: short name (used in logs and checkpoints).
    model: the unmodified ``flax.linen`` model, or a ``flax.nnx`` module (held as an
      ``NnxModel``, which gives it the same ``init`` / ``apply``; see ``qsync_jax.models.nnx_model``).
    inputs: batch → positional arguments of ``model.apply`` after the variables.
    loss: (model outputs, batch) → (scalar mean loss over the batch, metrics dict).
    train_batches: (global batch size, seed) → iterator over training batches, forever.
    eval_batches: (batch size) → iterator over the held-out set (finite), or None.
    train_kwargs / eval_kwargs: extra keyword arguments of ``model.apply``
      (e.g. ``{"train": True}`` for BatchNorm / dropout).
    mutable: collections updated in training (e.g. ``("batch_stats",)``).
    rng_streams: RNG streams the model needs in training besides ``"qsync"`` (e.g. dropout).
    tokens_per_example: tokens in one example (a sequence model's positions), or None: the
      trainer then reports tokens/s beside samples/s.
  """

  name: str
  model: nn.Module
  inputs: Callable[[Batch], tuple]
  loss: Callable[[Any, Batch], tuple[Any, Mapping[str, Any]]]
  train_batches: Callable[[int, int], Iterator[Batch]]
  eval_batches: Callable[[int], Iterator[Batch]] | None = None
  train_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  mutable: tuple[str, ...] = ()
  rng_streams: tuple[str, ...] = ()
  tokens_per_example: int | None = None

  def __post_init__(self):
    from qsync_jax.models.nnx_model import as_functional  # flax.nnx loads on first use
    from qsync_jax.models.nnx_quant import QuantizedNnxModel

    if isinstance(self.model, QuantizedNnxModel):
      raise QsyncError(
        "Task.model is a quantized nnx model; a Task takes the float model, which the trainer runs under "
        "each group's policy from the plan. Fix: pass qmodel.module, and put the policy in the plan."
      )
    object.__setattr__(self, "model", as_functional(self.model))
    t = self.tokens_per_example
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
      raise QsyncError(
        f"task {self.name!r}: tokens_per_example {t!r} must be a positive int or None. Fix: pass the "
        "sequence length, e.g. tokens_per_example=512."
      )


ENTRY_POINT_GROUP = "qsync_jax.tasks"


def task_names() -> list[str]:
  """The registered task names (entry points of ``ENTRY_POINT_GROUP``), sorted."""
  return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def get_task(name: str, **overrides) -> Task:
  """The task registered as ``name``, built by its factory with ``overrides`` (config fields)."""
  factory = _registered_factory(name)
  return _as_task(factory(**overrides), name)


def load_task(spec: str, **overrides) -> Task:
  """A ``Task`` from a registered name or ``package.module:attr`` (see the module doc)."""
  if ":" not in spec:
    return get_task(spec, **overrides)
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise QsyncError(f"task {spec!r} is not package.module:attr. Fix: write e.g. mypkg.tasks:make_task.")
  module = _import(spec, module_name)
  if not hasattr(module, attr):
    raise QsyncError(
      f"task {spec!r}: module {module_name!r} has no attribute {attr!r}. Fix: name an existing one."
    )
  obj = getattr(module, attr)
  if isinstance(obj, Task):
    if overrides:
      raise QsyncError(
        f"task {spec!r} is a Task, so it takes no overrides {sorted(overrides)}. "
        "Fix: name a function that builds the Task from them, or drop the overrides."
      )
    return obj
  if not callable(obj):
    raise QsyncError(
      f"task {spec!r} is a {type(obj).__name__}, neither a Task nor a function. Fix: name a Task factory."
    )
  try:
    inspect.signature(obj).bind(**overrides)
  except TypeError as e:
    raise QsyncError(
      f"task {spec!r} cannot be called with the overrides {sorted(overrides)}: {e}. Fix: name a factory "
      "whose arguments all have defaults and pass only the overrides it takes."
    ) from None
  return _as_task(obj(**overrides), spec)


def _import(spec: str, module_name: str):
  """``importlib.import_module(module_name)``, with an error that tells a module that is not on
  the Python path from one that is there but fails to import what it needs."""
  try:
    return importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    parts = module_name.split(".")
    if e.name not in {".".join(parts[: i + 1]) for i in range(len(parts))}:
      raise QsyncError(
        f"task {spec!r}: importing {module_name!r} failed: {e}. Fix: install what {module_name!r} imports."
      ) from None
    raise QsyncError(
      f"task {spec!r}: no module named {e.name!r} on the Python path. Fix: install the package that "
      f"holds {module_name!r}, or add the directory that contains {parts[0]!r} to PYTHONPATH "
      f"(PYTHONPATH=/path/to/dir qsync ...), or run `python -m qsync_cli ...` from that directory "
      "(the `qsync` script does not look in the current directory)."
    ) from None
  except ImportError as e:
    raise QsyncError(
      f"task {spec!r}: importing {module_name!r} failed: {e}. Fix: correct that import."
    ) from None


def _registered_factory(name: str) -> Callable[..., Task]:
  found = entry_points(group=ENTRY_POINT_GROUP).select(name=name)
  targets = sorted({ep.value for ep in found})
  if not targets:
    raise QsyncError(_unknown_task_message(name))
  if len(targets) > 1:
    raise QsyncError(
      f"task {name!r} is registered more than once ({targets}) by the installed packages. "
      "Fix: uninstall the stale package (pip list shows two that declare it)."
    )
  return _load(next(iter(found)))


def _unknown_task_message(name: str) -> str:
  names = task_names()
  if names:
    return (
      f"unknown task {name!r}. Fix: use one of {names}, or pass your own task factory as "
      "package.module:make_task."
    )
  return (
    f"unknown task {name!r}: no task is registered in this Python environment (no installed package "
    f"declares entry points of group {ENTRY_POINT_GROUP!r}). The example tasks are registered when "
    "the qsync-jax checkout is installed. Fix: run `pip install -e '.[examples]'` in the checkout "
    "(`python3 dev.py qsync ...` does it), or pass the task factory as package.module:make_task."
  )


def _load(ep: EntryPoint) -> Callable[..., Task]:
  try:
    factory = ep.load()
  except ImportError as e:
    raise QsyncError(
      f"task {ep.name!r} (registered as {ep.value!r}) cannot be loaded: {e}. Fix: install what it "
      "needs (for the examples: pip install -e '.[examples]')."
    ) from None
  except AttributeError as e:
    raise QsyncError(
      f"task {ep.name!r} is registered as {ep.value!r}, which does not exist ({e}). Fix: reinstall the "
      "package that declares it, so its entry points match its code."
    ) from None
  return factory


def _as_task(task, spec: str) -> Task:
  if not isinstance(task, Task):
    raise QsyncError(
      f"task {spec!r} gave a {type(task).__name__}, not a qsync_jax.train.task.Task. "
      "Fix: return a Task from the factory."
    )
  return task
