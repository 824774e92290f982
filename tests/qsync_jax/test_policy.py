"""Precision policy tree: lookup semantics, JSON round trip, validation and bad input."""

import json

import pytest

from qsync_jax import (
  DEVICE_PRECISIONS,
  OpPolicy,
  PolicyError,
  PrecisionPolicy,
  Rule,
  UnsupportedPrecisionError,
  supported_precisions,
)


def make_policy():
  return PrecisionPolicy(
    rules=(
      Rule(".*attn.*", OpPolicy.preset("bf16"), kind="attention_qk"),
      Rule("Dense_[01]", OpPolicy.preset("int8")),
      Rule(".*", OpPolicy.preset("int8_fwd"), kind="conv"),
      Rule("never_matches", OpPolicy.preset("fp8")),
    ),
    default=OpPolicy.preset("fp16"),
  )


def test_first_match_wins_then_default():
  policy = make_policy()
  assert policy.lookup("Block_0/attn", "attention_qk") == OpPolicy.preset("bf16")
  assert policy.lookup("Block_0/attn", "attention_pv") == OpPolicy.preset("fp16")  # default
  assert policy.lookup("Dense_0", "dense") == OpPolicy.preset("int8")
  assert policy.lookup("Dense_0", "conv") == OpPolicy.preset("int8")  # rule 1 has no kind
  assert policy.lookup("Conv_3", "conv") == OpPolicy.preset("int8_fwd")
  assert policy.lookup("Dense_2", "dense") == OpPolicy.preset("fp16")


def test_regex_is_a_full_match():
  policy = PrecisionPolicy(rules=(Rule("Dense_1", OpPolicy.preset("int8")),))
  assert policy.lookup("Dense_1", "dense") is not None
  assert policy.lookup("Dense_10", "dense") is None
  assert policy.lookup("Block/Dense_1", "dense") is None


def test_no_rule_and_no_default_means_float_op():
  assert PrecisionPolicy().lookup("anything", "dense") is None


def test_json_round_trip(tmp_path):
  policy = make_policy()
  path = tmp_path / "policy.json"
  policy.save(str(path))
  again = PrecisionPolicy.load(str(path))
  assert again == policy
  assert PrecisionPolicy.from_json(json.loads(policy.dumps())) == policy


def test_presets_and_shorthand_json():
  policy = PrecisionPolicy.from_json({"rules": [{"path": "a", "policy": "int8_fwd"}], "__default__": "bf16"})
  assert policy.rules[0].policy == OpPolicy(fwd="int8", dlhs="fp16", drhs="fp16")
  assert policy.default == OpPolicy.uniform("bf16")
  assert OpPolicy.preset("int8").grad_rounding == "stochastic"


def test_unused_rules_are_reported():
  policy = make_policy()
  ops = ["Dense_0:dense", "Block_0/attn:attention_qk", "Conv_0:conv"]
  unused = policy.unused_rules(ops)
  assert [r.path for r in unused] == ["never_matches"]


def test_device_capabilities():
  assert supported_precisions("V100") == ("fp32", "fp16")
  assert "int8" in supported_precisions("T4") and "bf16" not in supported_precisions("T4")
  assert "fp8" in supported_precisions("H100")
  assert set(DEVICE_PRECISIONS) >= {"cpu", "V100", "T4", "A10", "L4", "A100", "H100"}
  PrecisionPolicy.uniform("int8").validate_for_device("T4")
  PrecisionPolicy.uniform("fp16").validate_for_device("V100")


def test_from_ops_builds_exact_rules():
  policy = PrecisionPolicy.from_ops({"Block[0]/Dense_0:dense": OpPolicy.preset("int8"), "x:conv": None})
  assert policy.lookup("Block[0]/Dense_0", "dense") == OpPolicy.preset("int8")
  assert policy.lookup("Block[0]/Dense_0", "conv") is None
  assert len(policy.rules) == 1


# -- bad input: each raises a named error whose message names the input and the fix ---------

