"""Precision policy: ordered rules that map quantizable ops to op policies.

A rule is a regular expression that must *fully* match an op's module path (e.g.
``"Block_0/attn/query"``), an optional op kind (``"dense"``, ``"conv"``…) and an
``OpPolicy``. The first matching rule wins; ``default`` (the JSON key ``"__default__"``)
applies to ops no rule matches; when there is no default either, the op runs the
unmodified float op, bit-identical to the plain model.

JSON form::

  {"rules": [{"path": ".*attn.*", "kind": "attention_qk", "policy": "bf16"},
             {"path": "Dense_.*", "policy": {"fwd": "int8", "dlhs": "fp16", "drhs": "fp16"}}],
   "__default__": "int8_fwd"}

Examples:
  >>> policy = PrecisionPolicy.from_json({"rules": [{"path": "Dense_0", "policy": "int8"}]})
  >>> policy.lookup("Dense_0", "dense").fwd
  'int8'
  >>> policy.lookup("Dense_1", "dense") is None
  True
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from qsync_jax.devices import check_op_policy_on_device, supported_precisions
from qsync_jax.errors import PolicyError, QsyncWarning
from qsync_jax.jsonio import JsonFile, reject_unknown_keys
from qsync_jax.precision import QUANTIZED_PRECISIONS, OpPolicy

OP_KINDS = (
  "dense",
  "dense_general",
  "conv",
  "einsum",
  "embed",
  "embed_attend",
  "attention_qk",
  "attention_pv",
)
"""Kinds of quantizable op. An op's name is ``"<module path>:<kind>"``."""


def op_name(path: str, kind: str) -> str:
  """The stable name of an op: its Flax module path and kind."""
  return f"{path}:{kind}"


def split_op_name(name: str) -> tuple[str, str]:
  path, _, kind = name.rpartition(":")
  return path, kind


