"""Cluster spec: a group's link inside the group (``intra_link_gbps``), validated and in JSON / YAML."""

import pytest

from qsync_jax.cluster import ClusterSpec, DeviceGroup
from qsync_jax.errors import ClusterSpecError

NVLINK = {"name": "train", "device_type": "A100", "count": 4, "memory_gb": 40, "batch_per_device": 32}


def test_intra_link_defaults_to_the_groups_link():
  plain = DeviceGroup("t", "T4", 2, 16, 8, link_gbps=32)
  assert plain.intra_link_gbps is None and plain.intra_group_gbps == 32.0
  nvlink = DeviceGroup("a", "A100", 4, 40, 8, link_gbps=100, intra_link_gbps=2400)
  assert nvlink.intra_group_gbps == 2400.0 and nvlink.link_gbps == 100.0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "2400", True])
def test_a_bad_intra_link_is_named(bad):
  with pytest.raises(
    ClusterSpecError, match=r"'a': intra_link_gbps=.* must be a positive finite number.*Fix"
  ):
    DeviceGroup("a", "A100", 4, 40, 8, intra_link_gbps=bad)
  with pytest.raises(ClusterSpecError, match=r"groups\[0\]: .*intra_link_gbps=.*Fix"):
    ClusterSpec.from_json({"groups": [{**NVLINK, "intra_link_gbps": bad}]})


@pytest.mark.parametrize("suffix", ["json", "yaml"])
def test_intra_link_round_trips_and_is_left_out_when_not_given(tmp_path, suffix):
  spec = ClusterSpec.from_json(
    {"groups": [{**NVLINK, "link_gbps": 100, "intra_link_gbps": 2400}, {**NVLINK, "name": "infer"}]}
  )
  assert [g.intra_group_gbps for g in spec.groups] == [2400.0, 100.0]
  assert "intra_link_gbps" not in spec.to_json()["groups"][1]  # the spec as written before the field
  path = tmp_path / f"cluster.{suffix}"
  spec.save(str(path))
  assert ClusterSpec.load(str(path)) == spec


def test_a_yaml_key_given_twice_is_refused_naming_the_file_the_key_and_the_line(tmp_path):
  """As for JSON (test_jsonio): ``yaml.safe_load`` keeps the last of two equal keys silently."""
  group = "- name: t\n  device_type: T4\n  count: 2\n  memory_gb: 16\n  batch_per_device: 8\n"
  cases = {
    "top.yaml": ("name: a\nname: b\ngroups: []\n", "name", 2),
    "group.yml": ("groups:\n" + group + "  count: 4\n", "count", 7),
  }
  for name, (text, key, line) in cases.items():
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(
      ClusterSpecError,
      match=rf"{path} gives key '{key}' twice in one mapping \(line {line}\).*Fix: keep the one you mean",
    ):
      ClusterSpec.load(str(path))
  # a key a merge brings in may be overridden, as YAML defines: not a duplicate
  path = tmp_path / "merge.yaml"
  path.write_text("groups:\n" + group.replace("- name: t", "- &g\n  name: t") + "- <<: *g\n  name: u\n")
  assert ClusterSpec.load(str(path)).group_names == ("t", "u")