BAD_JSON = [
  ("not an object", ["rules"], PolicyError, "must be a JSON object"),
  ("rules not a list", {"rules": {"path": "a"}}, PolicyError, "'rules' must be a list"),
  ("unknown top-level key", {"rules": [], "defualt": "int8"}, PolicyError, "defualt"),
  ("rule not an object", {"rules": ["Dense_0"]}, PolicyError, "rules\\[0\\] must be an object"),
  ("rule without path", {"rules": [{"policy": "int8"}]}, PolicyError, "has no 'path'"),
  ("rule without policy", {"rules": [{"path": "a"}]}, PolicyError, "has no 'policy'"),
  ("bad regex", {"rules": [{"path": "Dense_(", "policy": "int8"}]}, PolicyError, "not a valid regular"),
  ("path not a string", {"rules": [{"path": 3, "policy": "int8"}]}, PolicyError, "not a string"),
  ("unknown op kind", {"rules": [{"path": "a", "kind": "lstm", "policy": "int8"}]}, PolicyError, "lstm"),
  ("kind not a string", {"rules": [{"path": "a", "kind": 1, "policy": "int8"}]}, PolicyError, "kind must"),
  ("unknown preset", {"rules": [{"path": "a", "policy": "int4"}]}, PolicyError, "int4"),
  (
    "unknown precision",
    {"rules": [{"path": "a", "policy": {"fwd": "int4", "dlhs": "fp16", "drhs": "fp16"}}]},
    PolicyError,
    "fwd='int4'",
  ),
  ("missing legs", {"rules": [{"path": "a", "policy": {"fwd": "int8"}}]}, PolicyError, "missing leg"),
  (
    "unknown op-policy key",
    {"rules": [{"path": "a", "policy": {"fwd": "int8", "dlhs": "fp16", "drhs": "fp16", "bwd": "fp16"}}]},
    PolicyError,
    "bwd",
  ),
  (
    "bad rounding",
    {"__default__": {"fwd": "int8", "dlhs": "fp16", "drhs": "fp16", "rounding": "up"}},
    PolicyError,
    "rounding='up'",
  ),
  (
    "bad granularity",
    {"__default__": {"fwd": "int8", "dlhs": "int8", "drhs": "int8", "granularity": "row"}},
    PolicyError,
    "granularity",
  ),
  ("policy of wrong type", {"rules": [{"path": "a", "policy": 8}]}, PolicyError, "expected a preset name"),
  (
    "precision not a string",
    {"__default__": {"fwd": 8, "dlhs": "fp16", "drhs": "fp16"}},
    PolicyError,
    "fwd=8",
  ),
  (
    "unknown rule key",
    {"rules": [{"path": "a", "policy": "int8", "precision": "x"}]},
    PolicyError,
    "precision",
  ),
]


@pytest.mark.parametrize("name,obj,error,pattern", BAD_JSON, ids=[b[0] for b in BAD_JSON])
def test_bad_policy_json(name, obj, error, pattern):
  with pytest.raises(error, match=pattern) as info:
    PrecisionPolicy.from_json(obj)
  assert "Fix:" in str(info.value), f"{name}: the message must say how to fix it"


def test_malformed_json_text_names_file_and_position(tmp_path):
  path = tmp_path / "p.json"
  path.write_text('{"rules": [ {"path": "a", "policy": "int8"}, ]}')
  with pytest.raises(PolicyError, match=r"p\.json is not valid JSON .* line 1") as info:
    PrecisionPolicy.load(str(path))
  assert "Fix:" in str(info.value)


@pytest.mark.parametrize(
  "device,policy,pattern",
  [
    ("V100", PrecisionPolicy.uniform("int8"), "fwd='int8' is not supported on V100"),
    ("T4", PrecisionPolicy.uniform("bf16"), "bf16"),
    ("A100", PrecisionPolicy(rules=(Rule("x", OpPolicy.preset("fp8")),)), r"rules\[0\] \(path 'x'\)"),
    (
      "V100",
      PrecisionPolicy(rules=(Rule("x", OpPolicy(fwd="fp16", dlhs="fp16", drhs="tf32")),)),
      "drhs='tf32'",
    ),
  ],
)
def test_unsupported_precision_on_device(device, policy, pattern):
  with pytest.raises(UnsupportedPrecisionError, match=pattern) as info:
    policy.validate_for_device(device)
  assert "Fix:" in str(info.value)


def test_unknown_device_type():
  with pytest.raises(UnsupportedPrecisionError, match="device type 'P100' is unknown"):
    PrecisionPolicy.uniform("fp16").validate_for_device("P100")


def test_rule_constructor_validates():
  with pytest.raises(PolicyError, match="must be an OpPolicy"):
    Rule("a", "int8")
  with pytest.raises(PolicyError, match="not a Rule"):
    PrecisionPolicy(rules=({"path": "a"},))
