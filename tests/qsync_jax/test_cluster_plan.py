"""Cluster spec and plan: JSON round trips, validation errors, batch shares, device mapping."""

import json

import numpy as np
import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup, assign_devices
from qsync_jax.errors import ClusterSpecError, PlanError
from qsync_jax.plan import Plan
from qsync_jax.policy import PrecisionPolicy


def _spec_json(rng):
  a, t = (int(x) for x in rng.integers(1, 5, size=2))
  return {
    "name": "hybrid",
    "groups": [
      {"name": "train", "device_type": "A100", "count": a, "memory_gb": 40, "batch_per_device": 8},
      {
        "name": "infer",
        "device_type": "T4",
        "count": t,
        "memory_gb": 16.0,
        "batch_per_device": 3,
        "link_gbps": 32,
      },
    ],
  }


def test_cluster_round_trip_and_shares(tmp_path):
  rng = np.random.default_rng(101)
  obj = _spec_json(rng)
  spec = ClusterSpec.from_json(obj)
  a, t = obj["groups"][0]["count"], obj["groups"][1]["count"]
  assert spec.num_devices == a + t
  assert spec.global_batch == 8 * a + 3 * t
  shares = spec.batch_shares()
  assert shares["train"] == pytest.approx(8 * a / spec.global_batch)
  assert sum(shares.values()) == pytest.approx(1.0)
  assert spec.device_group_indices() == (0,) * a + (1,) * t
  assert spec.device_batch_sizes() == (8,) * a + (3,) * t
  for suffix in (".json", ".yaml"):
    path = str(tmp_path / f"c{suffix}")
    spec.save(path)
    assert ClusterSpec.load(path) == spec
  assert ClusterSpec.loads(spec.dumps()) == spec
  assert spec.with_batch_per_device({"infer": 5}).group("infer").batch_per_device == 5


@pytest.mark.parametrize(
  "mutate, needle",
  [
    (lambda o: o["groups"][0].update(device_type="K80"), "'V100'"),
    (lambda o: o["groups"][1].update(count=0), "count=0"),
    (lambda o: o["groups"][1].update(memory_gb=-1), "memory_gb=-1"),
    (lambda o: o["groups"][1].update(batch_per_device=2.5), "batch_per_device=2.5"),
    (lambda o: o["groups"][1].update(name="train"), "unique"),
    (lambda o: o["groups"][1].pop("count"), "missing"),
    (lambda o: o["groups"][1].update(gpus=2), "unknown key"),
    (lambda o: o.update(groups=[]), "no device groups"),
    (lambda o: o.update(groups="x"), "must be a list"),
  ],
)
def test_cluster_validation_names_field_and_fix(mutate, needle):
  obj = _spec_json(np.random.default_rng(102))
  mutate(obj)
  with pytest.raises(ClusterSpecError, match="Fix") as e:
    ClusterSpec.from_json(obj)
  assert needle in str(e.value)