@dataclasses.dataclass(frozen=True)
class Rule:
  """Ops whose module path fully matches ``path`` (and kind equals ``kind``) get ``policy``.

  ``where_supported`` (JSON ``"where_supported": true``): the rule applies only where its policy
  has a kernel — on a device type that runs its precisions (``for_device``), and, for a policy
  with an 8-bit leg, on an op an 8-bit kernel runs (not a grouped or depthwise convolution);
  elsewhere the op goes on to the next rules and ``__default__``. ``{"path": ".*", "policy":
  "int8", "where_supported": true}`` before a ``"bf16"`` default: int8 where it runs, else bf16.
  """

  path: str
  policy: OpPolicy
  kind: str | None = None
  where_supported: bool = False

  def __post_init__(self):
    if not isinstance(self.path, str):
      raise PolicyError(
        f"rule path {self.path!r} is a {type(self.path).__name__}, not a string. "
        "Fix: give a regular expression string, e.g. 'Dense_.*'."
      )
    try:
      re.compile(self.path)
    except re.error as e:
      raise PolicyError(
        f"rule path {self.path!r} is not a valid regular expression ({e}). "
        "Fix: escape special characters, e.g. 'block\\\\[0\\\\]'."
      ) from None
    if self.kind is not None and self.kind not in OP_KINDS:
      raise PolicyError(
        f"rule {self.path!r}: kind {self.kind!r} is unknown. Fix: use one of {list(OP_KINDS)} or omit it."
      )
    if not isinstance(self.policy, OpPolicy):
      raise PolicyError(
        f"rule {self.path!r}: policy must be an OpPolicy, got {type(self.policy).__name__}. "
        "Fix: use OpPolicy(...) or OpPolicy.preset(name)."
      )

  def matches(self, path: str, kind: str, runs_8bit: bool = True) -> bool:
    """Whether the rule applies to op ``path:kind`` (``runs_8bit``: whether an 8-bit kernel runs it)."""
    if (
      self.where_supported
      and not runs_8bit
      and any(p in QUANTIZED_PRECISIONS for p in self.policy.precisions)
    ):
      return False
    return (self.kind is None or self.kind == kind) and re.fullmatch(self.path, path) is not None

  def runs_on(self, device_type: str) -> bool:
    """Whether ``device_type`` runs every precision of the rule's policy."""
    return set(self.policy.precisions) <= set(supported_precisions(device_type))

  def to_json(self) -> dict[str, Any]:
    out: dict[str, Any] = {"path": self.path, "policy": self.policy.to_json()}
    if self.kind is not None:
      out["kind"] = self.kind
    if self.where_supported:
      out["where_supported"] = True
    return out


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy(JsonFile):
  """Ordered rules, first match wins, then ``default``; no match → unmodified float op."""

  JSON_WHAT = "precision policy"
  JSON_ERROR = PolicyError

  rules: tuple[Rule, ...] = ()
  default: OpPolicy | None = None

  def __post_init__(self):
    object.__setattr__(self, "rules", tuple(self.rules))
    for i, rule in enumerate(self.rules):
      if not isinstance(rule, Rule):
        raise PolicyError(
          f"rules[{i}] is a {type(rule).__name__}, not a Rule. Fix: use Rule(path, policy, kind)."
        )

  # -- lookup ---------------------------------------------------------------------------
  def match(self, path: str, kind: str, runs_8bit: bool = True) -> tuple[int | None, OpPolicy | None]:
    """(index of the matching rule or None, the op policy or None); ``runs_8bit``: whether an
    8-bit kernel runs the op (a ``where_supported`` 8-bit rule skips it otherwise)."""
    for i, rule in enumerate(self.rules):
      if rule.matches(path, kind, runs_8bit):
        return i, rule.policy
    return None, self.default

  def lookup(self, path: str, kind: str, runs_8bit: bool = True) -> OpPolicy | None:
    """The op policy for an op, or None when it must run the unmodified float op."""
    return self.match(path, kind, runs_8bit)[1]

  def lookup_name(self, name: str) -> OpPolicy | None:
    return self.lookup(*split_op_name(name))

  def unused_rules(self, op_names: Iterable[str]) -> list[Rule]:
    """Rules that no op of ``op_names`` (``"path:kind"``) resolved to."""
    used = {self.match(*split_op_name(n))[0] for n in op_names}
    return [rule for i, rule in enumerate(self.rules) if i not in used]

  def resolve(self, op_names: Iterable[str], without_8bit: Iterable[str] = ()) -> dict[str, OpPolicy | None]:
    """The op policy of every op (None = unmodified float op), as ``quantize`` looks it up:
    ``without_8bit`` names the ops no 8-bit kernel runs (grouped and depthwise convolutions),
    which a ``where_supported`` 8-bit rule skips."""
    skipped = set(without_8bit)
    return {n: self.lookup(*split_op_name(n), n not in skipped) for n in op_names}

  @property
  def is_fp32(self) -> bool:
    """True when no rule and no default asks for another precision than fp32."""
    policies = [r.policy for r in self.rules] + ([self.default] if self.default else [])
    return all(p.is_fp32 for p in policies)

  def check_quantizes_some(self, op_names: Iterable[str], hint: str = "") -> None:
    """Raises ``PolicyError`` when the policy asks for another precision than fp32 but gives it
    to none of ``op_names`` (``"path:kind"``): the model would silently run in fp32."""
    names = list(op_names)
    if self.is_fp32 or any(p is not None and not p.is_fp32 for p in self.resolve(names).values()):
      return
    found = (
      f"its {len(names)} quantizable ops are e.g. {names[:4]}"
      if names
      else "it calls no quantizable op (flax.linen Dense/DenseGeneral/Conv/Einsum/Embed/attention, "
      "or their flax.nnx twins)"
    )
    raise PolicyError(
      "the precision policy asks for quantization but matches none of the model's ops, so the model "
      f"would run in fp32: {found}. "
      + (
        hint
        or "Fix: write rules whose path regex matches those module paths (qmodel.ops(variables, *inputs) "
        "lists them), or a __default__."
      )
    )

  def check_rules_match(self, op_names: Iterable[str], where: str = "the precision policy") -> None:
    """Raises ``PolicyError`` naming the rules that match none of ``op_names`` (``"path:kind"``):
    rules written for another model, or for modules since renamed or misspelled (with a
    ``__default__``, such ops silently get the default)."""
    message = self._unused_message(list(op_names), where)
    if message:
      raise PolicyError(message)

  def warn_unused_rules(self, op_names: Iterable[str], where: str = "quantize(model, policy)") -> None:
    """``check_rules_match`` as a ``QsyncWarning``: what ``quantize`` says, where one policy may
    serve several models (``qsync train``, ``plan`` and ``predict`` refuse instead)."""
    message = self._unused_message(list(op_names), where)
    if message:
      warnings.warn(message, QsyncWarning, stacklevel=3)

  def _unused_message(self, names: list[str], where: str) -> str | None:
    unused = self.unused_rules(names)
    if not unused:
      return None
    default = "; the ops they were meant for run the __default__ instead" if self.default is not None else ""
    return (
      f"{where}: rule path(s) {[r.path for r in unused][:4]} match none of the model's {len(names)} "
      f"quantizable ops (e.g. {names[:4]}), so the policy was written for another model or its modules "
      f"were renamed or misspelled{default}. Fix: plan again for this model (`qsync plan`), or correct the "
      "rules' paths (qmodel.ops(variables, *inputs) lists the ops)."
    )

  @property
  def needs_rng(self) -> bool:
    policies = [r.policy for r in self.rules] + ([self.default] if self.default else [])
    return any(p.needs_rng for p in policies)

  # -- validation -----------------------------------------------------------------------
  def for_device(self, device_type: str) -> PrecisionPolicy:
    """The policy a device of ``device_type`` runs: without the ``where_supported`` rules whose
    precisions it does not run."""
    kept = tuple(r for r in self.rules if not r.where_supported or r.runs_on(device_type))
    return self if kept == self.rules else dataclasses.replace(self, rules=kept)

  def validate_for_device(self, device_type: str) -> None:
    """Raises ``UnsupportedPrecisionError`` naming the first rule ``device_type`` can't run (a
    ``where_supported`` rule it can't run does not apply there)."""
    supported_precisions(device_type)
    for i, rule in enumerate(self.rules):
      if not rule.where_supported:
        check_op_policy_on_device(rule.policy, device_type, f"rules[{i}] (path {rule.path!r})")
    if self.default is not None:
      check_op_policy_on_device(self.default, device_type, "__default__")

  # -- construction ---------------------------------------------------------------------
  @classmethod
  def uniform(cls, op_policy: OpPolicy | str) -> PrecisionPolicy:
    """Every quantizable op gets ``op_policy`` (a preset name or an OpPolicy)."""
    if isinstance(op_policy, str):
      op_policy = OpPolicy.preset(op_policy)
    return cls(default=op_policy)

  @classmethod
  def from_ops(cls, op_policies: Mapping[str, OpPolicy | None]) -> PrecisionPolicy:
    """One exact rule per op name (``"path:kind"``); ops mapped to None get no rule."""
    rules = []
    for name, p in op_policies.items():
      if p is None:
        continue
      path, kind = split_op_name(name)
      rules.append(Rule(path=re.escape(path), policy=p, kind=kind or None))
    return cls(rules=tuple(rules))

  # -- JSON -----------------------------------------------------------------------------
  def to_json(self) -> dict[str, Any]:
    return {
      "rules": [r.to_json() for r in self.rules],
      "__default__": None if self.default is None else self.default.to_json(),
    }

  @classmethod
  def from_json(cls, obj: Any) -> PrecisionPolicy:
    if not isinstance(obj, Mapping):
      raise PolicyError(
        f"a precision policy must be a JSON object, got {type(obj).__name__}. "
        'Fix: write {"rules": [...], "__default__": null}.'
      )
    reject_unknown_keys(
      obj, ("rules", "__default__"), "precision policy", PolicyError, "'rules' and '__default__'"
    )
    rules_obj = obj.get("rules", [])
    if not isinstance(rules_obj, list):
      raise PolicyError(
        f"precision policy: 'rules' must be a list, got {type(rules_obj).__name__}. "
        'Fix: write "rules": [{"path": "...", "policy": "..."}].'
      )
    rules = [_rule_from_json(i, r) for i, r in enumerate(rules_obj)]
    default_obj = obj.get("__default__")
    default = None if default_obj is None else OpPolicy.from_json(default_obj, "__default__")
    return cls(rules=tuple(rules), default=default)


