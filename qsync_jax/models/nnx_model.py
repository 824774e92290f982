"""A ``flax.nnx`` module behind the functional ``init`` / ``apply`` interface of a linen model.

Every consumer of ``Task.model`` — the trainer's hybrid step, SelSync and QSDP, the profiler,
the indicator, evaluation — treats the model as a pure function of its variables::

    variables = model.init(rngs, *inputs)
    out = model.apply(variables, *inputs, rngs={...})                     # or, with mutable:
    out, updates = model.apply(variables, *inputs, rngs={...}, mutable=["batch_stats"])

and traces it under ``jit``, ``shard_map``, ``vjp`` and ``lax.switch``. An nnx module is a
stateful Python object instead. ``NnxModel`` converts between the two at the ``Task`` boundary
with nnx's own ``split`` / ``merge``, so that every consumer runs unchanged and there is one code
path for linen and nnx models (rather than teaching each consumer nnx):

* **variables** are ``{collection: pure dict}``: each nnx ``Variable`` goes to the linen
  collection of its type (``nnx.variable_name_from_type``: ``Param`` → ``"params"``,
  ``BatchStat`` → ``"batch_stats"``, ``Cache`` → ``"cache"``…), under its path in the nnx graph
  (attribute names; list items under their int index), as ``nnx.to_pure_dict`` gives it.
  Keys may also come back as strings (``"0"``), as orbax and msgpack store them.
* ``init(rngs, *inputs)`` returns the variables the module was built with: an nnx module is
  initialised when it is constructed, by its own ``nnx.Rngs``; ``init``'s ``rngs`` and inputs
  are not used (build the module with another seed for other initial parameters).
* ``apply(variables, *inputs, rngs=None, mutable=False, **kwargs)`` merges a fresh copy of the
  module with ``variables`` and calls it: ``copy(*inputs, **kwargs)``. The RNG streams of the
  module (``nnx.RngStream``: dropout's, attention's) are not variables: ``rngs={name: key}``
  reseeds every stream tagged ``name`` (``nnx.reseed``: each stream draws its own key from
  ``key``), so a step key gives fresh, reproducible dropout masks on every call, as linen's
  ``rngs`` do. A call that draws from a stream ``rngs`` does not seed raises ``QsyncError``
  (its draws would repeat on every call). With ``mutable`` (a collection name, a list of them,
  or True for all) it also returns ``{collection: pure dict}`` of those collections after the
  call. The module the adapter was made from never changes.

Example::

    from flax import nnx
    model = NnxModel(MyMLP(rngs=nnx.Rngs(params=0, dropout=1)))
    variables = model.init(None)
    logits = model.apply(variables, x, rngs={"dropout": key})

``Task(model=my_nnx_module, ...)`` wraps the module itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qsync_jax.errors import QsyncError

Path = tuple[Any, ...]


def _key(path: Sequence[Any]) -> tuple[str, ...]:
  """A graph path with list indices as strings: ``("blocks", 0)`` and ``("blocks", "0")`` agree."""
  return tuple(str(p) for p in path)


def path_name(path: Sequence[Any]) -> str:
  """``"blocks/0/attn/query"``: an nnx graph path, in the separator of linen module paths."""
  return "/".join(str(p) for p in path)


def _collection(variable: nnx.Variable) -> str:
  return nnx.variable_name_from_type(type(variable), allow_register=True)


def _flatten(tree: Mapping, prefix: Path = ()) -> list[tuple[Path, Any]]:
  out = []
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.extend(_flatten(v, (*prefix, k)))
    else:
      out.append(((*prefix, k), v))
  return out


def _pure_dicts(module: nnx.Module, collections: Sequence[str] | None) -> dict[str, dict]:
  """``{collection: pure dict}`` of ``module``'s variables (RNG state excluded)."""
  flat: dict[str, list] = {}
  for path, variable in nnx.to_flat_state(nnx.state(module)):
    if isinstance(variable, nnx.RngState):
      continue
    name = _collection(variable)
    if collections is None or name in collections:
      flat.setdefault(name, []).append((path, variable))
  return {name: nnx.to_pure_dict(nnx.from_flat_state(entries)) for name, entries in flat.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class NnxModel:
  """An nnx module with linen's functional ``init`` / ``apply`` (see the module docstring)."""

  graphdef: Any
  template: tuple[tuple[Path, nnx.Variable], ...]  # (path, Variable) of the module as built

  @classmethod
  def of(cls, module: nnx.Module) -> NnxModel:
    graphdef, state = nnx.split(module)
    return cls(graphdef, tuple(nnx.to_flat_state(state)))

  @property
  def collections(self) -> tuple[str, ...]:
    """The variable collections of the module (RNG state excluded)."""
    names = [_collection(v) for _, v in self.template if not isinstance(v, nnx.RngState)]
    return tuple(dict.fromkeys(names))

  def module(self, variables: Mapping[str, Any] | None = None) -> nnx.Module:
    """A fresh copy of the module, with ``variables`` (default: those it was built with)."""
    if variables is None:
      return nnx.merge(self.graphdef, nnx.from_flat_state([(p, v.copy()) for p, v in self.template]))
    values = {}
    for name, tree in variables.items():
      if not isinstance(tree, Mapping):
        raise QsyncError(
          f"variables[{name!r}] is a {type(tree).__name__}, not a dict of the module's variables. "
          "Fix: pass the variables that init (or a checkpoint's params) gave."
        )
      for path, value in _flatten(tree):
        values[_key(path)] = (name, path, value)
    entries = []
    for path, variable in self.template:
      if isinstance(variable, nnx.RngState):
        entries.append((path, variable.copy()))
        continue
      name = _collection(variable)
      got = values.pop(_key(path), None)
      if got is None or got[0] != name:
        raise QsyncError(
          f"variables[{name!r}] has no entry {path_name(path)!r} of the nnx module "
          f"(collections given: {sorted(variables)}). Fix: pass every collection init returned "
          f"({list(self.collections)}), for this module."
        )
      entries.append((path, variable.copy(got[2])))
    if values:
      name, path, _ = next(iter(values.values()))
      raise QsyncError(
        f"variables[{name!r}] has an entry {path_name(path)!r} that the nnx module does not have. "
        "Fix: pass the variables of this module (its init, or a checkpoint of the same model)."
      )
    return nnx.merge(self.graphdef, nnx.from_flat_state(entries))

  def init(self, rngs=None, *args, **kwargs) -> dict[str, dict]:
    """Copies of the variables the module was built with (a caller may donate them); ``rngs``
    and the inputs are not used."""
    del rngs, args, kwargs
    return jax.tree.map(lambda x: jnp.array(x, copy=True), _pure_dicts(self.module(), None))

  def apply(self, variables, *args, rngs=None, mutable=False, **kwargs):
    """``module(*args, **kwargs)`` at ``variables``; see the module docstring."""
    return self.call(variables, args, kwargs, rngs=rngs, mutable=mutable)

  def call(
    self,
    variables,
    args: tuple,
    kwargs: Mapping[str, Any],
    *,
    rngs=None,
    mutable=False,
    prepare: Callable[[nnx.Module, Mapping[str, Any]], None] | None = None,
  ):
    """``apply``, with ``prepare(module, rngs)`` run on the fresh copy before the call (how
    ``qsync_jax.models.nnx_quant`` hands the module its quantized ops)."""
    rngs = _rng_dict(rngs)
    module = self.module(variables)
    unseeded = _seed(module, rngs)
    if prepare is not None:
      prepare(module, rngs)
    out = module(*args, **kwargs)
    _check_unseeded(unseeded, rngs)
    if mutable is False:
      return out
    names = None if mutable is True else ([mutable] if isinstance(mutable, str) else list(mutable))
    return out, _pure_dicts(module, names)


def _rng_dict(rngs) -> dict[str, Any]:
  if rngs is None:
    return {}
  if not isinstance(rngs, Mapping):
    raise QsyncError(
      f"apply's rngs is a {type(rngs).__name__}, not a dict. Fix: pass rngs={{stream name: key}}, "
      "e.g. rngs={'dropout': key}."
    )
  return dict(rngs)


def _seed(module: nnx.Module, rngs: Mapping[str, Any]) -> list[tuple[str, str, nnx.RngStream, Any]]:
  """Reseeds the streams ``rngs`` names; returns ``(path, tag, stream, count)`` of the others."""
  streams = [(path_name(p), s) for p, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)]
  tags = {s.tag for _, s in streams}
  given = {tag: key for tag, key in rngs.items() if tag in tags}
  if given:
    nnx.reseed(module, **given)
  return [(path, s.tag, s, s.count.get_value()) for path, s in streams if s.tag not in given]


def _check_unseeded(unseeded, rngs: Mapping[str, Any]) -> None:
  for path, tag, stream, count in unseeded:
    if stream.count.get_value() is not count:
      raise QsyncError(
        f"the nnx module draws from its RNG stream {tag!r} (at {path!r}), which apply's rngs "
        f"({sorted(rngs)}) do not seed, so its draws would repeat on every call. Fix: list {tag!r} in "
        f"Task.rng_streams (or pass rngs={{{tag!r}: key}}), or build the module with "
        "nnx.Rngs(params=..., dropout=...) and list 'dropout'."
      )


def as_functional(model):
  """``model`` itself, or an nnx module as an ``NnxModel``."""
  return NnxModel.of(model) if isinstance(model, nnx.Module) else model
