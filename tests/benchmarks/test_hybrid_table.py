"""``benchmarks/hybrid.py``'s per pool × model table and its what-if of free links."""

import dataclasses

from benchmarks import hybrid
from planners.allocator.search import Candidate
from planners.allocator.summary import Limits


def _candidate(name, batches, step_ms, mode=("flat", "replicated")):
  return Candidate(name, batches, (), step_ms, 0.0, sum(batches) * 4, mode=mode)


def test_the_free_links_what_if_puts_every_link_nvlink_included_at_the_free_rate():
  cluster = hybrid.pool_cluster("A100+L4", "free", 8)
  assert [g.link_gbps for g in cluster.groups] == [hybrid.FREE_LINKS_GBPS] * 2
  assert cluster.groups[0].intra_link_gbps == hybrid.FREE_LINKS_GBPS
  real = hybrid.pool_cluster("A100+L4", "100G", 8)
  assert real.groups[0].intra_link_gbps == hybrid.NVLINK_GBPS and real.groups[1].link_gbps == 100.0


def test_chosen_label_names_the_candidate_its_batches_and_a_mode_other_than_the_default():
  assert hybrid.chosen_label(_candidate("dynamic batching", (48, 16), 10.0)) == "dynamic batching (48/16)"
  sharded = _candidate("training groups only", (64, 0), 10.0, ("flat", "sharded"))
  assert hybrid.chosen_label(sharded) == "training only (64/0, sharded update)"
  accumulating = dataclasses.replace(
    _candidate("dynamic batching, accumulating", (36, 4), 10.0), micro_steps=(2, 4), sync="bf16"
  )
  assert (
    hybrid.chosen_label(accumulating) == "dynamic batching, accumulating (36/4, micro-steps 2/4, bf16 sync)"
  )


def test_markdown_table_gives_each_topology_its_ratios_and_marks_what_was_not_run():
  lim = Limits("train", 30.0, 0.0, 6.2, 0.4, 33.0)
  chosen = _candidate("dynamic batching", (48, 16), 32.0)  # 256 samples in 32 ms: 8000 samples/s
  free = _candidate("dynamic batching", (47, 17), 25.6)  # 10000 samples/s
  cases = {
    ("A100+A10", "resnet50"): {
      "100G": (chosen, 8000.0, 9600.0, lim, chosen),
      "free": (free, 10000.0, 9600.0, lim, free),
    }
  }
  lines = hybrid.markdown_table(cases).splitlines()
  assert len(lines) == 3 and lines[1] == "|" + "---|" * 10
  cells = [c.strip() for c in lines[2].strip("|").split("|")]
  assert cells == [
    "A100+A10",
    "resnet50",
    "dynamic batching (48/16)",
    "–",
    "–",
    "1.00× / –",
    "9600.0",
    "1.20 / – / 0.96",
    "1.000",
    "train; 6 / 0.4",
  ]