def _rule_from_json(i: int, obj: Any) -> Rule:
  where = f"rules[{i}]"
  if not isinstance(obj, Mapping):
    raise PolicyError(
      f"{where} must be an object, got {type(obj).__name__} {obj!r}. "
      'Fix: write {"path": "Dense_.*", "policy": "int8"}.'
    )
  reject_unknown_keys(
    obj,
    ("path", "kind", "policy", "where_supported"),
    where,
    PolicyError,
    "path, kind, policy, where_supported",
  )
  where_supported = obj.get("where_supported", False)
  if not isinstance(where_supported, bool):
    raise PolicyError(
      f"{where}: where_supported must be true or false, got {where_supported!r}. Fix: write "
      '"where_supported": true (the rule applies only where its policy has a kernel), or leave it out.'
    )
  for key in ("path", "policy"):
    if key not in obj:
      raise PolicyError(
        f"{where} has no {key!r}. Fix: every rule needs 'path' (a regex over the module "
        "path) and 'policy' (a preset name or {fwd, dlhs, drhs})."
      )
  kind = obj.get("kind")
  if kind is not None and not isinstance(kind, str):
    raise PolicyError(
      f"{where}: kind must be a string or absent, got {kind!r}. Fix: one of {list(OP_KINDS)}."
    )
  policy = OpPolicy.from_json(obj["policy"], f"{where} (path {obj['path']!r})")
  try:
    return Rule(path=obj["path"], policy=policy, kind=kind, where_supported=where_supported)
  except PolicyError as e:
    raise PolicyError(f"{where}: {e}") from None