def test_cluster_bad_json_and_missing_file(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text("{not json")
  with pytest.raises(ClusterSpecError, match="bad.json is not valid JSON"):
    ClusterSpec.load(str(path))
  with pytest.raises(ClusterSpecError, match="cannot be read"):
    ClusterSpec.load(str(tmp_path / "missing.json"))


def test_assign_devices_counts_must_match():
  import jax

  spec = ClusterSpec((DeviceGroup("a", "A100", 6, 40, 4), DeviceGroup("t", "T4", 2, 16, 2)))
  assert assign_devices(spec, jax.devices()) == (0,) * 6 + (1,) * 2
  with pytest.raises(ClusterSpecError, match="has 8 devices .* but the job has 4"):
    assign_devices(spec, jax.devices()[:4])


def test_plan_round_trip_validation_and_fingerprint(tmp_path):
  obj = _spec_json(np.random.default_rng(103))
  for g in obj["groups"]:
    g["count"] = 2  # 2 × 8 + 2 × 3: the plan moves one example a device from train to infer
  spec = ClusterSpec.from_json(obj)
  plan = Plan.from_json(
    {
      "policies": {"infer": "int8_fwd"},
      "batch_per_device": {"train": 7, "infer": 4},
      "sync": "bf16",
      "predictions": {"step_s": 0.5},
    }
  )
  plan.validate_for(spec)
  assert plan.policy_for("train") == PrecisionPolicy()
  assert plan.needs_fp16_loss_scaling
  assert plan.apply_to(spec).group("infer").batch_per_device == 4
  assert plan.apply_to(spec).global_batch == spec.global_batch
  path = str(tmp_path / "plan.json")
  plan.save(path)
  again = Plan.load(path)
  assert again == plan and again.fingerprint() == plan.fingerprint()
  assert (
    Plan(plan.policies, plan.batch_per_device, {"other": 1}, sync="bf16").fingerprint() == plan.fingerprint()
  )
  assert Plan(plan.policies, {"infer": 3}, sync="bf16").fingerprint() != plan.fingerprint()
  # the sync changes what trains: another payload, another hash; fp32 is the default's
  assert Plan(plan.policies, plan.batch_per_device).fingerprint() != plan.fingerprint()
  assert Plan(sync="fp32").fingerprint() == Plan().fingerprint()
  assert not Plan.uniform(spec, "bf16").needs_fp16_loss_scaling


@pytest.mark.parametrize(
  "obj, needle",
  [
    ({"policies": {"nope": "fp32"}}, "does not have"),
    ({"policies": {"train": "fp8"}}, "'train' (A100)"),  # A100 has no fp8
    ({"batch_per_device": {"infer": -1}}, "integer ≥ 0"),
    ({"policies": {"infer": "int9"}}, "'infer'"),
    ({"policy": {}}, "unknown key"),
    ({"sync": "bf17"}, "sync='bf17' is not a gradient sync strategy"),
    # the spec trains on 8·a + 3·t examples a step; a plan that trains on fewer is refused
    ({"batch_per_device": {"infer": 2}}, "but cluster 'hybrid' trains on"),
  ],
)
def test_plan_errors(obj, needle):
  spec = ClusterSpec.from_json(_spec_json(np.random.default_rng(104)))
  with pytest.raises(PlanError, match="Fix") as e:
    Plan.from_json(obj).validate_for(spec)
  assert needle in str(e.value)
  json.dumps(obj)


def test_the_plans_sync_is_the_one_that_runs_unless_another_is_asked_for_and_a_contradiction_is_refused():
  assert Plan(sync="bf16").sync_for(None) == "bf16"
  assert Plan(sync="bf16").sync_for("bf16") == "bf16"
  assert Plan(sync="fp32").sync_for(None) is None  # the trainer's default reduction
  assert Plan(sync="fp32").sync_for("psum") == "fp32"
  assert Plan().sync_for("global_qsgd") == "global_qsgd"  # a plan that states none runs what is asked
  assert Plan().sync_for(None) is None
  with pytest.raises(
    PlanError, match=r"'fp16' contradicts the plan's sync 'bf16'.*Fix: .*qsync plan --sync fp16"
  ):
    Plan(sync="bf16").sync_for("fp16")


def test_a_plan_that_changes_the_global_batch_names_both_numbers():
  spec = ClusterSpec((DeviceGroup("a", "A100", 2, 40, 16), DeviceGroup("t", "T4", 2, 16, 16)))
  with pytest.raises(PlanError) as e:
    Plan(batch_per_device={"a": 16, "t": 8}).validate_for(spec)
  assert "a global batch of 48" in str(e.value) and "trains on 64 examples" in str(e.value)
  assert "Fix: make the plan's batch_per_device add up to 64" in str(e.value)
  Plan(batch_per_device={"a": 24, "t": 8}).validate_for(spec)  # 48 + 16: the same 64
